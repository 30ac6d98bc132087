"""cpshard: context parallelism as one uniform, correct contract."""
