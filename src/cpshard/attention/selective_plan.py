"""Which key slots each rank's queries can see: the plan of the selective K/V exchange.

Host side, numpy, from the token meta alone. Every rank holds the global meta (positions and
document ids of every rank's tokens), so every rank derives the same facts about every other rank:
what it sends to each peer equals what that peer expects from it, without exchanging split sizes.

Visibility is the plan's rule (:mod:`cpshard.attention.plan`): query ``q`` sees key ``k`` iff both
have the same document id and (causal) ``k_pos <= q_pos`` (and ``q_pos - k_pos < window``). So
the keys one query sees are the positions ``[lo, hi)`` of its document, with ``hi = q_pos + 1``
and ``lo = q_pos - window + 1`` (causal; ``lo`` unbounded without a window) or the whole document
(bidirectional). A rank's queries see the union of their intervals; encoded as
``(document, position)`` on one int64 axis (:mod:`cpshard.attention.visibility`) the union is a
sorted set of disjoint intervals, built from the query *runs* (one interval per run, not per
token), and the key runs inside it are found by binary searches. Cost ``O(R log R)`` per rank for
``R`` runs of the stream plus the slots it names; no per-token sort, no ``[Lq, Lk]`` matrix.

Batch rows: the exchange moves whole key slots ``[B, H, ., D]``, shared by every row, so a slot is
sent when a query of *any* row group needs it (the union over row groups). With one meta row (the
packed batch) that is exactly the needed set.

Owns :class:`SelectivePlan` (this rank's exchange and kernel plans), :func:`exchange_sums` (what
each rank receives and sends, for the cost model) and :func:`exchange_counts` (the ``[C, C]``
matrix of key slots each rank needs from each other). Never a collective.

Import rules: the rows of ``RULES`` in tests/unit/test_architecture.py that cover this module.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from cpshard.attention.grouped_runs import GroupedRuns
from cpshard.attention.pieces import PAD_CLASS, TILE, RunTable, join_runs
from cpshard.attention.plan import (
    HostRows,
    PairPlan,
    block_table,
    host_rows,
    pair_plan,
    pair_plans_of_runs,
    stream_table,
    take_spans,
)
from cpshard.attention.visibility import (
    Depth,
    Frame,
    RankRuns,
    StreamRuns,
    Tiling,
    Union,
    coded,
    per_rank,
    raw_runs,
    remote_slot_matrix,
    table_ids,
    wanted_slots,
)
from cpshard.layouts.index import arange_runs
from cpshard.sharding.meta import TokenMeta

__all__ = [
    "MetaArrays",
    "SelectivePlan",
    "exchange_counts",
    "exchange_sums",
    "meta_arrays",
    "needed_slots",
    "needed_spans",
    "selective_plan",
    "selective_planned",
    "stream_order",
    "wanted_of",
]


@dataclass(frozen=True)
class MetaArrays:
    """Host copies of a token meta, one row per group of batch rows with equal structure.

    Attributes:
        pos: ``[G, C * L]`` global positions, rank-major stream.
        host: The meta's :class:`~cpshard.attention.plan.HostRows` (its document ids are made
            on first read of :attr:`doc`: the plans from the run table never read them).
        rows: Batch rows of every group, or ``None`` (one group serving every row).
        weights: ``[G]`` how many meta rows each group stands for.
        world: CP size ``C``.
        local_len: Tokens per rank ``L``.
        frame: The ``(document, position)`` code map of the batch.
        runs: The runs of every group's stream, by rank
            (:class:`~cpshard.attention.visibility.RankRuns`).
        grouped: With several row groups, the same runs in one code space
            (:class:`~cpshard.attention.grouped_runs.GroupedRuns`: every group at once), or
            ``None``; used only while it was made of :attr:`runs` (:meth:`every_group`).
    """

    pos: np.ndarray
    host: HostRows
    rows: list[list[int]] | None
    weights: np.ndarray
    world: int
    local_len: int
    frame: Frame
    runs: tuple[RankRuns, ...]
    grouped: GroupedRuns | None = None

    def every_group(self) -> GroupedRuns | None:
        """:attr:`grouped`, where it answers for :attr:`runs` (made of them, every group in rank
        blocks, codes in int64); else ``None``: ask group by group."""
        g = self.grouped
        if g is None or g.groups is not self.runs or not g.fits:
            return None
        return g if all(r.blocked for r in self.runs) else None

    @property
    def doc(self) -> np.ndarray:
        """``[G, C * L]`` document ids (made on first read where the meta has none yet)."""
        return self.host.doc

    def rank_slice(self, rank: int) -> slice:
        """Stream slots of ``rank``'s local tokens."""
        return slice(rank * self.local_len, (rank + 1) * self.local_len)


def meta_arrays(meta: TokenMeta) -> MetaArrays:
    """The :class:`MetaArrays` of ``meta`` (cached on it: one host copy per batch)."""
    hit = meta.plan_cache.get("meta_arrays")
    if isinstance(hit, MetaArrays):
        return hit
    host = host_rows(meta)
    p, rows, weights = host.pos, host.rows, host.weights
    n, c = meta.local_len, meta.world_size
    if host.table is not None:  # from the rows' runs, no pass over the tokens
        merge = _pad_runs_apart(host.table)
        lo_pos = int(host.table.pos.min())
        hi_pos = int((host.table.pos + host.table.n).max()) - 1
    else:
        merge = host.merge and _pads_unique(p, host.doc)
        lo_pos = int(p.min()) if p.size else 0
        hi_pos = int(p.max()) if p.size else 0
    table = stream_table(meta, merge)
    if len(p) > 1:  # several row groups: code every group's runs at once
        return _grouped_arrays(meta, host, table, lo_pos, hi_pos)
    raw = raw_runs(table, p.shape[1], len(p), n)
    docs = np.unique(np.concatenate([r.doc[~r.pad] for r in raw]))
    frame = Frame(docs, lo_pos, hi_pos - lo_pos + 2)
    _check_codes(frame)
    runs = tuple(RankRuns(coded(r, frame), c, frame) for r in raw)
    arrays = MetaArrays(p, host, rows, weights, meta.world_size, n, frame, runs)
    meta.plan_cache["meta_arrays"] = arrays
    return arrays


def _check_codes(frame: Frame) -> None:
    """Raise where ``(document, position)`` codes would not fit int64."""
    docs = frame.docs
    if docs.size * frame.span >= 1 << 62:
        raise ValueError(
            f"the token meta's positions span {frame.span - 2} over {docs.size} documents: the "
            "attention plan codes (document, position) in int64 and needs documents * span < "
            "2**62; positions are token positions in the padded stream (0..P-1 for every "
            "built-in layout), pass those"
        )


def _grouped_arrays(
    meta: TokenMeta, host: HostRows, table: RunTable, lo_pos: int, hi_pos: int
) -> MetaArrays:
    """:func:`meta_arrays` for several row groups: the runs of every group coded in one pass
    (:func:`~cpshard.attention.visibility.raw_runs` and :func:`~cpshard.attention.visibility.
    coded` of each group, at once), then cut into the groups' :class:`RankRuns`, and their
    :class:`~cpshard.attention.grouped_runs.GroupedRuns`."""
    p = host.pos
    n, c = meta.local_len, meta.world_size
    width = p.shape[1]
    start = table.start - table.grp * width
    pad = table.cls == PAD_CLASS
    rank = start // max(n, 1)
    ids = table_ids(table)
    docs = np.unique(ids[~pad])
    frame = Frame(docs, lo_pos, hi_pos - lo_pos + 2)
    _check_codes(frame)
    doc = np.where(pad, 0, np.searchsorted(docs, ids))
    code = np.where(pad, 0, frame.code(doc, table.pos))
    every = StreamRuns(start, table.n, table.pos, doc, rank, pad, code)
    cuts = np.searchsorted(table.grp, np.arange(p.shape[0] + 1)).tolist()
    runs = tuple(
        RankRuns(every.take(slice(cuts[g], cuts[g + 1])), c, frame) for g in range(p.shape[0])
    )
    real = ~pad
    grouped = GroupedRuns(runs, every.take(real), table.grp[real])
    arrays = MetaArrays(p, host, host.rows, host.weights, c, n, frame, runs, grouped)
    meta.plan_cache["meta_arrays"] = arrays
    return arrays


def _pads_unique(pos: np.ndarray, doc: np.ndarray) -> bool:
    """Whether no two pads of a row share a position (so a pad sees only itself: two pads at one
    position have one id, ``-1 - position``, and see each other by the mask rule)."""
    for p, d in zip(pos, doc, strict=True):
        at = p[d < 0]
        if at.size and int(np.bincount(at - at.min()).max()) > 1:
            return False
    return True


def _pad_runs_apart(table: RunTable) -> bool:
    """:func:`_pads_unique` from the pad runs of a table with pad stretches merged: no two pad
    runs of one row group overlap in positions (a pad run's own positions are distinct)."""
    pad = np.flatnonzero(table.cls == PAD_CLASS)
    if pad.size < 2:
        return True
    grp, pos, n = table.grp[pad], table.pos[pad], table.n[pad]
    order = np.lexsort((pos, grp))
    grp, pos, n = grp[order], pos[order], n[order]
    same = grp[1:] == grp[:-1]
    return not bool((same & (pos[1:] < pos[:-1] + n[:-1])).any())


def _tiling_of(a: MetaArrays, window: int | None) -> Tiling | None:
    """The :class:`~cpshard.attention.visibility.Tiling` of a single row group's runs, for a mask
    without a window (the slots are whole runs, found by prefix sums), or ``None``."""
    if window is not None or len(a.runs) != 1:
        return None
    return a.runs[0].tiling()


def needed_spans(
    a: MetaArrays, rank: int, causal: bool, window: int | None
) -> tuple[np.ndarray, np.ndarray]:
    """``(lo, hi)``: the stream slots some query of ``rank`` (any row group) sees, off ``rank``
    itself, as sorted disjoint slot ranges ``[lo, hi)`` (touching ranges joined)."""
    every = a.every_group()
    if every is not None:
        return every.needed_spans(rank, causal, window)
    tiling = _tiling_of(a, window)
    if tiling is not None:  # whole runs, found by prefix sums
        real = a.runs[0].real
        take = tiling.needed_runs(rank, causal)
        u = Union(real.start[take], real.start[take] + real.n[take])
        return u.lo, u.hi
    lo, hi = [], []
    for runs in a.runs:
        keys = runs.real.take(runs.real.rank != rank)
        s0, s1, _ = runs.seen(rank, causal, window).covered_spans(keys)
        lo.append(s0)
        hi.append(s1)
    u = Union(np.concatenate(lo), np.concatenate(hi))
    return u.lo, u.hi


def needed_slots(a: MetaArrays, rank: int, causal: bool, window: int | None) -> np.ndarray:
    """Sorted stream slots some query of ``rank`` (any row group) sees, off ``rank`` itself."""
    return Union(*needed_spans(a, rank, causal, window)).members()


def wanted_of(a: MetaArrays, rank: int, causal: bool, window: int | None) -> list[np.ndarray]:
    """Per rank ``t``: the sorted local slots of ``rank`` some query of ``t`` sees (none for
    ``rank`` itself): what ``rank`` sends to ``t``."""
    c, n = a.world, a.local_len
    tiling = _tiling_of(a, window)
    if tiling is not None:
        return tiling.wanted(rank, c, n, causal)
    every = a.every_group()
    if every is not None:  # every row group at once
        return every.wanted(rank, causal, window, n)
    if all(runs.blocked for runs in a.runs):  # every peer at once per group, then the union
        return wanted_slots(_block_parts(a, causal, window), rank, c, n)
    out = []
    for t in range(c):
        need_t = np.zeros(n, dtype=bool)
        for runs in a.runs:
            if t != rank:
                slots = runs.seen(t, causal, window).covered_slots(runs.of(rank))[0]
                need_t[slots - rank * n] = True
        out.append(np.flatnonzero(need_t))
    return out


def exchange_counts(a: MetaArrays, causal: bool, window: int | None) -> np.ndarray:
    """``[C, C]`` int64: ``m[t, o]`` = key slots of rank ``o`` some query of rank ``t`` sees.

    The diagonal holds each rank's own keys it attends to (not exchanged). Row sums off the
    diagonal are what the selective exchange receives, column sums what it sends. With several
    row groups the count is the sum over groups capped at ``L``: an upper bound of the union the
    exchange moves (exact for one row group).
    """
    c, n = a.world, a.local_len
    out = np.zeros((c, c), dtype=np.int64)
    for runs in a.runs:
        keys = runs.real
        out[np.arange(c), np.arange(c)] += runs.pad_tokens
        if runs.blocked:  # every rank's union at once, in its rank block
            out += _block_counts(runs, causal, window)
            continue
        for t in range(c):
            inside = runs.seen(t, causal, window).count(keys.code, keys.code + keys.n)
            out[t] += per_rank(keys.rank, inside, c)
    return np.minimum(out, n)


def _block_counts(runs: RankRuns, causal: bool, window: int | None) -> np.ndarray:
    """``[C, C]``: key slots of rank ``o`` (real runs) that some query of rank ``t`` sees, for
    one row group in rank blocks: every key run is counted against every rank's block of
    :meth:`RankRuns.block_seen`, a few ranks per pass (at most ~2**21 queries at once)."""
    c, keys = runs.world, runs.real
    u = runs.block_seen(causal, window)
    out = np.zeros(c * c, dtype=np.int64)
    step = max(1, (1 << 21) // max(keys.n.size, 1))
    for t0 in range(0, c, step):
        ts = np.arange(t0, min(c, t0 + step), dtype=np.int64)
        lo = (keys.code[None, :] + runs.shift(ts)[:, None]).reshape(-1)
        inside = u.count(lo, lo + np.tile(keys.n, ts.size))
        cell = (ts[:, None] * c + keys.rank[None, :]).reshape(-1)
        np.add.at(out, cell, inside)
    return out.reshape(c, c)


def exchange_sums(a: MetaArrays, causal: bool, window: int | None) -> tuple[np.ndarray, np.ndarray]:
    """``([C], [C])`` int64: the remote key slots each rank's queries see (what the selective
    exchange receives) and the slots its peers need of it (what it sends).

    The row and column sums of :func:`exchange_counts` off the diagonal, in ``O(R log R)`` for one
    row group (prefix sums in code order where
    :meth:`~cpshard.attention.visibility.RankRuns.tiled_sums` applies): a rank receives
    ``|U_t & keys| - |U_t & own keys|`` (``U_t`` the codes its queries
    see), and what all ranks need of a key run is the integral over the run of the *depth*, the
    number of ranks whose ``U_t`` covers a code (one sweep over every ``U_t``'s ends). With several
    row groups, the union over the groups of the slots rank ``t`` needs
    (:func:`_union_sums`): what the exchange moves, not the per-group sum.
    """
    if len(a.runs) != 1:
        return _union_sums(a, causal, window)
    tiled = a.runs[0].tiled_sums(causal) if window is None else None
    if tiled is not None:
        return tiled.recv, tiled.send
    return _searched_sums(a.runs[0], causal, window)


def _searched_sums(
    runs: RankRuns, causal: bool, window: int | None
) -> tuple[np.ndarray, np.ndarray]:
    """:func:`exchange_sums` of one row group by binary searches and the depth sweep (any
    stream, any window)."""
    c = runs.world
    every = runs.keys()
    if runs.blocked:  # every rank at once, in its rank block
        u = runs.block_seen(causal, window)
        of = u.lo // runs.stride
        off = runs.shift(of)
        mine = runs.block_keys()
        own_seen = per_rank(of, mine.below(u.hi) - mine.below(u.lo), c)
        recv = per_rank(of, every.below(u.hi - off) - every.below(u.lo - off), c) - own_seen
        ends = [u.lo - off, u.hi - off]
        steps = [np.ones(u.lo.size, dtype=np.int64), -np.ones(u.hi.size, dtype=np.int64)]
    else:
        recv = np.zeros(c, dtype=np.int64)
        own_seen = np.zeros(c, dtype=np.int64)
        ends, steps = [], []
        for t in range(c):
            ut = runs.seen(t, causal, window)
            own = runs.keys(t)
            own_seen[t] = int((own.below(ut.hi) - own.below(ut.lo)).sum())
            recv[t] = int((every.below(ut.hi) - every.below(ut.lo)).sum()) - own_seen[t]
            ends += [ut.lo, ut.hi]
            steps += [np.ones(ut.lo.size, dtype=np.int64), -np.ones(ut.hi.size, dtype=np.int64)]
    depth = Depth(np.concatenate(ends), np.concatenate(steps))
    keys = runs.real
    covered = depth.integral(keys.code + keys.n) - depth.integral(keys.code)
    send = per_rank(keys.rank, covered, c) - own_seen
    return recv, send


def _union_sums(a: MetaArrays, causal: bool, window: int | None) -> tuple[np.ndarray, np.ndarray]:
    """:func:`exchange_sums` for several row groups: one slot moves once for every row, so rank
    ``t`` receives the *union* over the groups of the remote slots its queries see (the slot
    ranges of each group's key runs inside ``U_t``, merged in slot space: a rank's block is
    measured apart, so ranges that touch across a block edge count on both sides), and a rank
    sends, to every ``t``, the part of that union in its block. Exactly
    :attr:`SelectivePlan.received` and :attr:`SelectivePlan.sent` of every rank.

    Every rank ``t`` at once when every group is in rank blocks (``t``'s ranges laid out at
    ``t * C * L`` in one union, measured at every ``(t, o)`` block edge); otherwise rank by rank,
    ``O(C G R log R)`` for ``G`` groups.
    """
    c, n = a.world, a.local_len
    if all(runs.blocked for runs in a.runs):
        per = _union_matrix(a, causal, window)
        return per.sum(axis=1), per.sum(axis=0)
    edges = np.arange(c + 1, dtype=np.int64) * n
    recv = np.zeros(c, dtype=np.int64)
    send = np.zeros(c, dtype=np.int64)
    for t in range(c):
        lo, hi = [], []
        for runs in a.runs:
            keys = runs.real.take(runs.real.rank != t)
            s0, s1, _ = runs.seen(t, causal, window).covered_spans(keys)
            keep = s1 > s0
            lo.append(s0[keep])
            hi.append(s1[keep])
        per_t = np.diff(Union(np.concatenate(lo), np.concatenate(hi)).measure_below(edges))
        recv[t] = int(per_t.sum())
        send += per_t
    return recv, send


def _union_matrix(a: MetaArrays, causal: bool, window: int | None) -> np.ndarray:
    """``[C, C]`` int64, every group in rank blocks: ``m[t, o]`` = slots of rank ``o`` some query
    of rank ``t`` sees in any row group (0 on the diagonal). Each group's remote key runs are
    tiled once per ``t`` (a few ranks per pass, at most ~2**21 runs at once) and found in that
    group's :meth:`RankRuns.block_seen`; their slot ranges, moved to ``t * C * L + slot``, form one
    union measured at every ``(t * C + o) * L``."""
    c, n = a.world, a.local_len
    every = a.every_group()
    if every is not None:
        return every.matrix(causal, window, n)
    return remote_slot_matrix(_block_parts(a, causal, window), c, n)


def _block_parts(
    a: MetaArrays, causal: bool, window: int | None
) -> list[tuple[StreamRuns, Union, Callable[[np.ndarray, np.ndarray], np.ndarray]]]:
    """Every row group's real runs, the codes its queries see in rank blocks, and the shift of
    a run into rank ``to``'s block: the parts of
    :func:`~cpshard.attention.visibility.remote_slot_matrix` and
    :func:`~cpshard.attention.visibility.wanted_slots` group by group."""

    def part(
        runs: RankRuns,
    ) -> tuple[StreamRuns, Union, Callable[[np.ndarray, np.ndarray], np.ndarray]]:
        def shift(to: np.ndarray, _rep: np.ndarray) -> np.ndarray:
            return runs.shift(to)

        return runs.real, runs.block_seen(causal, window), shift

    return [part(runs) for runs in a.runs]


@dataclass(frozen=True)
class SelectivePlan:
    """This rank's side of the selective K/V exchange, and its kernel plans.

    Attributes:
        send_index: LongTensor ``[sum(send_splits)]`` of local slots, grouped by destination rank
            (a slot needed by several ranks appears once per rank).
        send_splits: Slots sent to each rank, ``C`` entries (0 for this rank).
        recv_splits: Slots received from each rank, ``C`` entries (0 for this rank).
        recv_slots: Stream slots of the received keys, in the order they arrive (rank-major).
        local: Local queries against this rank's own keys ``[L]``.
        remote: Local queries against the received keys ``[sum(recv_splits)]``, in the order
            of :attr:`key_slots`.
        recv_order: LongTensor ``[sum(recv_splits)]`` or ``None``: the received keys are put in
            stream order (by document, then position) before :attr:`remote` reads them, key
            ``j`` of that order being received key ``recv_order[j]`` (see
            :func:`stream_order`); ``None``: read in the order they arrive.
    """

    send_index: torch.Tensor
    send_splits: tuple[int, ...]
    recv_splits: tuple[int, ...]
    recv_slots: np.ndarray
    local: PairPlan
    remote: PairPlan
    recv_order: torch.Tensor | None = None

    @property
    def key_slots(self) -> np.ndarray:
        """Stream slots of the keys :attr:`remote` reads, in its order."""
        if self.recv_order is None:
            return self.recv_slots
        slots: np.ndarray = self.recv_slots[self.recv_order.cpu().numpy()]
        return slots

    @property
    def sent(self) -> int:
        """Key slots this rank sends per layer (forward)."""
        return sum(self.send_splits)

    @property
    def received(self) -> int:
        """Key slots this rank receives per layer (forward): what its queries need, no more."""
        return sum(self.recv_splits)


def _key(causal: bool, window: int | None, device: torch.device) -> str:
    return f"selective|{causal}|{window}|{device}"


def selective_planned(
    meta: TokenMeta, causal: bool, window: int | None, device: torch.device
) -> bool:
    """Whether :func:`selective_plan` would return a cached plan (no host work)."""
    return isinstance(meta.plan_cache.get(_key(causal, window, device)), SelectivePlan)


def selective_plan(
    meta: TokenMeta, causal: bool, window: int | None, device: torch.device
) -> SelectivePlan:
    """The :class:`SelectivePlan` of ``meta``'s rank, cached on the meta per mask and device.

    Args:
        meta: Token meta of the sharded batch (global: every rank's positions and documents).
        causal: Causal masking by global position.
        window: Sliding window or ``None``.
        device: Device of the index tensor and the kernel masks.

    Returns:
        The same plan object for every call with these arguments.
    """
    key = _key(causal, window, device)
    hit = meta.plan_cache.get(key)
    if isinstance(hit, SelectivePlan):
        return hit
    a = meta_arrays(meta)
    rank, world, n = meta.rank, a.world, a.local_len
    own = a.rank_slice(rank)
    spans = needed_spans(a, rank, causal, window)
    recv = Union(*spans)
    recv_slots = recv.members()
    recv_splits = tuple(int(x) for x in np.diff(recv.measure_below(np.arange(world + 1) * n)))
    sends = wanted_of(a, rank, causal, window)
    send_index = np.concatenate(sends) if sends else np.zeros(0, dtype=np.int64)
    host = host_rows(meta)
    if host.table is not None:  # the query and key runs cut from the stream's runs
        stream = stream_table(meta, True)
        width = a.pos.shape[1]
        q = block_table(stream, width, n, rank)
        k, order = stream_order(take_spans(stream, width, *spans), recv_slots.size)
        local, remote = pair_plans_of_runs(
            q, [(q, n), (k, recv_slots.size)], n, a.rows, causal=causal, window=window,
            device=device,
        )  # fmt: skip
    else:
        order = None
        local, remote = _pair_plans(a, own, recv_slots, host.merge, causal, window, device)
    plan = SelectivePlan(
        send_index=torch.from_numpy(send_index).to(device),
        send_splits=tuple(int(s.size) for s in sends),
        recv_splits=recv_splits,
        recv_slots=recv_slots,
        local=local,
        remote=remote,
        recv_order=None if order is None else torch.from_numpy(order).to(device),
    )
    meta.plan_cache[key] = plan
    return plan


SHORT_RUNS = TILE
"""Received keys whose runs average fewer slots than this (pieces below a kernel tile's width,
which the plan groups into masked tiles) are put in stream order, where that joins them into
:data:`FEWER_RUNS` times fewer runs."""
FEWER_RUNS = 4
"""How many times fewer runs the stream order must make of the received keys to be used."""


def stream_order(k: RunTable, total: int) -> tuple[RunTable, np.ndarray | None]:
    """The received keys' runs, in stream order where that makes far fewer of them.

    The keys arrive rank-major: a document cut into many short chunks across the ranks (TE's
    ``packed`` layout at a large CP size: 4-token chunks of a 512-token document at C = 64)
    arrives as one short run per chunk, each a piece of its own against every query run, and
    the plan holds tens of thousands of kernel calls. In stream order (by document, then
    position) the chunks of a document continue each other and join into one run. The order
    costs one copy of the received keys per layer (and of their gradients), so it is used only
    where the runs average fewer than :data:`SHORT_RUNS` slots and it makes at least
    :data:`FEWER_RUNS` times fewer; only with one row group (rows of different structure share
    the received slots) and no pad runs among the keys. (At C <= 4 on documents of a few hundred
    tokens, the auto calibration grid's, runs average 60+ slots and join at most 5x: no grid
    batch is read in stream order.)

    Args:
        k: Runs of the received keys in arrival order (one row group: slots ``[0, total)``).
        total: Received keys.

    Returns:
        ``(runs, order)``: the runs of the keys as the remote plan reads them, and ``order``
        (``[total]``: key ``j`` of the stream order is received key ``order[j]``), or ``k`` and
        ``None`` (arrival order).
    """
    runs = k.n.size
    if runs < 2 or total >= SHORT_RUNS * runs or k.grp.any() or (k.cls == PAD_CLASS).any():
        return k, None
    by_stream = np.lexsort((k.pos, k.cls))
    n = k.n[by_stream]
    start = np.cumsum(n) - n
    joined = join_runs(RunTable(start, n, k.pos[by_stream], k.cls[by_stream], k.grp), total)
    if joined.n.size * FEWER_RUNS > runs:
        return k, None
    return joined, arange_runs(k.start[by_stream], n, 1)


def _pair_plans(
    a: MetaArrays,
    own: slice,
    recv_slots: np.ndarray,
    merge: bool,
    causal: bool,
    window: int | None,
    device: torch.device,
) -> tuple[PairPlan, PairPlan]:
    """The local and remote kernel plans from the host copies (token by token): where the rows
    have no run table (a negative id that is not a pad of the convention)."""
    q_pos, q_doc = a.pos[:, own], a.doc[:, own]
    k_pos, k_doc = a.pos[:, recv_slots], a.doc[:, recv_slots]
    return (
        pair_plan(
            q_pos,
            q_doc,
            q_pos,
            q_doc,
            a.rows,
            causal=causal,
            window=window,
            device=device,
            pads_by_convention=merge,
        ),
        pair_plan(
            q_pos,
            q_doc,
            k_pos,
            k_doc,
            a.rows,
            causal=causal,
            window=window,
            device=device,
            pads_by_convention=merge,
        ),
    )
