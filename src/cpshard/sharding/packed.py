"""``shard_batch`` for packed batches: the ``packed`` (TE THD) and ``balanced`` layouts.

A packed batch is a dense batch (see :mod:`cpshard.sharding.batch`) plus a description of its
documents:

* ``seq_lens``: per row of ``[B, S]``, the document lengths (rest of the row = padding), or
* ``cu_seqlens``: offsets of the documents of a ``[1, T]`` stream (must end at ``T``).

Every rank computes the same :class:`~cpshard.layouts.packed.PackedPlan` from the document
lengths (no collective). The rows are flattened into one padded stream of ``P`` tokens (row-end
padding dropped; layout padding added), and rank ``r`` keeps ``plan.rank_map[r]``: every local
per-token tensor is ``[1, P / C, ...]``. Pad table as for dense batches (``input_ids`` ->
``padding_token_id``, ``labels`` -> -100, ``loss_mask`` -> 0, ``padding_mask`` -> True,
``inputs_embeds`` -> 0, extra keys -> their pad), except ``position_ids``: per document (computed
from the documents when the caller gives none; layout pads continue their document).
The local batch always carries ``padding_mask`` ``[1, P / C]`` (``True`` at layout pads and
at the caller's pads), at every CP size, so a consumer that counts or routes tokens (MoE routers,
auxiliary losses) sees the same real tokens at ``cp=1`` and ``cp=N``.
``seq_lens`` / ``cu_seqlens`` are consumed (not in the output batch): document ids of every
token travel in ``ctx.facts.token_meta``, and the attention masks with them. Packed batches
always need document masking, so the dispatcher's ``ctx()`` activates cpshard attention even at
``cp_size == 1``.

Import rules: the rows of ``RULES`` in tests/unit/test_architecture.py that cover this module.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch
from torch.distributed.device_mesh import DeviceMesh

from cpshard import _comm
from cpshard.layouts.balanced import plan_balanced
from cpshard.layouts.documents import PackSpec
from cpshard.layouts.index import arange_runs
from cpshard.layouts.packed import PackedPlan, plan_packed
from cpshard.names import PACKED_LAYOUTS
from cpshard.sharding.batch import (
    TokenKey,
    attention_mask_to_padding_mask,
    normalize_batch,
    pad_value,
)
from cpshard.sharding.facts import CPContext, ShardFacts
from cpshard.sharding.sharder import CPSharder

__all__ = ["pack_spec_of_batch", "packed_sharder", "shard_batch_packed"]


def pack_spec_of_batch(batch: Mapping[str, Any], row_shape: tuple[int, int]) -> PackSpec:
    """The document structure a packed batch declares.

    Args:
        batch: Holds ``seq_lens`` (per row document lengths), ``cu_seqlens`` (1-D offsets of
            a ``[1, T]`` stream), or else ``position_ids`` ``[B, S]`` (or ``[1, S]`` for every
            row) whose steps other than +1 start documents (padding then only from
            ``padding_mask`` / ``attention_mask``).
        row_shape: ``(B, S)`` of the primary input.

    Raises:
        ValueError: neither or both keys, ``cu_seqlens`` with ``B != 1``, or invalid lengths.
    """
    has_lens = batch.get("seq_lens") is not None
    has_cu = batch.get("cu_seqlens") is not None
    if not has_lens and not has_cu and batch.get("position_ids") is not None:
        # Documents start where positions do not step by +1; padding only from an explicit mask.
        pad = batch.get("padding_mask")
        if pad is None and batch.get("attention_mask") is not None:
            pad = attention_mask_to_padding_mask(batch["attention_mask"])
        pos = batch["position_ids"]
        if isinstance(pos, torch.Tensor) and pos.dim() == 2 and pos.shape[0] == 1:
            pos = pos.expand(row_shape[0], -1)  # one row of positions for every row, as HF
        return PackSpec.from_position_ids(pos, pad)
    if has_lens == has_cu:
        raise ValueError(
            "a packed batch needs exactly one of 'seq_lens' (document lengths per row), "
            "'cu_seqlens' (offsets of a [1, T] stream) or 'position_ids' that restart at 0 per "
            f"document, got {'both seq_lens and cu_seqlens' if has_lens else 'none of them'}"
        )
    bsz, seq_len = row_shape
    if has_lens:
        spec = PackSpec.from_seq_lens(batch["seq_lens"], seq_len)
        if spec.num_rows != bsz:
            raise ValueError(
                f"seq_lens has {spec.num_rows} rows but the batch has B={bsz} rows; give one "
                "list of document lengths per row"
            )
        return spec
    if bsz != 1:
        raise ValueError(
            f"cu_seqlens describes one [1, T] stream, but the batch has B={bsz} rows; flatten "
            "the rows to [1, B*S] or pass seq_lens per row"
        )
    return PackSpec.from_cu_seqlens(torch.as_tensor(batch["cu_seqlens"]), seq_len)


def _local_stream(
    plan: PackedPlan, rank: int, caller_padding: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """This rank's slots of the stream, from the plan's ``[P]`` arrays (where the caller marks
    pads of its own, or :func:`_local_pieces` cannot make them from runs): the caller index of
    each (``-1``: a layout pad), its position in its document, whether it is a pad, and the
    whole stream's pads where the caller marks pads of its own.

    Args:
        plan: The plan.
        rank: This rank (its row of the rank map: its stream positions, or the map's runs).
        caller_padding: The caller's ``padding_mask`` ``[B, S]`` (pads inside documents), or
            ``None``.

    Returns:
        ``(src, positions, pad, stream_pad)``: LongTensors ``[L]``, ``[L]``, a BoolTensor
        ``[L]`` (CPU), and the BoolTensor ``[P]`` of every stream pad (``None`` without
        ``caller_padding``: the plan's own pads, its documents as runs).
    """
    caller = plan.stream_input_sources
    stream_pad = plan.stream_padding_mask
    if caller_padding is not None:  # caller pads inside documents see only themselves too
        inside = caller_padding.bool().reshape(-1).cpu().index_select(0, caller.clamp(min=0))
        stream_pad = stream_pad | (inside & (caller >= 0))
    local = plan.rank_map[rank].cpu()
    src = caller.index_select(0, local)
    pos = plan.stream_position_ids.index_select(0, local)
    return (
        src,
        pos,
        stream_pad.index_select(0, local),
        stream_pad if caller_padding is not None else None,
    )


_COARSE_PIECES = 1024
"""A rank's local tokens are copied as slices of the caller's rows (:func:`_shard_pieces`) where
its pieces (:meth:`~cpshard.layouts.packed.StreamRuns.pieces_at`: its runs cut at documents,
joined where they continue each other in a caller row) average at least this many tokens; else
by one ``index_select`` of its caller indices. A slice costs ~3 us of Python per key, an index
~1-3 ns per token per key plus the indices' making once: measured even at ~3,000 tokens per
piece (balanced at 1M tokens, C = 2), far apart at 65 (TE ``packed``, C = 8: 5.7 against 0.4 ms
a key)."""


_Pieces = tuple[list[int], list[int], list[bool]]


def _local_pieces(
    plan: PackedPlan, rank: int
) -> tuple[torch.Tensor, torch.Tensor, _Pieces | None, torch.Tensor | None] | None:
    """This rank's slots made from the plan's map runs cut at the stream's runs (no ``[P]``
    array): ``(positions, pad, pieces, src)``, the positions ``[L]`` and pad mask ``[L]`` of its
    slots (CPU), and either its pieces where they are coarse (:data:`_COARSE_PIECES`; per piece
    of consecutive slots its first caller index, flat ``b * S + s``, its length, and whether it
    is a layout pad; neighbours that continue each other in one caller row are one piece), or
    else its caller indices ``[L]`` (``-1``: a layout pad). ``None`` where the plan keeps no
    runs or they are cut finer than one per 8 slots (:func:`_local_stream`)."""
    runs = plan.local_map_runs(rank)
    if runs is None:
        return None
    got = plan.stream.pieces_at(None, runs, 8, 0)
    if got is None or not got[0].size:
        return None
    src, step, pos, count = got
    positions = torch.from_numpy(arange_runs(pos, count, 1))
    pad = step == 0
    pad_mask = torch.from_numpy(np.repeat(pad, count))
    # join pads to pads, and caller runs that continue each other inside one row
    seq = plan.input_row_shape[1]
    real_next = ~pad[1:] & ~pad[:-1] & (src[1:] == src[:-1] + count[:-1]) & (src[1:] % seq != 0)
    joined = (pad[1:] & pad[:-1]) | real_next
    heads = np.flatnonzero(np.concatenate([[True], ~joined]))
    if _COARSE_PIECES * heads.size > plan.local_len:  # fine: one index per slot
        return positions, pad_mask, None, torch.from_numpy(arange_runs(src, count, step))
    pieces = (
        src[heads].tolist(),
        np.add.reduceat(count, heads).tolist(),
        pad[heads].tolist(),
    )
    return positions, pad_mask, pieces, None


def _shard_pieces(
    t: torch.Tensor,
    dim: int,
    fill: float | int | bool | torch.Tensor,
    pieces: _Pieces,
    rows: int,
) -> torch.Tensor:
    """:func:`_shard_key` from pieces (:func:`_local_pieces`): each real piece a slice of the
    caller's rows, each pad piece its fill, one ``cat`` (one copy, differentiable).

    Args:
        t: The caller's tensor, ``[B or 1, S, ...]`` with its sequence on ``dim``.
        dim: Its sequence dim.
        fill: Value of the layout pads, or ``[L]`` values per local slot (``position_ids``:
            the layout pads continue their document).
        pieces: ``(first caller index, length, is a pad)`` per piece, in slot order.
        rows: ``B`` of the batch.
    """
    moved = t.movedim(dim, 1)
    seq = moved.shape[1]
    flat = moved.reshape(-1, *moved.shape[2:])
    broadcast = moved.shape[0] != rows  # a batch-size-1 tensor broadcast over the rows
    # an empty slice of t first: the result is in t's autograd graph even if all are pads
    parts = [flat.narrow(0, 0, 0)]
    slot = 0
    for first, n, is_pad in zip(*pieces, strict=True):
        if not is_pad:
            parts.append(flat.narrow(0, first % seq if broadcast else first, n))
        elif isinstance(fill, torch.Tensor):
            part = fill[slot : slot + n].to(device=flat.device, dtype=flat.dtype)
            parts.append(part.reshape(n, *([1] * (flat.dim() - 1))).expand(n, *flat.shape[1:]))
        else:
            parts.append(flat.new_full((n, *flat.shape[1:]), fill))
        slot += n
    return torch.cat(parts).unsqueeze(0).movedim(1, dim).contiguous()


def _shard_key(
    t: torch.Tensor,
    dim: int,
    fill: float | int | bool,
    idx: torch.Tensor,
    pad: torch.Tensor | None,
    rows: int,
) -> torch.Tensor:
    """Caller tensor with sequence dim ``dim`` -> local ``[1, L, ...]`` (seq on dim 1): one
    ``index_select`` of this rank's tokens straight from the caller's rows (no stream), the layout
    pads set to ``fill`` in place.

    Args:
        t: The caller's tensor, ``[B or 1, S, ...]`` with its sequence on ``dim``.
        dim: Its sequence dim.
        fill: Value of the local slots no caller token fills.
        idx: LongTensor ``[L]``: the flat caller index of each local slot, ``0`` at layout pads
            (:func:`_local_stream`'s sources clamped).
        pad: BoolTensor ``[L]``: the layout pads (no caller token), ``None`` where there are
            none (nothing to fill).
        rows: ``B`` of the batch.
    """
    moved = t.movedim(dim, 1)
    seq = moved.shape[1]
    if moved.shape[0] != rows:  # a batch-size-1 tensor broadcast over the rows
        idx = idx % seq
    picked = moved.reshape(-1, *moved.shape[2:]).index_select(0, idx)
    if pad is not None:
        picked.masked_fill_(pad.reshape(-1, *([1] * (picked.dim() - 1))), fill)  # a fresh tensor
    return picked.unsqueeze(0).movedim(1, dim).contiguous()


def shard_batch_packed(
    cp_mesh: DeviceMesh | None,
    tp_mesh: DeviceMesh | None,
    batch: dict[str, Any],
    *,
    loss_mask: torch.Tensor | None = None,
    padding_token_id: int = 0,
    layout: str = "balanced",
    extra_token_keys: Mapping[str, TokenKey] | None = None,
) -> tuple[CPContext, dict[str, Any]]:
    """Shard a packed batch with the ``packed`` or ``balanced`` layout.

    Args:
        cp_mesh: 1-D CP mesh or ``None``.
        tp_mesh: Unused; part of the ``shard_batch`` contract.
        batch: Dense ``[B, S]`` batch plus ``seq_lens`` or ``cu_seqlens``; never mutated.
        loss_mask: Optional ``[B, S]`` loss mask.
        padding_token_id: Pad id for ``input_ids``.
        layout: ``"packed"`` (TE THD: each document padded to ``2C``) or ``"balanced"``.
        extra_token_keys: Caller-declared per-token keys.

    Returns:
        ``(ctx, batch)``: local per-token tensors ``[1, P / C, ...]`` in local order; the other
        keys pass through. ``ctx.facts`` captures ``padded_seq_len``, ``input_row_shape``,
        ``input_token_stream_positions``, the rank map and the token meta; ``ctx`` brings no
        context of its own (the dispatcher supplies CP attention over the token meta).
    """
    del tp_mesh
    if layout not in PACKED_LAYOUTS:
        raise ValueError(f"layout must be one of {PACKED_LAYOUTS}, got layout={layout!r}")
    rank, world = _comm.cp_rank_and_size(cp_mesh)
    extra = dict(extra_token_keys or {})
    given_positions = batch.get("position_ids") is not None
    plain = {k: v for k, v in batch.items() if k not in ("seq_lens", "cu_seqlens")}
    out, dims, primary = normalize_batch(plain, loss_mask=loss_mask, extra_token_keys=extra)
    x = out[primary]
    spec = pack_spec_of_batch(batch, (x.shape[0], x.shape[1]))
    plan = plan_balanced(spec, world) if layout == "balanced" else plan_packed(spec, world)
    device = x.device
    caller_padding = out.get("padding_mask")
    rows = plan.input_row_shape[0]
    # this rank's slots as coarse pieces (slices of the caller's rows), or their caller indices
    local = None if caller_padding is not None else _local_pieces(plan, rank)
    pieces = src = None
    if local is not None:
        local_pos, local_pad, pieces, src = local
        stream_pad = None
    else:
        src, local_pos, local_pad, stream_pad = _local_stream(plan, rank, caller_padding)
    local_pos, local_pad = local_pos.to(device), local_pad.to(device)
    if pieces is None:
        assert src is not None
        src = src.to(device)
        layout_pad = src < 0
        idx = src.clamp_(min=0)  # what every key reads
        pads = layout_pad if bool(layout_pad.any()) else None  # balanced: on the last rank only
    # the documents as runs, or the caller's pads inside them as well
    placement = plan.placement(device, None if stream_pad is None else stream_pad.to(device))
    if not given_positions:  # per document, straight from the plan: no caller round trip
        out["position_ids"] = local_pos[None]
        dims.pop("position_ids", None)
    elif out["position_ids"].dim() != 2:
        raise ValueError(
            "packed batches take 2-D position_ids [B, S] (per document); got shape "
            f"{tuple(out['position_ids'].shape)}"
        )
    for key, dim in dims.items():
        t = out[key]
        if key == "padding_mask":
            continue  # set below from the stream, layout pads included
        if key == "position_ids":  # layout pads continue their document's positions
            if pieces is not None:
                out[key] = _shard_pieces(t, dim, local_pos, pieces, rows)
                continue
            got = _shard_key(t, dim, 0, idx, pads, rows)
            if pads is not None:
                got = torch.where(pads[None], local_pos.to(got.dtype)[None], got)
            out[key] = got
        else:
            fill = pad_value(key, padding_token_id, extra)
            assert fill is not None
            if pieces is not None:
                out[key] = _shard_pieces(t, dim, fill, pieces, rows)
            else:
                out[key] = _shard_key(t, dim, fill, idx, pads, rows)
    # Always present (cp=1 too): CP layout pads and caller pads are True, so routers, auxiliary
    # losses and token counts can leave them out without knowing the layout.
    out["padding_mask"] = local_pad.unsqueeze(0)
    facts = ShardFacts.of(placement, rank)
    return CPContext(None, facts), out


def packed_sharder(
    layout: str, *, extra_token_keys: Mapping[str, TokenKey] | None = None
) -> CPSharder:
    """A :class:`CPSharder` for packed batches (``layout`` ``"packed"`` or ``"balanced"``).

    Its map is data-dependent (``local_token_global_indices is None``): the token verbs use the
    rank map captured by the last ``shard_batch``.
    """
    if layout not in PACKED_LAYOUTS:
        raise ValueError(f"layout must be one of {PACKED_LAYOUTS}, got layout={layout!r}")
    shard = functools.partial(shard_batch_packed, layout=layout, extra_token_keys=extra_token_keys)
    return CPSharder(shard_batch=shard, local_token_global_indices=None, layout=layout)
