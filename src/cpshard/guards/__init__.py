"""Guard rails: mistakes of a training loop raise on every rank instead of computing garbage.

Owns the call-time guard on a CP-prepared model (:mod:`.model`: stale ctx or batch, forward
outside ``ctx()``, HF arguments that would be silently wrong, gradient checkpointing) and the
step's life on every rank (:mod:`.step`). The cross-rank batch fingerprint and the pad-id rule
live in :mod:`cpshard.sharding` (:mod:`~cpshard.sharding.consistency`,
:mod:`~cpshard.sharding.pad_id`).

Import rules: the rows of ``RULES`` in tests/unit/test_architecture.py that cover this module.
"""
