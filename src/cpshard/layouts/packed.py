"""Layouts of packed batches over CP ranks: the :class:`PackedPlan` every packed layout returns,
``packed`` (TE THD) and the closed-form layouts applied to a packed stream (``balanced``, our
solver, is :mod:`cpshard.layouts.balanced`). Pure index math, no process group.

Every layout flattens the caller's ``[B, S]`` batch into one *padded stream* of length ``P``:

* documents in global order (row-major), **row-end padding dropped** (those input slots map to
  ``-1`` in :attr:`PackedPlan.input_token_stream_positions` and gather back as ``fill``);
* then the layout's own padding: ``packed`` pads every document to a multiple of ``2C`` (TE);
  the other layouts append one pad segment at the stream end (``balanced``: up to the next
  multiple of ``C``, i.e. at most ``C - 1`` pads).

Rank ``r`` owns ``rank_map[r]`` (``[C, L]``, ``L = P / C``), global stream positions in local
order. ``packed`` C=2, ``cu=[0,8,16]``::

    stream  a a b b b b a a | a a b b b b a a      r0 [0,1,6,7,8,9,14,15]
                                                   r1 [2,3,4,5,10,11,12,13]

Moving a caller tensor onto the stream and back is :mod:`cpshard.layouts.coordinates`, the one
caller-coordinate map.

Import rules: the rows of ``RULES`` in tests/unit/test_architecture.py that cover this module.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, replace

import numpy as np
import numpy.typing as npt
import torch

from cpshard.layouts.closed_form import ClosedFormLayout
from cpshard.layouts.coordinates import (
    CallerCoordinates,
    positions_to_stream,
    stream_to_positions,
)
from cpshard.layouts.documents import PackSpec
from cpshard.layouts.index import check_rank_map
from cpshard.layouts.placement import DocumentRuns, Placement, pad_document_ids

__all__ = [
    "PackedPlan",
    "plan_closed_form",
    "plan_from_stream",
    "plan_packed",
]

_I64 = npt.NDArray[np.int64]


@dataclass(frozen=True)
class PackedPlan:
    """Where every token of a packed batch lives under one layout.

    Attributes:
        layout: Diagnostic label (``"packed"``, ``"balanced"``, ...).
        world_size: CP size ``C``.
        padded_len: ``P``, length of the padded stream, ``C * L``.
        rank_map: LongTensor ``[C, L]``: row ``r`` = stream positions of rank ``r``'s local
            tokens in local order; a bijection onto ``arange(P)``.
        stream_document_ids: LongTensor ``[P]``: global document id per stream position,
            ``-1`` for pads.
        stream_position_ids: LongTensor ``[P]``: position inside the document (RoPE); pads
            continue the preceding document.
        input_token_stream_positions: LongTensor ``[B, S]``: stream position of each input
            token, ``-1`` for dropped row-end pads. Injective on its non-negative entries.
        input_row_shape: ``(B, S)`` of the caller's batch.
        solver_seconds: Wall time spent building the plan (rank map, stream facts, checks).
        stream_input_sources: LongTensor ``[P]``: the flat caller index (``b * S + s``) of each
            stream position, ``-1`` where no caller token fills it (the inverse of
            :attr:`input_token_stream_positions`, made from the same runs), or ``None`` (a plan
            built without it: the sharder inverts the input map).
        document_runs: ``(starts, ids)``, LongTensors ``[K]``: the stream's documents as runs
            (run ``k`` from position ``starts[k]``, document ``ids[k]``, ``-1`` for pads), or
            ``None``: :meth:`placement` then describes the documents by them
            (:class:`~cpshard.layouts.placement.DocumentRuns`) instead of ``P`` int64 ids.
    """

    layout: str
    world_size: int
    padded_len: int
    rank_map: torch.Tensor
    stream_document_ids: torch.Tensor
    stream_position_ids: torch.Tensor
    input_token_stream_positions: torch.Tensor
    input_row_shape: tuple[int, int]
    solver_seconds: float = 0.0
    stream_input_sources: torch.Tensor | None = None
    document_runs: tuple[torch.Tensor, torch.Tensor] | None = None

    @property
    def local_len(self) -> int:
        """``L = P / C``."""
        return self.padded_len // self.world_size

    @property
    def stream_padding_mask(self) -> torch.Tensor:
        """BoolTensor ``[P]``: ``True`` = pad."""
        return self.stream_document_ids < 0

    def token_work(self) -> torch.Tensor:
        """LongTensor ``[P]``: causal work of each query, ``position + 1`` (0 for pads)."""
        return torch.where(self.stream_padding_mask, 0, self.stream_position_ids + 1)

    def to_stream(self, x: torch.Tensor, fill: float | int | bool) -> torch.Tensor:
        """Caller ``[B, S, *F]`` -> stream ``[P, *F]``; stream pads get ``fill``
        (:func:`~cpshard.layouts.coordinates.positions_to_stream`)."""
        if tuple(x.shape[:2]) != self.input_row_shape:
            raise ValueError(
                f"expected a tensor [B, S, ...] with (B, S) = {self.input_row_shape}, "
                f"got shape {tuple(x.shape)}"
            )
        return positions_to_stream(x, self.input_token_stream_positions, self.padded_len, fill)

    def from_stream(self, stream: torch.Tensor, fill: float | int | bool) -> torch.Tensor:
        """Stream ``[P, *F]`` -> caller ``[B, S, *F]``; dropped slots get ``fill``
        (:func:`~cpshard.layouts.coordinates.stream_to_positions`)."""
        if stream.shape[0] != self.padded_len:
            raise ValueError(
                f"expected a stream [P, ...] with P={self.padded_len}, "
                f"got shape {tuple(stream.shape)}"
            )
        return stream_to_positions(stream, self.input_token_stream_positions, fill)

    def placement(
        self, device: torch.device, stream_padding: torch.Tensor | None = None
    ) -> Placement:
        """This plan as a :class:`~cpshard.layouts.placement.Placement` on ``device``.

        Args:
            device: Device of the maps.
            stream_padding: BoolTensor ``[P]`` on ``device`` (global order), ``True`` = pad:
                the plan's pads plus the caller's own pads inside documents; default the
                plan's pads (:attr:`stream_padding_mask`; the documents are then described by
                the plan's :attr:`document_runs` where it has them, their ids made if read).
        """
        docs: torch.Tensor | DocumentRuns
        if stream_padding is None and self.document_runs is not None:
            starts, ids = self.document_runs
            docs = DocumentRuns(starts, ids, self.padded_len, device, self.stream_document_ids)
        else:
            pad = self.stream_padding_mask.to(device) if stream_padding is None else stream_padding
            docs = pad_document_ids(self.stream_document_ids.to(device)[None], pad[None])
        coordinates = CallerCoordinates(
            None,
            self.padded_len,
            self.input_row_shape,
            self.input_token_stream_positions.to(device),
        )
        return Placement(self.rank_map.to(device), docs, coordinates)


def _check_world(spec: PackSpec, world_size: int) -> None:
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got world_size={world_size}")
    if spec.real_tokens == 0:
        raise ValueError(
            f"the packed batch holds no real tokens (all {spec.num_rows} rows are padding): "
            "there is nothing to train on; skip the batch before sharding (every CP rank holds "
            "the same batch, so every rank skips it)"
        )
    if spec.real_tokens < world_size:
        raise ValueError(
            f"cannot shard {spec.real_tokens} real tokens over world_size={world_size} CP "
            f"ranks: each rank needs >= 1 token; use a CP size <= {max(spec.real_tokens, 1)} "
            "or pack more documents"
        )


def _doc_lengths(spec: PackSpec) -> _I64:
    """:meth:`PackSpec.lengths` as an int64 array, without the tensor round trip."""
    flat = itertools.chain.from_iterable(spec.doc_lens)
    return np.fromiter(flat, dtype=np.int64, count=spec.num_docs)


def _runs(first: _I64, counts: _I64, step: _I64 | int, out: _I64 | None = None) -> _I64:
    """``concat(first[i] + step[i] * arange(counts[i]))`` as one int64 array, built in place
    (a repeat and a cumsum over the output; no ``[P]`` temporaries), into ``out`` if given
    (only with a scalar ``step``)."""
    keep = counts > 0
    first, counts = first[keep], counts[keep]
    if isinstance(step, int):
        if out is None:
            out = np.empty(int(counts.sum()), dtype=np.int64)
        out.fill(step)
        step_kept: _I64 | int = step
    else:
        step_kept = step[keep]
        out = np.repeat(step_kept, counts)
    if not counts.size:
        return out
    offsets = np.cumsum(counts) - counts
    jump = first.copy()
    jump[1:] -= first[:-1] + (counts[:-1] - 1) * (
        step_kept if isinstance(step_kept, int) else step_kept[:-1]
    )
    out[offsets] = jump
    np.cumsum(out, out=out)
    return out


def _stream_facts(
    spec: PackSpec, lens: _I64, seg_lens: _I64, padded_len: int
) -> tuple[
    torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, tuple[torch.Tensor, torch.Tensor]
]:
    """Stream doc ids, positions, the input map, its inverse (the caller index of each stream
    position) and the documents as runs (first position and id of each) when document ``d``
    occupies ``[start_d, start_d + seg_lens[d])`` of the stream (its ``lens[d]`` real tokens
    first)."""
    n_docs = lens.size
    starts = np.cumsum(seg_lens) - seg_lens
    total = int(seg_lens.sum())
    tail = padded_len - total  # the end pad
    # doc ids: runs of d (real) and -1 (document padding), then the end pad
    ids = np.empty(2 * n_docs + 1, dtype=np.int64)
    ids[0:-1:2] = np.arange(n_docs)
    ids[1::2] = -1
    ids[-1] = -1
    cnt = np.empty(2 * n_docs + 1, dtype=np.int64)
    cnt[0:-1:2] = lens
    cnt[1:-1:2] = seg_lens - lens
    cnt[-1] = tail
    doc_ids = np.repeat(ids, cnt)
    # positions restart at every document; the end pad continues the last document
    last = int(seg_lens[-1]) if n_docs else 0
    pos = _runs(np.append(np.zeros(n_docs, dtype=np.int64), last), np.append(seg_lens, tail), 1)
    # input map: per row, the documents' real tokens, then the row's pad (-1)
    rows = spec.doc_lens
    row_ends = np.cumsum(np.fromiter((len(r) for r in rows), dtype=np.int64, count=len(rows)))
    row_pad = np.fromiter((spec.row_len - sum(r) for r in rows), dtype=np.int64, count=len(rows))
    first = np.insert(starts, row_ends, -1)
    counts = np.insert(lens, row_ends, row_pad)
    step = np.insert(np.ones(n_docs, dtype=np.int64), row_ends, 0)
    idx = _runs(first, counts, step)
    # the inverse, in stream order: document d's real tokens come from its caller slots (row by
    # row, the documents of a row one after the other), its padding and the end pad from none
    row_of_doc = np.repeat(np.arange(len(rows), dtype=np.int64), np.diff(row_ends, prepend=0))
    row_tokens = spec.row_len - row_pad
    before_row = np.cumsum(row_tokens) - row_tokens
    in_row = np.cumsum(lens) - lens - before_row[row_of_doc]
    src_first = np.full(2 * n_docs + 1, -1, dtype=np.int64)  # padding and the end pad: -1
    src_first[0:-1:2] = row_of_doc * spec.row_len + in_row
    src_step = np.zeros(2 * n_docs + 1, dtype=np.int64)
    src_step[0:-1:2] = 1
    src = _runs(src_first, cnt, src_step)
    kept = cnt > 0  # the documents as runs: (first position, id) of every non-empty run
    run_starts = (np.cumsum(cnt) - cnt)[kept]
    return (
        torch.from_numpy(doc_ids),
        torch.from_numpy(pos),
        torch.from_numpy(idx).view(spec.num_rows, spec.row_len),
        torch.from_numpy(src),
        (torch.from_numpy(run_starts), torch.from_numpy(ids[kept])),
    )


def plan_from_stream(
    spec: PackSpec,
    layout: str,
    rank_map: torch.Tensor,
    doc_padded_lens: torch.Tensor | None = None,
    solver_seconds: float = 0.0,
) -> PackedPlan:
    """Wrap a ``[C, L]`` rank map over the stream of ``spec`` into a checked :class:`PackedPlan`.

    Args:
        spec: The batch's document structure.
        layout: Label.
        rank_map: LongTensor ``[C, L]`` over ``arange(C * L)``.
        doc_padded_lens: LongTensor ``[D]`` of per-document stream lengths (``>= lengths``),
            or ``None`` for unpadded documents; the stream end is padded up to ``C * L``.
        solver_seconds: Time the caller spent computing ``rank_map``.
    """
    padded = int(rank_map.numel())
    check_rank_map(rank_map, padded)
    lens = _doc_lengths(spec)
    seg = lens if doc_padded_lens is None else doc_padded_lens.numpy().astype(np.int64)
    doc_ids, pos, idx, src, runs = _stream_facts(spec, lens, seg, padded)
    return PackedPlan(
        layout=layout,
        world_size=int(rank_map.shape[0]),
        padded_len=padded,
        rank_map=rank_map,
        stream_document_ids=doc_ids,
        stream_position_ids=pos,
        input_token_stream_positions=idx,
        input_row_shape=(spec.num_rows, spec.row_len),
        solver_seconds=solver_seconds,
        stream_input_sources=src,
        document_runs=runs,
    )


def plan_packed(spec: PackSpec, world_size: int) -> PackedPlan:
    """TransformerEngine THD layout: every document padded to a multiple of ``2C``; rank ``r``
    owns chunks ``r`` and ``2C-1-r`` of every document, document by document.

    Example:
        >>> spec = PackSpec.from_cu_seqlens(torch.tensor([0, 4, 12]), 12)
        >>> plan_packed(spec, 2).rank_map.tolist()
        [[0, 3, 4, 5, 10, 11], [1, 2, 6, 7, 8, 9]]
    """
    _check_world(spec, world_size)
    t0 = time.perf_counter()
    two_c = 2 * world_size
    padded = (_doc_lengths(spec) + two_c - 1) // two_c * two_c
    chunk = padded // two_c
    starts = np.cumsum(padded) - padded
    r = np.arange(world_size)[:, None]
    first = np.empty((world_size, padded.size, 2), dtype=np.int64)  # rank, document, head/tail
    first[:, :, 0] = starts + r * chunk
    first[:, :, 1] = starts + (two_c - 1 - r) * chunk
    counts = np.broadcast_to(chunk[None, :, None], first.shape)
    flat = _runs(first.reshape(-1), counts.reshape(-1), 1)
    rank_map = torch.from_numpy(flat.reshape(world_size, -1))
    plan = plan_from_stream(spec, "packed", rank_map, torch.from_numpy(padded))
    return replace(plan, solver_seconds=time.perf_counter() - t0)


def plan_closed_form(spec: PackSpec, world_size: int, layout: ClosedFormLayout) -> PackedPlan:
    """A closed-form layout (``contiguous``, ``round_robin``) over the packed stream: documents
    back to back, padded at the end to the layout's divisor."""
    _check_world(spec, world_size)
    t0 = time.perf_counter()
    padded = layout.padded_length(spec.real_tokens, world_size)
    rank_map = layout.rank_map(world_size, padded)
    plan = plan_from_stream(spec, layout.name, rank_map, None)
    return replace(plan, solver_seconds=time.perf_counter() - t0)
