"""The ``cpshard`` command."""
