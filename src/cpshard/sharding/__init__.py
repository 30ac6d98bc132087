"""Sharding: the ``CPSharder`` contract and how a batch and any per-token tensor follow a layout.

Owns :class:`~cpshard.sharding.sharder.CPSharder` and its captured facts (:mod:`.sharder`), the
batch conventions and the dense ``shard_batch`` (:mod:`.batch`), the packed ``shard_batch``
(:mod:`.packed`), the per-token facts attention reads (:class:`~cpshard.sharding.meta.TokenMeta`)
and label shifting on the global sequence (:mod:`.labels`).

Import rule: may import :mod:`cpshard.layouts`, :mod:`cpshard.guards.consistency` and
:mod:`cpshard._comm` (the only door to ``torch.distributed``). It never imports
:mod:`cpshard.attention`, :mod:`cpshard.dispatch`, :mod:`cpshard.tools`, :mod:`cpshard.cli` or
:mod:`cpshard.models`.
"""
