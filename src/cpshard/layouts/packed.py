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

import functools
import itertools
import time
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt
import torch

from cpshard.layouts.closed_form import ClosedFormLayout
from cpshard.layouts.coordinates import (
    CallerCoordinates,
    positions_to_stream,
    stream_to_positions,
)
from cpshard.layouts.deferred import Deferred, DeferredField, replace
from cpshard.layouts.documents import PackSpec
from cpshard.layouts.index import arange_runs, check_map_runs, check_rank_map, runs_over
from cpshard.layouts.placement import (
    DocumentRuns,
    Placement,
    attach_stream_runs,
    pad_document_ids,
)

__all__ = [
    "PackedPlan",
    "StreamRuns",
    "plan_closed_form",
    "plan_from_runs",
    "plan_from_stream",
    "plan_packed",
]

_I64 = npt.NDArray[np.int64]


@dataclass(frozen=True, eq=False)
class StreamRuns:
    """The padded stream of a packed plan as ``K`` runs: run ``k`` covers stream positions
    ``[starts[k], starts[k] + counts[k])``, all of document ``ids[k]`` (``-1``: pads), their
    positions inside the document ``pos_first[k], pos_first[k] + 1, ...`` and their caller
    indices ``src_first[k] + src_step[k] * i`` (``-1``, step 0: no caller token fills them).

    Everything a plan says per stream position is made from these runs: the whole ``[P]`` arrays
    when read (:class:`PackedPlan`'s), or only one rank's slots (:meth:`at`).

    Attributes:
        starts: ``[K]`` int64, ``0`` first, strictly increasing (every run non-empty).
        counts: ``[K]`` int64, ``> 0``, summing to ``P``.
        ids: ``[K]`` int64 document ids, ``-1`` for pads.
        pos_first: ``[K]`` int64, the position id of each run's first token.
        src_first: ``[K]`` int64, the flat caller index (``b * S + s``) of each run's first
            token, ``-1`` where no caller token fills the run.
        src_step: ``[K]`` int64, ``1`` (caller tokens) or ``0`` (no caller token).
    """

    starts: _I64
    counts: _I64
    ids: _I64
    pos_first: _I64
    src_first: _I64
    src_step: _I64

    @property
    def length(self) -> int:
        """``P``."""
        return int(self.starts[-1] + self.counts[-1]) if self.starts.size else 0

    def document_ids(self) -> _I64:
        """``[P]``: the document of each position, ``-1`` for pads."""
        return np.repeat(self.ids, self.counts)

    def positions(self) -> _I64:
        """``[P]``: the position of each token inside its document."""
        return arange_runs(self.pos_first, self.counts, 1)

    def sources(self) -> _I64:
        """``[P]``: the flat caller index of each position, ``-1`` where none fills it."""
        return arange_runs(self.src_first, self.counts, self.src_step)

    def at(
        self, stream: _I64, runs: tuple[_I64, _I64] | None = None
    ) -> tuple[_I64, _I64, npt.NDArray[np.bool_]] | None:
        """``(sources, positions, pads)`` of the stream positions ``stream`` (``[L]``, e.g. one
        rank's row of the rank map), made from the runs of consecutive positions in ``stream``
        cut at this stream's runs (no ``[P]`` array); ``None`` where ``stream`` is cut finer than
        one run per 8 positions (the caller then indexes the whole arrays).

        Args:
            stream: ``[L]`` int64 stream positions, any order.
            runs: ``(first, count)``: ``stream``'s runs of consecutive positions, where known
                (no pass over ``stream``).

        Returns:
            ``[L]`` int64 caller indices (``-1``: none), ``[L]`` int64 positions, ``[L]`` bools
            (``True``: a pad), or ``None``.
        """
        if stream.size == 0:
            return np.empty(0, np.int64), np.empty(0, np.int64), np.empty(0, bool)
        got = self.pieces_at(stream, runs, 8, 0)
        if got is None:
            return None
        src, step, pos, count = got
        return (
            arange_runs(src, count, step),
            arange_runs(pos, count, 1),
            np.repeat(step == 0, count),
        )

    def pieces_at(
        self, stream: _I64 | None, runs: tuple[_I64, _I64] | None, min_run: int, min_piece: int
    ) -> tuple[_I64, _I64, _I64, _I64] | None:
        """The stream positions ``stream`` (or their runs) as pieces, each of consecutive
        positions inside one run of this stream: ``(src_first, src_step, pos_first, count)``
        per piece, in ``stream``'s order. Piece ``i`` is ``count[i]`` slots whose caller indices
        are ``src_first[i] + src_step[i] * j`` (``src_step`` 0: a pad, no caller token,
        ``src_first`` ``-1``) and positions ``pos_first[i] + j``.

        Args:
            stream: ``[L]`` int64 stream positions, any order (``None`` with ``runs``).
            runs: ``(first, count)``: their runs of consecutive positions, where known.
            min_run: ``None`` where ``stream``'s runs average fewer than this many positions.
            min_piece: ``None`` where the pieces (those runs cut at this stream's runs) average
                fewer than this many slots.

        Returns:
            Four ``[N]`` int64 arrays, or ``None``.
        """
        cut = runs_over(stream, self.starts, self.length, min_run, runs=runs)
        if cut is None:
            return None
        k, lo, count = cut
        if min_piece * count.size > int(count.sum()):
            return None
        into = lo - self.starts[k]
        step = self.src_step[k]
        return self.src_first[k] + step * into, step, self.pos_first[k] + into, count


@dataclass(frozen=True)
class PackedPlan:
    """Where every token of a packed batch lives under one layout.

    The per-position facts of the stream (:attr:`stream_document_ids`,
    :attr:`stream_position_ids`, :attr:`stream_input_sources`) are made from :attr:`stream`'s
    runs on first read; a prepare reads only its rank's slots (:meth:`StreamRuns.at`).

    Attributes:
        layout: Diagnostic label (``"packed"``, ``"balanced"``, ...).
        world_size: CP size ``C``.
        padded_len: ``P``, length of the padded stream, ``C * L``.
        rank_map: LongTensor ``[C, L]``: row ``r`` = stream positions of rank ``r``'s local
            tokens in local order; a bijection onto ``arange(P)``.
        input_row_shape: ``(B, S)`` of the caller's batch.
        stream: The stream as runs (:class:`StreamRuns`).
        input_token_stream_positions: LongTensor ``[B, S]``: stream position of each input
            token, ``-1`` for dropped row-end pads. Injective on its non-negative entries.
            Required; a plan made from runs gives a maker (made on first read: the token verbs
            in input coordinates read it, a prepare does not).
        solver_seconds: Wall time spent building the plan (rank map, stream facts, checks).
        map_runs: ``(first, count)``, int64 ``[K]`` each: the maximal runs of consecutive
            positions inside each row of the rank map flattened (:func:`plan_from_runs`), or
            ``None`` (a map given whole).
    """

    layout: str
    world_size: int
    padded_len: int
    rank_map: torch.Tensor
    input_row_shape: tuple[int, int]
    stream: StreamRuns
    # a value or a Deferred maker, read as the value (cpshard.layouts.deferred); required
    input_token_stream_positions: torch.Tensor = DeferredField()  # type: ignore[assignment]  # noqa: RUF009
    solver_seconds: float = 0.0
    map_runs: tuple[_I64, _I64] | None = None

    def local_map_runs(self, rank: int) -> tuple[_I64, _I64] | None:
        """:attr:`map_runs` of rank ``rank``'s row of the rank map (``None`` without them)."""
        if self.map_runs is None:
            return None
        first, count = self.map_runs
        slot = np.cumsum(count) - count
        mine = slot // self.local_len == rank
        return first[mine], count[mine]

    @functools.cached_property
    def stream_document_ids(self) -> torch.Tensor:
        """LongTensor ``[P]``: global document id per stream position, ``-1`` for pads."""
        return torch.from_numpy(self.stream.document_ids())

    @functools.cached_property
    def stream_position_ids(self) -> torch.Tensor:
        """LongTensor ``[P]``: position inside the document (RoPE); pads continue the
        preceding document."""
        return torch.from_numpy(self.stream.positions())

    @functools.cached_property
    def stream_input_sources(self) -> torch.Tensor:
        """LongTensor ``[P]``: the flat caller index (``b * S + s``) of each stream position,
        ``-1`` where no caller token fills it (the inverse of
        :attr:`input_token_stream_positions`)."""
        return torch.from_numpy(self.stream.sources())

    @property
    def document_runs(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(starts, ids)``, LongTensors ``[K]``: the stream's documents as runs (run ``k``
        from position ``starts[k]``, document ``ids[k]``, ``-1`` for pads)."""
        return torch.from_numpy(self.stream.starts), torch.from_numpy(self.stream.ids)

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
                the plan's :attr:`document_runs`, their ids made if read).
        """
        docs: torch.Tensor | DocumentRuns
        if stream_padding is None:
            starts, ids = self.document_runs
            made = self.__dict__.get("stream_document_ids")  # the ids, where read already
            docs = DocumentRuns(starts, ids, self.padded_len, device, made)
        else:
            pad = self.stream_padding_mask.to(device) if stream_padding is None else stream_padding
            docs = pad_document_ids(self.stream_document_ids.to(device)[None], pad[None])
        coordinates = CallerCoordinates(
            None,
            self.padded_len,
            self.input_row_shape,
            Deferred(lambda: self.input_token_stream_positions.to(device)),  # type: ignore[arg-type]
        )
        place = Placement(self.rank_map.to(device), docs, coordinates)
        runs = self.map_runs
        if runs is not None and runs[0].size * _COARSE_RUNS <= self.padded_len:
            # the map is made from its runs (plan_from_runs): the placement slices them
            attach_stream_runs(place, tuple(zip(runs[0].tolist(), runs[1].tolist(), strict=True)))
        return place


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


def _row_counts(spec: PackSpec) -> tuple[_I64, _I64]:
    """``(documents, trailing pads)`` per row, int64 ``[B]`` each."""
    per_row = np.fromiter((len(r) for r in spec.doc_lens), dtype=np.int64, count=spec.num_rows)
    return per_row, np.array(spec.row_pad, dtype=np.int64)


def _stream_facts(spec: PackSpec, lens: _I64, seg_lens: _I64, padded_len: int) -> StreamRuns:
    """The stream as runs when document ``d`` occupies ``[start_d, start_d + seg_lens[d])`` of
    the stream (its ``lens[d]`` real tokens first)."""
    n_docs = lens.size
    # runs: per document its real tokens (id d) and its padding (-1), then the end pad
    ids = np.empty(2 * n_docs + 1, dtype=np.int64)
    ids[0:-1:2] = np.arange(n_docs)
    ids[1::2] = -1
    ids[-1] = -1
    cnt = np.empty(2 * n_docs + 1, dtype=np.int64)
    cnt[0:-1:2] = lens
    cnt[1:-1:2] = seg_lens - lens
    cnt[-1] = padded_len - int(seg_lens.sum())
    # positions restart at every document; its padding and the end pad continue it
    pos_first = np.zeros(2 * n_docs + 1, dtype=np.int64)
    pos_first[1:-1:2] = lens
    pos_first[-1] = int(seg_lens[-1]) if n_docs else 0
    # the sources: document d's real tokens come from its caller slots (row by row, the
    # documents of a row one after the other), its padding and the end pad from none
    per_row, row_pad = _row_counts(spec)
    row_of_doc = np.repeat(np.arange(per_row.size, dtype=np.int64), per_row)
    row_tokens = spec.row_len - row_pad
    before_row = np.cumsum(row_tokens) - row_tokens
    in_row = np.cumsum(lens) - lens - before_row[row_of_doc]
    src_first = np.full(2 * n_docs + 1, -1, dtype=np.int64)
    src_first[0:-1:2] = row_of_doc * spec.row_len + in_row
    src_step = np.zeros(2 * n_docs + 1, dtype=np.int64)
    src_step[0:-1:2] = 1
    kept = cnt > 0
    run_starts = (np.cumsum(cnt) - cnt)[kept]
    return StreamRuns(
        run_starts, cnt[kept], ids[kept], pos_first[kept], src_first[kept], src_step[kept]
    )


def _input_map(spec: PackSpec, lens: _I64, seg_lens: _I64) -> torch.Tensor:
    """The input map ``[B, S]``: the stream position of each caller token, ``-1`` for row-end
    pads (per row, the documents' real tokens, then the row's pad), document ``d`` starting at
    ``cumsum(seg_lens)[d] - seg_lens[d]``."""
    starts = np.cumsum(seg_lens) - seg_lens
    per_row, row_pad = _row_counts(spec)
    row_ends = np.cumsum(per_row)
    first = np.insert(starts, row_ends, -1)
    counts = np.insert(lens, row_ends, row_pad)
    step = np.insert(np.ones(lens.size, dtype=np.int64), row_ends, 0)
    idx = arange_runs(first, counts, step)
    return torch.from_numpy(idx).view(spec.num_rows, spec.row_len)


_COARSE_RUNS = 64
"""A plan's placement carries its map's runs (:attr:`Placement.stream_runs`) where they average
at least this many positions (``balanced``: a few per document; not TE's ``packed`` at high
CP, whose thousands of runs would cost more as Python tuples than one pass over the map)."""


def plan_from_runs(
    spec: PackSpec,
    layout: str,
    world_size: int,
    first: _I64,
    count: _I64,
    doc_padded_lens: torch.Tensor | None = None,
) -> PackedPlan:
    """The :class:`PackedPlan` whose rank map is made from runs of consecutive stream
    positions: neighbours that continue each other in one row are joined, the runs are checked
    in ``O(runs log runs)`` (:func:`check_map_runs`) instead of the map token by token (where
    they average fewer than :data:`_COARSE_RUNS` positions, the map is: one pass costs less than
    sorting them), and the plan keeps them (:attr:`PackedPlan.map_runs`).

    Args:
        spec: The batch's document structure.
        layout: Label.
        world_size: ``C``.
        first: ``[K]`` int64, the first stream position of each run, in slot order (rank 0's
            local slots first).
        count: ``[K]`` int64 run lengths, ``> 0``, none across a rank's row.
        doc_padded_lens: As for :func:`plan_from_stream`.

    Raises:
        ValueError: runs that do not make a ``[C, L]`` bijection onto ``arange(P)``.
    """
    padded = int(count.sum())
    fine = first.size * _COARSE_RUNS > padded  # many short runs: one pass over the map is cheaper
    check_map_runs(first, count, padded, world_size, tiling=not fine)
    # neighbours that continue each other inside one row are one run (TE's head and tail
    # chunks of a document at C = 1, a balanced rank's consecutive pieces)
    slot = np.cumsum(count) - count
    joined = (first[1:] == first[:-1] + count[:-1]) & (slot[1:] % (padded // world_size) != 0)
    if joined.any():
        heads = np.flatnonzero(np.concatenate([[True], ~joined]))
        first, count = first[heads], np.add.reduceat(count, heads)
    flat = arange_runs(first, count, 1)
    if fine:  # the tiling, on the map made
        check_rank_map(torch.from_numpy(flat).view(world_size, -1), padded)
    plan = _plan(spec, layout, torch.from_numpy(flat.reshape(world_size, -1)), doc_padded_lens)
    return replace(plan, map_runs=(first, count))


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
    check_rank_map(rank_map, int(rank_map.numel()))
    return replace(_plan(spec, layout, rank_map, doc_padded_lens), solver_seconds=solver_seconds)


def _plan(
    spec: PackSpec, layout: str, rank_map: torch.Tensor, doc_padded_lens: torch.Tensor | None
) -> PackedPlan:
    """The plan of a checked rank map."""
    padded = int(rank_map.numel())
    lens = _doc_lengths(spec)
    seg = lens if doc_padded_lens is None else doc_padded_lens.numpy().astype(np.int64)
    return PackedPlan(
        layout=layout,
        world_size=int(rank_map.shape[0]),
        padded_len=padded,
        rank_map=rank_map,
        # made on first read: the token verbs in input coordinates read it, a prepare does not
        input_token_stream_positions=Deferred(functools.partial(_input_map, spec, lens, seg)),  # type: ignore[arg-type]
        input_row_shape=(spec.num_rows, spec.row_len),
        stream=_stream_facts(spec, lens, seg, padded),
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
    counts = np.broadcast_to(chunk[None, :, None], first.shape).reshape(-1)
    plan = plan_from_runs(
        spec, "packed", world_size, first.reshape(-1), counts, torch.from_numpy(padded)
    )
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
