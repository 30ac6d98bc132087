"""``python -m cpshard ...`` runs the ``cpshard`` command (also under ``torchrun -m cpshard``).

Import rules: the rows of ``RULES`` in tests/unit/test_architecture.py that cover this module.
"""

from cpshard.cli.main import main

if __name__ == "__main__":
    raise SystemExit(main())
