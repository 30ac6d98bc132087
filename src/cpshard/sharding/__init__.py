"""Sharding: the ``CPSharder`` contract and how a batch and any per-token tensor follow a layout.

Owns :class:`~cpshard.sharding.sharder.CPSharder` and its token verbs (:mod:`.sharder`), the
frozen facts one shard learned, the :class:`~cpshard.sharding.facts.CPContext` that carries them
and the batch identity of local tensors (:mod:`.facts`), the gather/scatter index the verbs copy
with (:mod:`.token_index`), the batch conventions and the dense ``shard_batch`` (:mod:`.batch`),
the packed ``shard_batch`` (:mod:`.packed`), the per-token facts attention reads
(:class:`~cpshard.sharding.meta.TokenMeta`), label shifting on the global sequence
(:mod:`.labels`), the cross-rank batch fingerprint (:mod:`.consistency`) and the pad-id rule
(:mod:`.pad_id`). The caller-coordinate map is :mod:`cpshard.layouts.coordinates`; where every
token of a batch lives is one frozen :class:`~cpshard.layouts.placement.Placement`. The public
toolkit of a custom sharder (:mod:`.toolkit`) is re-exported here.

Sharding only shards: a built-in ``shard_batch`` returns a context with no attention in it, and
the dispatcher (:mod:`cpshard.dispatch`) composes CP attention over the shard's token meta.

Import rules: the rows of ``RULES`` in tests/unit/test_architecture.py that cover this module.
"""

from cpshard.sharding.meta import TokenMeta
from cpshard.sharding.sharder import CPSharder
from cpshard.sharding.toolkit import (
    CallerCoordinates,
    CPContext,
    Placement,
    ShardFacts,
    TokenKey,
    cp_rank_and_size,
    facts_from_placement,
    normalize_batch,
    pad_document_ids,
    pad_tokens,
    pad_value,
)

__all__ = [
    "CPContext",
    "CPSharder",
    "CallerCoordinates",
    "Placement",
    "ShardFacts",
    "TokenKey",
    "TokenMeta",
    "cp_rank_and_size",
    "facts_from_placement",
    "normalize_batch",
    "pad_document_ids",
    "pad_tokens",
    "pad_value",
]
