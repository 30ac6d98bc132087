"""The public toolkit of a model-owned (or any custom) sharder: everything a ``shard_batch``
needs, from one import.

A custom ``shard_batch`` (``(cp_mesh, tp_mesh, batch, *, loss_mask, padding_token_id) ->
(ctx, batch)``) brings the batch to the conventions (:func:`normalize_batch`), pads it with the
pad table (:func:`pad_value`, :func:`pad_tokens`), says where every token lives in one
:class:`~cpshard.layouts.placement.Placement` and returns ``CPContext(None,
facts_from_placement(placement, cp_mesh))``: the rank map, the token meta CP attention reads and
the caller coordinates of the token verbs all follow from the placement. ``cpshard.models``'
``global_prefix`` is written with it.

Import rules: the rows of ``RULES`` in tests/unit/test_architecture.py that cover this module.
"""

from __future__ import annotations

from torch.distributed.device_mesh import DeviceMesh

from cpshard import _comm
from cpshard.layouts.coordinates import CallerCoordinates
from cpshard.layouts.placement import Placement, pad_document_ids
from cpshard.sharding.batch import TokenKey, normalize_batch, pad_tokens, pad_value
from cpshard.sharding.facts import CPContext, ShardFacts

__all__ = [
    "CPContext",
    "CallerCoordinates",
    "Placement",
    "ShardFacts",
    "TokenKey",
    "cp_rank_and_size",
    "facts_from_placement",
    "normalize_batch",
    "pad_document_ids",
    "pad_tokens",
    "pad_value",
]


def cp_rank_and_size(cp_mesh: DeviceMesh | None) -> tuple[int, int]:
    """``(rank, size)`` of this process in the 1-D CP mesh; ``(0, 1)`` for ``None``."""
    return _comm.cp_rank_and_size(cp_mesh)


def facts_from_placement(placement: Placement, cp_mesh: DeviceMesh | None) -> ShardFacts:
    """This rank's facts of a placement (:meth:`ShardFacts.of` at the mesh's rank).

    Args:
        placement: Where every token of the batch lives (``placement.world_size`` must be the
            mesh's size).
        cp_mesh: 1-D CP mesh or ``None``.

    Raises:
        ValueError: the placement is for another CP size than the mesh.
    """
    rank, world = _comm.cp_rank_and_size(cp_mesh)
    if placement.world_size != world:
        raise ValueError(
            f"the placement spreads the batch over {placement.world_size} ranks, but the CP "
            f"mesh has {world}; build it for the mesh's size"
        )
    return ShardFacts.of(placement, rank)
