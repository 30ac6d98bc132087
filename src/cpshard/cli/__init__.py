"""The ``cpshard`` command: argument parsing, runners and reports of each sub-command.

The work itself lives in :mod:`cpshard.tools`, :mod:`cpshard.parity` and the core; for
``cpshard parity`` the cli only parses and checks the arguments.

Import rules: the rows of ``RULES`` in tests/unit/test_architecture.py that cover this module.
"""
