"""Guard rails: mistakes of a training loop raise on every rank instead of computing garbage.

Owns the cross-rank batch fingerprint (:mod:`.consistency`), the pad-id rule (:mod:`.pad_id`)
and the call-time guard on a CP-prepared model (:mod:`.model`: stale ctx or batch, forward
outside ``ctx()``, HF arguments that would be silently wrong, gradient checkpointing).

Import rule: :mod:`.consistency` imports only torch and :mod:`cpshard._comm`, :mod:`.pad_id`
only torch (both sit below :mod:`cpshard.sharding`, which calls the fingerprint);
:mod:`.model` also reads :mod:`cpshard.sharding` tags and the active attention mode. Nothing here
imports :mod:`cpshard.dispatch`, :mod:`cpshard.tools`, :mod:`cpshard.cli` or
:mod:`cpshard.models` (``tests/unit/test_architecture.py``).
"""
