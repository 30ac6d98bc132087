"""Tools built on the public contract: balance metrics, the cluster-run planner, the shipped text
corpus and the one local-rank launcher.

These serve the ``cpshard`` command, the parity run (:mod:`cpshard.parity`), the tests, the
benchmarks and the examples.

Import rules: the rows of ``RULES`` in tests/unit/test_architecture.py that cover this module.
"""
