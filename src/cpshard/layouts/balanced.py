"""The ``balanced`` layout: our solver for packed batches (equal tokens per rank, causal work
balanced to the limit, at most ``C - 1`` pad tokens). Pure index math.

``balanced`` sorts documents longest first and lays their tokens out *outside-in*
(positions ``0, n-1, 1, n-2, ...``; any even run of that order is a head-tail pair, whose
causal work is exactly ``(n + 1) / 2`` per token). Rank ``r`` takes ``x`` tokens from the
heavy end of the remaining pool and ``L - x`` from the light end (short documents, then pads),
``x`` chosen so its work is closest to the remaining work divided by the remaining ranks;
among ``x`` within ``work_tolerance`` of it, cuts at document boundaries are preferred, so
short documents stay whole on one rank (less remote K/V). Token counts are exactly equal and
the work error is one token's work per rank (plus ``work_tolerance``). The plan it returns is a
:class:`~cpshard.layouts.packed.PackedPlan`, like every packed layout.

Import rules: the rows of ``RULES`` in tests/unit/test_architecture.py that cover this module.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np

from cpshard.layouts.deferred import replace
from cpshard.layouts.documents import PackSpec
from cpshard.layouts.index import arange_runs, padded_length
from cpshard.layouts.packed import (
    _I64,
    PackedPlan,
    _check_world,
    _doc_lengths,
    plan_from_runs,
)

__all__ = ["plan_balanced"]


_SEARCH_BLOCKS = 256
"""A rank's cut search first looks at this many evenly spaced cuts (bounding the work of every
block of cuts between them), then at every cut of the blocks that can hold a best one."""


class _Pool:
    """The pool of :func:`_balanced_runs` (documents of lengths ``seg`` longest first, each
    outside-in, then pads) and its causal work prefix at any position, in closed form: the first
    ``m`` outside-in tokens of a document of length ``n`` are ``m // 2`` head-tail pairs of work
    ``n + 1`` each, plus position ``m // 2`` (work ``m // 2 + 1``) when ``m`` is odd; pads have
    no work. Nothing of the pool's size is made."""

    def __init__(self, seg: _I64) -> None:
        self.seg = seg
        self.end = np.cumsum(seg)
        doc_work = seg * (seg + 1) // 2
        # per document: its first pool position, pair work n + 1, and the work before it
        self.table = np.stack([self.end - seg, seg + 1, np.cumsum(doc_work) - doc_work], axis=1)
        self.real = int(self.end[-1]) if seg.size else 0

    def cum(self, p: _I64) -> _I64:
        """``cum[p]``: the work of the first ``p`` pool tokens, for ``p`` in ``[0, padded]``."""
        p = np.minimum(p, self.real)
        d = np.searchsorted(self.end, p, side="right")
        start, pair, before = self.table[np.minimum(d, self.seg.size - 1, out=d)].T
        m = p - start  # tokens of document d before position p (all of it at the end)
        half = m >> 1
        out: _I64 = before + half * pair + (m & 1) * (half + 1)
        return out

    def at_boundary(self, p: _I64) -> _I64:
        """1 where pool position ``p`` starts a document, the pads or the pool, else 0."""
        i = np.minimum(np.searchsorted(self.end, p), self.seg.size - 1)
        edge: _I64 = ((p == 0) | (p >= self.real) | (self.end[i] == p)).astype(np.int64)
        return edge


def _at_ends(f: Callable[[_I64], _I64], heavy: int, light: int, ks: _I64) -> tuple[_I64, _I64]:
    """``f`` at the heavy range's end ``heavy + ks`` and the light range's start ``light + ks``
    (one call for both)."""
    both = f(np.concatenate([heavy + ks, light + ks]))
    return both[: ks.size], both[ks.size :]


def _cut(pool: _Pool, lo: int, hi: int, local: int, ranks_left: int, tolerance: float) -> int:
    """How many heavy tokens ``k`` (``[lo, lo + k)``; then ``local - k`` light ones,
    ``[hi - local + k, hi)``) the next rank takes: the ``k`` whose work is closest to the
    remaining work divided by ``ranks_left``; among those within ``tolerance`` of the target,
    cuts at document boundaries first.

    Up to ``4 * _SEARCH_BLOCKS`` cuts, looks at every one. Beyond, looks at
    :data:`_SEARCH_BLOCKS` evenly spaced ``k`` first; the work of any ``k`` of the
    block after one lies between that ``k``'s work minus the block's light work and plus its
    heavy work, so blocks whose every ``k`` is farther from the target than a ``k`` already seen
    (plus the tolerance) can hold no candidate and are skipped. The others are searched ``k`` by
    ``k``: the same choice as a search of every ``k``, in ``O(blocks + kept blocks' k)``.
    """
    few = local + 1 <= 4 * _SEARCH_BLOCKS  # few cuts: every one, no blocks
    if few:
        ks = np.arange(local + 1, dtype=np.int64)
    else:  # the block edges first
        width = -(-(local + 1) // _SEARCH_BLOCKS)
        ks = np.append(np.arange(0, local + 1, width, dtype=np.int64), local)
    heavy, light = _at_ends(pool.cum, lo, hi - local, ks)
    total = int(light[-1] - heavy[0])  # k = 0: cum[lo]; the last k is local: cum[hi]
    target = total / ranks_left
    slack = tolerance * target
    if not few:
        edges = ks
        work = heavy - light + total
        seen = np.abs(work - target).min()
        # the work of k in [edges[j], edges[j + 1]) lies in [work[j] - light_j, work[j] + heavy_j]
        low = (work[:-1] - np.diff(light)) - target
        high = target - (work[:-1] + np.diff(heavy))
        bound = np.maximum(np.maximum(low, high), 0.0)
        # a margin of one unit of work against rounding: kept blocks are searched exactly
        kept = np.flatnonzero(bound <= seen + slack + 1.0 + 1e-9 * target)
        ks = np.append(arange_runs(edges[kept], edges[kept + 1] - edges[kept], 1), local)
        heavy, light = _at_ends(pool.cum, lo, hi - local, ks)
    err = np.abs((heavy - light + total) - target)
    ok = err <= err.min() + slack
    ks, err = ks[ok], err[ok]
    heavy_edge, light_edge = _at_ends(pool.at_boundary, lo, hi - local, ks)
    cuts = heavy_edge + light_edge
    best = cuts == cuts.max()  # prefer cuts at document boundaries
    return int(ks[best][np.argmin(err[best])])


def _balanced_runs(lens: _I64, world_size: int, work_tolerance: float) -> tuple[_I64, _I64]:
    """The balanced rank map as runs ``(first, count)`` of consecutive stream positions, in slot
    order (:func:`_pool_to_runs`): rank ``r`` takes pool ranges ``[lo, lo + k)`` and
    ``[hi - local + k, hi)`` (:func:`_cut`), the last rank what is left."""
    real = int(lens.sum())
    padded = padded_length(real, world_size)
    local = padded // world_size
    order = np.argsort(-lens, kind="stable")
    pool = _Pool(lens[order])
    range_lo = np.empty(2 * world_size - 1, dtype=np.int64)
    range_len = np.empty(2 * world_size - 1, dtype=np.int64)
    range_rank = np.empty(2 * world_size - 1, dtype=np.int64)
    lo, hi = 0, padded
    for r in range(world_size - 1):
        k = _cut(pool, lo, hi, local, world_size - r, work_tolerance)
        range_lo[2 * r], range_len[2 * r], range_rank[2 * r] = lo, k, r
        range_lo[2 * r + 1], range_len[2 * r + 1] = hi - local + k, local - k
        range_rank[2 * r + 1] = r
        lo, hi = lo + k, hi - local + k
    range_lo[-1], range_len[-1], range_rank[-1] = lo, hi - lo, world_size - 1
    used = range_len > 0
    return _pool_to_runs(
        lens, order, pool.seg, pool.end, range_lo[used], range_rank[used], real, padded
    )


def _pool_to_runs(
    lens: _I64,
    order: _I64,
    seg: _I64,
    seg_end: _I64,
    range_lo: _I64,
    range_rank: _I64,
    real: int,
    padded: int,
) -> tuple[_I64, _I64]:
    """The rank map's runs ``(first, count)`` in slot order, from the ranks' non-empty pool
    ranges (``range_lo`` their starts; they tile ``[0, padded)``): each range is split at
    document boundaries; a piece ``[m0, m1)`` of a document's outside-in order (length ``n``,
    stream start ``s``) is the stream head ``[s + ceil(m0/2), s + ceil(m1/2))`` and tail
    ``[s + n - m1 // 2, s + n - m0 // 2)``; pads map to themselves. Each rank's intervals, in
    stream order, are its local tokens (empty ones dropped)."""
    by_lo = np.argsort(range_lo, kind="stable")
    range_lo, range_rank = range_lo[by_lo], range_rank[by_lo]
    cuts = np.union1d(np.concatenate([range_lo, seg_end]), [0, real, padded])
    a, b = cuts[:-1], cuts[1:]
    rank = range_rank[np.searchsorted(range_lo, a, side="right") - 1]
    is_doc = a < real
    q = np.searchsorted(seg_end, a[is_doc], side="right")  # sorted document of each piece
    n = seg[q]
    s = (np.cumsum(lens) - lens)[order[q]]
    m0 = a[is_doc] - (seg_end[q] - n)
    m1 = b[is_doc] - (seg_end[q] - n)
    starts = np.concatenate([s + (m0 + 1) // 2, s + n - m1 // 2, a[~is_doc]])
    ends = np.concatenate([s + (m1 + 1) // 2, s + n - m0 // 2, b[~is_doc]])
    owner = np.concatenate([rank[is_doc], rank[is_doc], rank[~is_doc]])
    keyed = np.argsort(owner * (padded + 1) + starts)
    first, count = starts[keyed], ends[keyed] - starts[keyed]
    kept = count > 0
    return first[kept], count[kept]


def plan_balanced(spec: PackSpec, world_size: int, work_tolerance: float = 1e-3) -> PackedPlan:
    """Our balanced layout: equal token counts, causal work balanced, minimal padding.

    ``P`` is the smallest multiple of ``C`` holding the real tokens (at most ``C - 1`` pads, at
    the stream end). Deterministic: depends only on the document lengths and ``C``. Each rank's
    local tokens are in stream order, so documents stay contiguous and causal locally.

    Args:
        spec: The batch's document structure.
        world_size: CP size ``C``.
        work_tolerance: Relative work slack (of the per-rank target) a rank may accept to cut
            at a document boundary instead of splitting a document; ``0`` = best work only.

    Returns:
        The plan; ``plan.rank_map`` is ``[C, P / C]``.
    """
    _check_world(spec, world_size)
    if work_tolerance < 0:
        raise ValueError(f"work_tolerance must be >= 0, got work_tolerance={work_tolerance}")
    t0 = time.perf_counter()
    first, count = _balanced_runs(_doc_lengths(spec), world_size, work_tolerance)
    plan = plan_from_runs(spec, "balanced", world_size, first, count)
    return replace(plan, solver_seconds=time.perf_counter() - t0)
