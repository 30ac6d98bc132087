"""One attention plan per batch: which query rows meet which key rows, cut into kernel calls.

Not to be confused with :class:`~cpshard.layouts.packed.PackedPlan` (where tokens live): an
:class:`AttentionPlan` says which blocks attention computes.

The plan is built on the host from the token meta (global position and document id of every
token of every rank) once per batch and reused by every layer and by the backward; the per-layer
code only runs kernels and collectives over the plan's static slices (no host-device sync, no
data-dependent Python branching).

For a query set and a key set (the local shard and the gathered stream, one ring block, or the
whole stream for Ulysses) the plan finds the *runs* of each side (maximal stretches of one
document with consecutive positions, contiguous in the tensor; a stretch of padding is one run),
pairs query runs with key runs by sorted intervals (:func:`~cpshard.attention.pieces.pair_runs`:
binary searches, never all against all), and cuts each pair into *pieces* whose pairs are all
visible:

* ``FULL``: every key at or before every query (and inside the window) -> kernel without a mask;
* ``CAUSAL``: the same positions on both sides -> the kernel's own ``is_causal``;
* ``EDGE``: a bounded piece on the border of a sliding window (at most :data:`TILE` square);
* ``IDENT``: padding against itself (a pad sees only itself).

Visibility: ``same document & k_pos <= q_pos`` (causal) ``& q_pos - k_pos < window`` (sliding
window). Small pieces of one aligned :data:`TILE` x :data:`TILE` cell (many tiny documents, window
borders, padding) are grouped into *masked tiles* whose bool mask is the union of their pieces'
patterns, prepared once here. So no dense ``[Lq, Lk]`` mask is ever built for document structure;
memory stays ``O(L * D)`` plus one tile per masked call.

The local queries are paired once with the runs of the whole stream (cut at the rank blocks);
the ring's per-block plans, the all-gather's and its split are selections of those pieces. Ulysses
attends the whole stream to itself: where the rank-major stream cuts documents into many runs (a
head-tail layout cuts each into ``2C`` chunks, which would pair as ``(2C)^2``), its plan carries a
slot order (:attr:`PairPlan.slot_order`) that sorts the stream by position, and the runner
(:mod:`.blockwise`) attends in that order: one run per document again.

Import rules: the rows of ``RULES`` in tests/unit/test_architecture.py that cover this module.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from cpshard.attention.pad_runs import (
    blocked_runs,
    pad_table,
    rank_map_runs,
    row_groups_by_pads,
    runs_table,
)
from cpshard.attention.pieces import (
    PAD_CLASS,
    SMALL_PAIRS,
    TILE,
    Pieces,
    RunTable,
    Task,
    cut_pairs,
    join_runs,
    pair_runs,
    run_table,
    tasks_by_key,
)
from cpshard.layouts.placement import DocumentRuns
from cpshard.sharding.meta import TokenMeta

__all__ = [
    "SMALL_PAIRS",
    "TILE",
    "AttentionPlan",
    "HostRows",
    "PairPlan",
    "Task",
    "attention_plan",
    "block_table",
    "check_window",
    "host_rows",
    "join_runs",
    "pair_plan",
    "pair_plan_of_runs",
    "pair_plans_of_runs",
    "stream_table",
    "take_spans",
]


@dataclass(frozen=True)
class PairPlan:
    """The kernel calls of one (query set, key set) pair.

    Attributes:
        groups: ``(rows, tasks)`` per group of batch rows that share one structure; ``rows`` is a
            LongTensor of batch indices, or ``None`` for every row (meta batch 1 or all equal).
        computed: Query-key pairs the kernels compute (causal pieces count their triangle).
        needed: Query-key pairs the mask makes visible (per meta row, summed).
        empty: No query sees any key (a plain bool, so compiled code reads a constant).
        slot_order: Per group, ``None`` or a LongTensor ``[N]`` permutation of the slots: the
            tasks of that group index the query and key tensors *taken in this order* (only
            for a pair whose query and key sets are the same slots, Ulysses' stream against
            itself). Empty = ``None`` for every group. :mod:`.blockwise` applies it.
    """

    groups: tuple[tuple[torch.Tensor | None, tuple[Task, ...]], ...]
    computed: int
    needed: int
    empty: bool
    slot_order: tuple[torch.Tensor | None, ...] = ()

    def order_of(self, group: int) -> torch.Tensor | None:
        """The slot order of group ``group`` (``None``: the tensors' own order)."""
        return self.slot_order[group] if self.slot_order else None


def check_window(window: int | None, causal: bool) -> None:
    """Raise ``ValueError`` for a window that cannot be honoured.

    Args:
        window: Sliding window (``None`` = none): query ``q`` sees key ``k`` iff
            ``0 <= q_pos - k_pos < window`` (and both in one document).
        causal: Whether the attention is causal (windows need it).
    """
    if window is None:
        return
    if isinstance(window, bool) or not isinstance(window, int) or window <= 0:
        raise ValueError(
            f"sliding_window must be a positive int (query sees key iff 0 <= q_pos - k_pos < "
            f"window), got {window!r}; pass None for no window"
        )
    if not causal:
        raise ValueError(
            f"sliding_window={window} needs causal attention, got is_causal=False; CP attention "
            "supports windows only with causal masking"
        )


def _merge_pads(pos: np.ndarray, doc: np.ndarray) -> bool:
    """Whether every negative document id is a pad of the convention ``-1 - position`` (then a
    stretch of padding is one run); otherwise every negative id stays its own document."""
    return bool(np.all((doc >= 0) | (doc == -1 - pos)))


def _row_groups(pos: np.ndarray | None, doc: np.ndarray) -> list[list[int]]:
    """Batch rows with equal (positions, documents), in order of first appearance (``pos=None``:
    every row has the same positions): rows are bucketed by a weighted sum (one pass) and
    compared exactly inside a bucket."""
    w = np.random.default_rng(0).integers(1, 1 << 61, size=(doc.shape[1],), dtype=np.int64)
    with np.errstate(over="ignore"):
        sums = (doc * w).sum(axis=1)
        if pos is not None:
            sums = sums * 3 + (pos * w[::-1]).sum(axis=1)
    h: list[int] = np.asarray(sums).tolist()
    groups: list[list[int]] = []
    for r in range(doc.shape[0]):
        for g in groups:
            f = g[0]
            same_pos = pos is None or np.array_equal(pos[f], pos[r])
            if h[f] == h[r] and same_pos and np.array_equal(doc[f], doc[r]):
                g.append(r)
                break
        else:
            groups.append([r])
    return groups


@dataclass
class HostRows:
    """Host copies of a token meta, one row per group of batch rows with equal structure.

    Attributes:
        pos: ``[G, C * L]`` int64 positions of each group's first row (may be a read-only
            broadcast view of the meta's positions).
        doc_source: The ``[G, C * L]`` int64 document ids, or what makes them on first read of
            :attr:`doc` (a meta whose placement describes its documents by their pads or as
            runs: the plans that read only :attr:`table` never make them).
        rows: Batch rows of every group, or ``None`` (one group serving every row).
        weights: ``[G]`` meta rows each group stands for.
        merge: Every negative id is a pad of the convention ``-1 - position``.
        table: Where :attr:`merge` holds, the runs of the groups' stream with pad stretches
            merged, cut every :attr:`cut` slots (``run_table(pos, doc, True, breaks=cut)``,
            found in the one pass over the tokens that also groups the rows, or from the
            described documents);
            else ``None``.
        cut: The cut of :attr:`table` (the meta's local length), ``0`` without a table.
    """

    pos: np.ndarray
    doc_source: np.ndarray | Callable[[], np.ndarray]
    rows: list[list[int]] | None
    weights: np.ndarray
    merge: bool
    table: RunTable | None = None
    cut: int = 0

    @property
    def doc(self) -> np.ndarray:
        """``[G, C * L]`` int64 document ids of each group's first row."""
        if callable(self.doc_source):
            self.doc_source = self.doc_source()
        return self.doc_source


def host_rows(meta: TokenMeta) -> HostRows:
    """The :class:`HostRows` of ``meta`` (cached on it: one host copy and one grouping per batch,
    shared by the attention plan and the selective plan).

    One pass over the tokens finds the runs of every row (:func:`_lossless_runs`); equal rows are
    those with equal runs, and the pass yields the merge verdict and the stream's run table
    (:attr:`HostRows.table`) too. Where some negative id is not a pad of the convention, the
    rows are compared token by token instead (:func:`_row_groups`) and there is no table.
    """
    hit = meta.plan_cache.get("host_rows")
    if isinstance(hit, HostRows):
        return hit
    described = _host_by_documents(meta)
    if described is not None:
        meta.plan_cache["host_rows"] = described
        return described
    pos = meta.positions.detach().cpu().numpy().astype(np.int64, copy=False)
    doc = meta.document_ids.detach().cpu().numpy().astype(np.int64, copy=False)
    if pos.shape[0] != doc.shape[0]:  # one row of positions for every row of documents, or so
        pos, doc = np.broadcast_arrays(pos, doc)
    n_rows = pos.shape[0]
    # one row of positions expanded over the batch (every built-in layout): equal rows by
    # construction, no compare
    same_pos = n_rows == 1 or pos.strides[0] == 0 or bool((pos == pos[:1]).all())
    same = same_pos and (
        n_rows == 1 or (np.array_equal(doc[1], doc[0]) and bool((doc == doc[:1]).all()))
    )  # rows 0 and 1 first: most batches of distinct rows differ there
    if same_pos and n_rows > 1:
        pos = np.broadcast_to(pos[:1], doc.shape)
    host = _host_by_runs(pos[:1] if same else pos, doc[:1] if same else doc, meta.local_len)
    if host is None:
        host = _host_by_tokens(pos, doc, same, same_pos)
    elif same and n_rows > 1:  # one group standing for every row
        host.weights = np.array([n_rows], dtype=np.int64)
    meta.plan_cache["host_rows"] = host
    return host


_RUNS_PER_TOKEN = 64
"""A stream cut into more runs than one per this many tokens (TE's ``packed`` at high CP: every
document in ``2C`` chunks; a striped layout without its runs) takes the token pass instead of
its runs. For rows given by their pads the runs' route sorts them
(:func:`~cpshard.attention.pad_runs.pad_table`); for documents given as runs it does not
(:func:`~cpshard.attention.pad_runs.runs_table`) and costs less CPU, but the token pass's early
``[P]`` arrays leave the allocator's pages warm for the plan's large buffers, which the runs'
route then faults in (TE ``packed`` at 1M tokens, C = 64: ~13,600 page faults a plan against
~2,400, 0.13 s against 0.09 s on the 2-vCPU VM of BENCHMARKS.md)."""


def _host_by_documents(meta: TokenMeta) -> HostRows | None:
    """:class:`HostRows` of a meta whose placement describes its documents (by their pads, or as
    runs): groups and table from the pads' changes or the document runs and the stream's runs
    (:mod:`.pad_runs`), the document ids made only if read; ``None`` for any other meta."""
    docs = meta.documents
    place = meta.placement
    cut = meta.local_len
    if docs is None or place is None or cut <= 0:
        return None
    width = place.padded_len
    if isinstance(docs, DocumentRuns):  # one row: its stream's runs cut at the documents
        groups, firsts = [[0]], [0]
        starts, ids = docs.starts.numpy(), docs.ids.numpy()
        if place.stream_runs is not None:  # the map's runs, known: no pass over it
            slot, first = blocked_runs(place.stream_runs, cut)
            runs = (first, np.diff(slot, append=width))
            found = runs_table(None, starts, ids, cut, _RUNS_PER_TOKEN, runs, width)
        else:
            flat = place.rank_map.reshape(-1).cpu().numpy().astype(np.int64, copy=False)
            found = runs_table(flat, starts, ids, cut, _RUNS_PER_TOKEN)
        if found is None:  # a fine-cut stream: the token pass over the made ids
            return None
        table = found
    else:
        if place.stream_runs is not None:
            runs = blocked_runs(place.stream_runs, cut)
        else:
            flat = place.rank_map.reshape(-1).cpu().numpy().astype(np.int64, copy=False)
            runs = rank_map_runs(flat, cut)
            if runs[0].size * _RUNS_PER_TOKEN > width:  # fine-cut: the token pass is faster
                return None
        pad = docs.padding_mask.detach().cpu().numpy()
        groups, changes = row_groups_by_pads(pad)
        firsts = [g[0] for g in groups]
        table = pad_table(pad, firsts, changes, runs, cut)
    stream = meta.positions[:1].detach().cpu().numpy().astype(np.int64, copy=False)
    pos = np.broadcast_to(stream, (len(firsts), width))

    def doc() -> np.ndarray:
        ids = meta.document_ids.detach().cpu().numpy().astype(np.int64, copy=False)
        return np.ascontiguousarray(ids[firsts])

    weights = np.array([len(g) for g in groups], dtype=np.int64)
    grouped = None if len(groups) == 1 else groups
    return HostRows(pos, doc, grouped, weights, True, table, cut)


def _host_by_tokens(pos: np.ndarray, doc: np.ndarray, same: bool, same_pos: bool) -> HostRows:
    """:class:`HostRows` without a run table, rows compared token by token."""
    groups = [list(range(pos.shape[0]))]
    if not same:
        groups = _row_groups(None if same_pos else pos, doc)
    firsts = [g[0] for g in groups]
    p, d = np.ascontiguousarray(pos[firsts]), np.ascontiguousarray(doc[firsts])
    weights = np.array([len(g) for g in groups], dtype=np.int64)
    return HostRows(p, d, None if len(groups) == 1 else groups, weights, _merge_pads(p, d))


def _lossless_runs(pos: np.ndarray, doc: np.ndarray, cut: int) -> tuple[np.ndarray, ...] | None:
    """The runs of every row of ``[B, N]`` tokens in one pass, or ``None`` where some negative id
    is not a pad of the convention ``-1 - position``.

    With every pad by the convention, a run is a stretch of slots with consecutive positions
    and one document id, or a stretch of pads (each pad's id is then ``-1 - position``), never
    crossing a multiple of ``cut`` slots: the runs of ``run_table(pos, doc, True, breaks=cut)``.
    They describe every token exactly (position: the run's first plus the offset; id: the run's,
    or ``-1 - position`` for a pad), so rows with equal runs are equal.

    The pass makes bool temporaries only (no int64 array of the tokens' size: a fresh one costs
    a page fault per 4 KiB on first touch, which at ``[8, 32768]`` outweighs the arithmetic).

    Returns:
        ``(row, col, n, pos, key, pad)`` per run, in row-major order: its row, first slot in
        the row, length, first position, document id (``-1`` for padding), and whether it is
        padding.
    """
    rows, width = doc.shape
    neg = doc < 0
    if pos.strides[0] == 0:  # one row of positions for every row: its arithmetic once
        one = pos[0]
        steps = (one[1:] == one[:-1] + 1)[None, :]
    else:
        steps = pos[:, 1:] == pos[:, :-1] + 1
    if bool(neg.any()):
        conv = doc == -1 - (pos[0] if pos.strides[0] == 0 else pos)
        if bool(np.greater(neg, conv).any()):  # a negative id that is not -1 - position
            return None
    brk = np.empty((rows, width), dtype=bool)
    brk[:, 0] = True
    inner = brk[:, 1:]
    # a slot goes on with the run before it: the next position, and the same document or
    # both pads (two pads of the convention never share an id at consecutive positions)
    np.equal(doc[:, 1:], doc[:, :-1], out=inner)
    inner |= neg[:, 1:] & neg[:, :-1]
    inner &= steps
    np.logical_not(inner, out=inner)
    brk[:, ::cut] = True
    flat = np.flatnonzero(brk)
    row = flat // width
    col = flat - row * width
    n = np.diff(np.append(flat, rows * width))
    pad = neg[row, col]
    return row, col, n, pos[row, col], np.where(pad, -1, doc[row, col]), pad


def _host_by_runs(pos: np.ndarray, doc: np.ndarray, local_len: int) -> HostRows | None:
    """:class:`HostRows` from :func:`_lossless_runs`: rows with equal runs form a group (in
    order of first appearance); ``None`` where the runs cannot stand for the tokens (a negative
    id that is not a pad of the convention) or there are no tokens."""
    n_rows, width = doc.shape
    if width == 0 or local_len <= 0:
        return None
    found = _lossless_runs(pos, doc, local_len)
    if found is None:
        return None
    row, col, n, p0, key, pad = found
    bounds = np.searchsorted(row, np.arange(n_rows + 1)).tolist()
    firsts = list(range(n_rows))
    groups: list[list[int]] = [[r] for r in firsts]
    if n_rows > 1:
        cols = np.stack([col, n, p0, key, pad.astype(np.int64)])
        seen: dict[bytes, list[int]] = {}
        for r in range(n_rows):
            seen.setdefault(cols[:, bounds[r] : bounds[r + 1]].tobytes(), []).append(r)
        groups = list(seen.values())
        firsts = [g[0] for g in groups]
    if len(firsts) == n_rows:
        p, d = pos, doc
        sel = np.arange(row.size)
        grp = row
    else:
        p, d = np.ascontiguousarray(pos[firsts]), np.ascontiguousarray(doc[firsts])
        parts = [np.arange(bounds[r], bounds[r + 1]) for r in firsts]
        sel = np.concatenate(parts)
        grp = np.repeat(np.arange(len(firsts)), [x.size for x in parts])
    table = RunTable(
        grp * width + col[sel], n[sel], p0[sel], np.where(pad[sel], PAD_CLASS, key[sel]), grp
    )
    weights = np.array([len(g) for g in groups], dtype=np.int64)
    rows = None if len(groups) == 1 else groups
    return HostRows(p, d, rows, weights, True, table, local_len)


def take_spans(table: RunTable, width: int, lo: np.ndarray, hi: np.ndarray) -> RunTable:
    """The runs of the slots ``[lo[j], hi[j])`` (sorted, disjoint; the same for every row group)
    taken out of ``table`` and laid end to end: slot ``g * R + i`` of the result is the ``i``-th
    taken slot of group ``g`` (``R`` taken slots in all). Equal to :func:`~cpshard.attention.
    pieces.run_table` of the taken positions and documents, without a per-token pass.

    Args:
        table: Runs of ``[G, width]`` slots with pad stretches merged (no cuts needed).
        width: Slots per row group of ``table``.
        lo: ``[J]`` first slot of each span.
        hi: ``[J]`` one past its last.
    """
    size = hi - lo
    total = int(size.sum())
    start = table.start - table.grp * width
    end = start + table.n
    i0 = np.searchsorted(hi, start, side="right")  # first span ending after the run starts
    i1 = np.searchsorted(lo, end, side="left")  # spans starting before it ends
    counts = np.maximum(i1 - i0, 0)
    run = np.repeat(np.arange(start.size), counts)
    heads = np.cumsum(counts) - counts
    span = i0[run] + (np.arange(run.size) - heads[run])
    a = np.maximum(start[run], lo[span])
    b = np.minimum(end[run], hi[span])
    before = np.cumsum(size) - size  # taken slots before each span
    grp = table.grp[run]
    taken = RunTable(
        grp * total + before[span] + (a - lo[span]),
        b - a,
        table.pos[run] + (a - start[run]),
        table.cls[run],
        grp,
    )
    return join_runs(taken, total)


def stream_table(meta: TokenMeta, merge: bool) -> RunTable:
    """The runs of the whole stream of every row group, cut at the rank blocks (cached on the
    meta: the attention plan's keys and the selective plan's and cost model's runs are this
    table). With pads merged it is the table :func:`host_rows` found in its pass over the
    tokens (joined at a coarser cut for a merged 2-D meta); otherwise one pass of its own.

    Args:
        meta: The token meta.
        merge: Stretches of padding form pad runs (see :func:`~cpshard.attention.pieces.
            run_table`).
    """
    key = f"stream_table|{merge}"
    hit = meta.plan_cache.get(key)
    if isinstance(hit, RunTable):
        return hit
    host = host_rows(meta)
    cut = max(meta.local_len, 1)
    if merge and host.table is not None and cut % host.cut == 0:  # the rows' pass found it
        table = host.table
        if cut != host.cut:  # a merged meta (2-D CP) shares the rows of its finer-cut meta
            table = join_runs(table, host.pos.shape[1], cut)
    else:
        table = run_table(host.pos, host.doc, merge, breaks=cut)
    meta.plan_cache[key] = table
    return table


def block_table(stream: RunTable, width: int, local_len: int, rank: int) -> RunTable:
    """The runs of ``rank``'s local slots (``[G, L]``, numbered row-major) taken from the
    stream's table (``[G, width]``, cut at the rank blocks): the same table as
    :func:`~cpshard.attention.pieces.run_table` of the local slots, without a per-token pass."""
    row = stream.grp
    off = stream.start - row * width
    sel = off // local_len == rank
    row = row[sel]
    start = row * local_len + off[sel] - rank * local_len
    return RunTable(start, stream.n[sel], stream.pos[sel], stream.cls[sel], row)


def _sort_order(pos: np.ndarray) -> np.ndarray:
    """Slots sorted by position (a scatter when the positions are a permutation of
    ``0..N-1``, the stream of every built-in layout; else a stable sort)."""
    n = pos.shape[0]
    if n and int(pos.min()) == 0 and int(pos.max()) == n - 1:
        order = np.full(n, -1, dtype=np.int64)
        order[pos] = np.arange(n, dtype=np.int64)
        if bool((order >= 0).all()):
            return order
    return np.argsort(pos, kind="stable").astype(np.int64)


def _plan_of(
    pieces: Pieces,
    group_of: np.ndarray,
    rows: list[list[int]] | None,
    window: int | None,
    device: torch.device,
    orders: list[np.ndarray | None] | None = None,
) -> PairPlan:
    """One :class:`PairPlan` from pieces whose slots are relative to their row group."""
    n_groups = 1 if rows is None else len(rows)
    keyed = tasks_by_key(pieces, group_of, n_groups, window, device)
    return _assemble(keyed, rows, device, orders)


def _assemble(
    keyed: list[tuple[tuple[Task, ...], int, int]],
    rows: list[list[int]] | None,
    device: torch.device,
    orders: list[np.ndarray | None] | None = None,
    row_index: list[torch.Tensor] | None = None,
) -> PairPlan:
    """One :class:`PairPlan` from the tasks of each row group (``row_index``: the groups' row
    tensors when made already, shared by several plans; read only)."""
    groups = []
    computed = needed = 0
    for g, (tasks, c, n) in enumerate(keyed):
        weight = 1 if rows is None else len(rows[g])
        computed += c * weight
        needed += n * weight
        if rows is None:
            idx = None
        elif row_index is not None:
            idx = row_index[g]
        else:
            idx = torch.tensor(rows[g], dtype=torch.long, device=device)
        groups.append((idx, tasks))
    slot_order: tuple[torch.Tensor | None, ...] = ()
    if orders is not None and any(o is not None for o in orders):
        slot_order = tuple(None if o is None else torch.from_numpy(o).to(device) for o in orders)
    return PairPlan(tuple(groups), computed, needed, all(not t for _, t in groups), slot_order)


def _pieces(q: RunTable, k: RunTable, causal: bool, window: int | None) -> Pieces:
    qi, ki = pair_runs(q, k, causal, window)
    return cut_pairs(q, k, qi, ki, causal, window)


def pair_plan(
    q_pos: np.ndarray,
    q_doc: np.ndarray,
    k_pos: np.ndarray,
    k_doc: np.ndarray,
    rows: list[list[int]] | None,
    *,
    causal: bool,
    window: int | None,
    device: torch.device,
    skip_keys: tuple[int, int] | None = None,
    pads_by_convention: bool = False,
) -> PairPlan:
    """Plan one (query set, key set) pair from host arrays.

    Args:
        q_pos: ``[G, Nq]`` global positions of the query slots, one row per row group.
        q_doc: ``[G, Nq]`` document ids of the query slots.
        k_pos: ``[G, Nk]`` global positions of the key slots.
        k_doc: ``[G, Nk]`` document ids of the key slots.
        rows: Batch rows of every group, or ``None`` (one group serving every row).
        causal: Causal masking by global position.
        window: Sliding window or ``None``.
        device: Device of the masks and row indices.
        skip_keys: Key slots ``[start, end)`` that no query attends to in this plan, or ``None``.
        pads_by_convention: The caller knows every negative id of both sets is a pad of the
            ``-1 - position`` convention (its slots are taken from a stream where that holds),
            so the check is skipped; else it is made here.

    Returns:
        The :class:`PairPlan`.
    """
    merge = pads_by_convention or (_merge_pads(q_pos, q_doc) and _merge_pads(k_pos, k_doc))
    q = run_table(q_pos, q_doc, merge)
    k = run_table(k_pos, k_doc, merge)
    return pair_plan_of_runs(
        q, k, q_pos.shape[1], k_pos.shape[1], rows, causal=causal, window=window, device=device,
        skip_keys=skip_keys,
    )  # fmt: skip


def pair_plan_of_runs(
    q: RunTable,
    k: RunTable,
    nq: int,
    nk: int,
    rows: list[list[int]] | None,
    *,
    causal: bool,
    window: int | None,
    device: torch.device,
    skip_keys: tuple[int, int] | None = None,
) -> PairPlan:
    """:func:`pair_plan` from the run tables of the two sets (pads merged where the convention
    holds), e.g. cut from the stream's table (:func:`block_table`, :func:`take_spans`).

    Args:
        q: Runs of the query slots, slot ``g * nq + i`` for slot ``i`` of row group ``g``.
        k: Runs of the key slots, slot ``g * nk + i``.
        nq: Query slots per row group.
        nk: Key slots per row group.
        rows: Batch rows of every group, or ``None`` (one group serving every row).
        causal: Causal masking by global position.
        window: Sliding window or ``None``.
        device: Device of the masks and row indices.
        skip_keys: Key slots ``[start, end)`` that no query attends to in this plan, or ``None``.
    """
    pieces, group = _group_pieces(q, k, nq, nk, causal, window)
    if skip_keys is not None:
        s, e = skip_keys
        keep = (pieces.ki + pieces.nk <= s) | (pieces.ki >= e)
        pieces, group = pieces.take(keep), group[keep]
    return _plan_of(pieces, group, rows, window, device)


def pair_plans_of_runs(
    q: RunTable,
    keys: list[tuple[RunTable, int]],
    nq: int,
    rows: list[list[int]] | None,
    *,
    causal: bool,
    window: int | None,
    device: torch.device,
) -> list[PairPlan]:
    """:func:`pair_plan_of_runs` of one query set against several key sets ``(runs, slots per
    row group)``, all at once: plan for plan equal to one call per key set.

    Key set ``j``'s runs join the pairing as row groups ``j * G + g`` (the queries repeated
    for each set), so one pairing and one cut find every set's pieces, and their kernel calls
    are made together (one mask transfer).
    """
    n_groups = 1 if rows is None else len(rows)
    n_sets = len(keys)
    tags = np.arange(n_sets, dtype=np.int64) * n_groups
    base = [0]  # first key slot of each set in the joined key slots
    for _, nk in keys:
        base.append(base[-1] + n_groups * nk)
    q_all = RunTable(
        np.concatenate([q.start + tag * nq for tag in tags.tolist()]),
        np.tile(q.n, n_sets),
        np.tile(q.pos, n_sets),
        np.tile(q.cls, n_sets),
        np.concatenate([q.grp + tag for tag in tags.tolist()]),
    )
    k_all = RunTable(
        np.concatenate([k.start + b for (k, _), b in zip(keys, base, strict=False)]),
        np.concatenate([k.n for k, _ in keys]),
        np.concatenate([k.pos for k, _ in keys]),
        np.concatenate([k.cls for k, _ in keys]),
        np.concatenate([k.grp + tag for (k, _), tag in zip(keys, tags.tolist(), strict=True)]),
    )
    pieces = _pieces(q_all, k_all, causal, window)
    tag = pieces.qi // max(nq, 1)  # set * G + group
    which = tag // n_groups
    width = np.array([nk for _, nk in keys], dtype=np.int64)
    k_base = np.array(base[:-1], dtype=np.int64)
    pieces = pieces._replace(
        qi=pieces.qi - tag * nq,
        ki=pieces.ki - k_base[which] - (tag - which * n_groups) * width[which],
    )
    keyed = tasks_by_key(pieces, tag, n_sets * n_groups, window, device)
    idx = None if rows is None else [torch.tensor(r, dtype=torch.long, device=device) for r in rows]
    return [
        _assemble(keyed[j * n_groups : (j + 1) * n_groups], rows, device, row_index=idx)
        for j in range(n_sets)
    ]


def _group_pieces(
    q: RunTable, k: RunTable, nq: int, nk: int, causal: bool, window: int | None
) -> tuple[Pieces, np.ndarray]:
    """The pieces of ``q`` against ``k`` with slots relative to their row group, and the group
    of each."""
    pieces = _pieces(q, k, causal, window)
    group = pieces.qi // max(nq, 1)
    return pieces._replace(qi=pieces.qi - group * nq, ki=pieces.ki - group * nk), group


@dataclass(frozen=True)
class AttentionPlan:
    """The attention plan of one sharded batch, for one CP rank.

    Built from the :class:`~cpshard.sharding.meta.TokenMeta` once (host copies of its positions and
    document ids); the per-method plans (:meth:`all_gather`, :meth:`ring`, :meth:`ulysses`) are
    made on first use for each ``(causal, window, device)`` and then reused by every layer and
    by the backward. The local queries are paired with the whole stream once per
    ``(causal, window)``; every method's plan of this rank selects from those pieces.

    Attributes:
        meta: The token meta the plan belongs to.
    """

    meta: TokenMeta
    _rows: list[list[int]] | None = field(init=False, repr=False, compare=False)
    _pos: np.ndarray = field(init=False, repr=False, compare=False)
    _host: HostRows = field(init=False, repr=False, compare=False)
    _merge: bool = field(init=False, repr=False, compare=False)
    _cache: dict[tuple[Any, ...], Any] = field(
        init=False, repr=False, compare=False, default_factory=dict
    )

    def __post_init__(self) -> None:
        host = host_rows(self.meta)
        object.__setattr__(self, "_rows", host.rows)
        object.__setattr__(self, "_pos", host.pos)
        object.__setattr__(self, "_host", host)  # its document ids: made if read
        object.__setattr__(self, "_merge", host.merge)

    @property
    def rank(self) -> int:
        """This rank's index in the CP group."""
        return self.meta.rank

    @property
    def world_size(self) -> int:
        """CP size."""
        return self.meta.world_size

    @property
    def local_len(self) -> int:
        """Local tokens per rank."""
        return self.meta.local_len

    def _cached(self, key: tuple[Any, ...], build: Any) -> Any:
        hit = self._cache.get(key)
        if hit is None:
            hit = build()
            self._cache[key] = hit
        return hit

    def _local_pieces(self, causal: bool, window: int | None) -> tuple[Pieces, np.ndarray]:
        """Local queries of every row group against the whole stream (runs cut at the rank
        blocks), paired once; slots relative to the group. Returns ``(pieces, group)``."""

        def build() -> tuple[Pieces, np.ndarray]:
            n, r = self.local_len, self.rank
            pos = self._pos
            if n:  # the stream's table (shared with the cost facts), and rank r's part of it
                k = stream_table(self.meta, self._merge)
                q = block_table(k, pos.shape[1], n, r)
            else:
                doc = self._host.doc
                q = run_table(pos[:, :0], doc[:, :0], self._merge)
                k = run_table(pos, doc, self._merge)
            pieces = _pieces(q, k, causal, window)
            group = pieces.qi // max(n, 1)
            stream = pos.shape[1]
            return pieces._replace(qi=pieces.qi - group * n, ki=pieces.ki - group * stream), group

        got: tuple[Pieces, np.ndarray] = self._cached(("pieces", causal, window), build)
        return got

    def _blocks(self, causal: bool, window: int | None, device: torch.device) -> list[PairPlan]:
        """Local queries against every rank's block (key slots relative to the block): the
        ring's plans, made together (one mask transfer)."""

        def build() -> list[PairPlan]:
            n, c = self.local_len, self.world_size
            pieces, group = self._local_pieces(causal, window)
            block = pieces.ki // max(n, 1)
            rel = pieces._replace(ki=pieces.ki - block * n)
            n_groups = 1 if self._rows is None else len(self._rows)
            keyed = tasks_by_key(rel, block * n_groups + group, c * n_groups, window, device)
            return [
                _assemble(keyed[b * n_groups : (b + 1) * n_groups], self._rows, device)
                for b in range(c)
            ]

        plans: list[PairPlan] = self._cached(("blocks", causal, window, str(device)), build)
        own = self._cache.get(("own", causal, window, str(device)))
        if own is not None:  # the all-gather's own-block plan came first: one object for both
            plans[self.rank] = own
        return plans

    def _own_block(self, causal: bool, window: int | None, device: torch.device) -> PairPlan:
        """Local queries against this rank's own block (the ring's plan of this rank)."""
        ring = self._cache.get(("blocks", causal, window, str(device)))
        if ring is not None:
            own: PairPlan = ring[self.rank]
            return own

        def build() -> PairPlan:
            n, r = self.local_len, self.rank
            pieces, group = self._local_pieces(causal, window)
            keep = pieces.ki // max(n, 1) == r
            pieces, group = pieces.take(keep), group[keep]
            return _plan_of(pieces._replace(ki=pieces.ki - r * n), group, self._rows, window,
                            device)  # fmt: skip

        plan: PairPlan = self._cached(("own", causal, window, str(device)), build)
        return plan

    def _stream(self, causal: bool, window: int | None, device: torch.device,
                skip: int | None) -> PairPlan:  # fmt: skip
        """Local queries against the whole stream, rank ``skip``'s block left out (or none)."""

        def build() -> PairPlan:
            n = self.local_len
            pieces, group = self._local_pieces(causal, window)
            if skip is not None:
                keep = pieces.ki // max(n, 1) != skip
                pieces, group = pieces.take(keep), group[keep]
            return _plan_of(pieces, group, self._rows, window, device)

        plan: PairPlan = self._cached(("stream", causal, window, str(device), skip), build)
        return plan

    def all_gather(self, causal: bool, window: int | None, device: torch.device) -> PairPlan:
        """Local queries against the whole gathered stream."""
        return self._stream(causal, window, device, None)

    def all_gather_split(
        self, causal: bool, window: int | None, device: torch.device
    ) -> tuple[PairPlan, PairPlan]:
        """:meth:`all_gather` cut in two: ``(local, remote)``.

        ``local``: local queries against this rank's own block ``[L]`` (available before the
        all-gather completes; the same plan as ``ring(...)[rank]``). ``remote``: local queries
        against the whole stream ``[C * L]`` with this rank's block skipped (empty at ``C = 1``).
        Together they cover exactly the pairs of :meth:`all_gather`.
        """
        return (
            self._own_block(causal, window, device),
            self._stream(causal, window, device, self.rank),
        )

    def ring(self, causal: bool, window: int | None, device: torch.device) -> tuple[PairPlan, ...]:
        """Local queries against each rank's block, index ``r`` for rank ``r``."""
        return tuple(self._blocks(causal, window, device))

    def ulysses(self, causal: bool, window: int | None, device: torch.device) -> PairPlan:
        """The whole stream against itself (each rank holds a slice of the heads).

        Where sorting the stream by position joins its runs (at least halves their number), the
        plan's :attr:`PairPlan.slot_order` is that sort and its tasks index the sorted stream.
        """

        def build() -> PairPlan:
            pos, doc = self._pos, self._host.doc
            stream = pos.shape[1]
            runs = run_table(pos, doc, self._merge)
            order = np.stack([_sort_order(row) for row in pos])
            spos = np.take_along_axis(pos, order, axis=1)
            sdoc = np.take_along_axis(doc, order, axis=1)
            sorted_runs = run_table(spos, sdoc, self._merge)
            # per row group: sort where that at least halves the runs
            per = np.bincount(runs.grp, minlength=pos.shape[0])
            per_sorted = np.bincount(sorted_runs.grp, minlength=pos.shape[0])
            use = 2 * per_sorted <= per
            if use.all():
                runs = sorted_runs
            elif use.any():
                mpos, mdoc = np.where(use[:, None], spos, pos), np.where(use[:, None], sdoc, doc)
                runs = run_table(mpos, mdoc, self._merge)
            orders = [order[g] if use[g] else None for g in range(pos.shape[0])]
            pieces = _pieces(runs, runs, causal, window)
            group = pieces.qi // max(stream, 1)
            pieces = pieces._replace(qi=pieces.qi - group * stream, ki=pieces.ki - group * stream)
            return _plan_of(pieces, group, self._rows, window, device, orders)

        plan: PairPlan = self._cached(("ulysses", causal, window, str(device)), build)
        return plan

    def for_method(
        self, method: str, causal: bool, window: int | None, device: torch.device
    ) -> PairPlan | tuple[PairPlan, ...]:
        """The plan(s) ``method`` runs: :meth:`all_gather_split`, :meth:`ring`, :meth:`ulysses`."""
        if method == "ring":
            return self.ring(causal, window, device)
        if method == "ulysses":
            return self.ulysses(causal, window, device)
        return self.all_gather_split(causal, window, device)

    def planned(self, method: str, causal: bool, window: int | None, device: torch.device) -> bool:
        """Whether :meth:`for_method` would only read cached plans (no host work to build one)."""
        dev = str(device)
        if method == "ring":
            keys = [("blocks", causal, window, dev)]
        elif method == "ulysses":
            keys = [("ulysses", causal, window, dev)]
        else:  # the own block comes from the ring's plans when those were built first
            own = ("own", causal, window, dev) in self._cache or (
                ("blocks", causal, window, dev) in self._cache
            )
            return own and ("stream", causal, window, dev, self.rank) in self._cache
        return all(key in self._cache for key in keys)

    def pair_counts(
        self, method: str, causal: bool = True, window: int | None = None
    ) -> tuple[int, int]:
        """``(computed, needed)`` query-key pairs this rank's kernels run for ``method``.

        For Ulysses the counts are per head slice over the whole stream (every rank runs them).
        """
        plans = self.for_method(method, causal, window, torch.device("cpu"))
        seq = plans if isinstance(plans, tuple) else (plans,)
        return sum(p.computed for p in seq), sum(p.needed for p in seq)


def attention_plan(meta: TokenMeta) -> AttentionPlan:
    """The plan of ``meta``'s batch, built on first call and cached on the meta.

    Args:
        meta: Token meta of a sharded batch.

    Returns:
        The same :class:`AttentionPlan` for every call with this meta object.
    """
    plan = meta.plan_cache.get("attention")
    if plan is None:
        plan = AttentionPlan(meta)
        meta.plan_cache["attention"] = plan
    assert isinstance(plan, AttentionPlan)
    return plan
