"""``python -m cpshard ...`` runs the ``cpshard`` command (also under ``torchrun -m cpshard``)."""

from cpshard.cli.main import main

if __name__ == "__main__":
    raise SystemExit(main())
