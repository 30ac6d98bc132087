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
from dataclasses import replace

import numpy as np

from cpshard.layouts.documents import PackSpec
from cpshard.layouts.index import padded_length
from cpshard.layouts.packed import (
    _I64,
    PackedPlan,
    _check_world,
    _doc_lengths,
    plan_from_runs,
)

__all__ = ["plan_balanced"]


# Pool tokens per pass of :func:`_pool_work_prefix`: its temporaries (128 KB each) stay in the
# core's cache, where whole-pool temporaries (1.2 MB each at 147k tokens) went to memory and
# back on every one of their eight passes.
_PREFIX_CHUNK = 1 << 15


def _pool_work_prefix(seg: _I64, real: int, padded: int) -> _I64:
    """``cum[p]``: causal work of the first ``p`` pool tokens (documents of lengths ``seg``,
    each outside-in, then pads). Closed form: the first ``m`` outside-in tokens of a document
    of length ``n`` are ``m // 2`` head-tail pairs of work ``n + 1`` each, plus position
    ``m // 2`` (work ``m // 2 + 1``) when ``m`` is odd. Made :data:`_PREFIX_CHUNK` tokens at a
    time (the documents that overlap each chunk, cut at its ends)."""
    seg_end = np.cumsum(seg)
    seg_start = seg_end - seg
    doc_work = seg * (seg + 1) // 2
    work_before = np.cumsum(doc_work) - doc_work
    cum = np.empty(padded + 1, dtype=np.int64)
    cum[0] = 0
    chunk = min(_PREFIX_CHUNK, max(real, 1))
    ramp = np.arange(1, chunk + 1, dtype=np.int64)
    m_buf = np.empty(chunk, dtype=np.int64)
    for a in range(0, real, chunk):
        b = min(a + chunk, real)
        n = b - a
        d0 = int(np.searchsorted(seg_end, a, side="right"))
        d1 = int(np.searchsorted(seg_end, b - 1, side="right")) + 1
        counts = np.minimum(seg_end[d0:d1], b) - np.maximum(seg_start[d0:d1], a)
        body = cum[a + 1 : b + 1]
        m = m_buf[:n]  # tokens taken of the current document
        np.add(ramp[:n], a, out=m)
        m -= np.repeat(seg_start[d0:d1], counts)
        np.right_shift(m, 1, out=body)
        np.bitwise_and(m, 1, out=m)
        m *= body + 1  # odd m: the middle token, position m // 2
        body *= np.repeat(seg[d0:d1] + 1, counts)
        body += m
        body += np.repeat(work_before[d0:d1], counts)
    cum[real + 1 :] = cum[real]
    return cum


def _balanced_runs(lens: _I64, world_size: int, work_tolerance: float) -> tuple[_I64, _I64]:
    """The balanced rank map as runs ``(first, count)`` of consecutive stream positions, in slot
    order (:func:`_pool_to_runs`)."""
    real = int(lens.sum())
    padded = padded_length(real, world_size)
    local = padded // world_size
    order = np.argsort(-lens, kind="stable")
    seg = lens[order]
    seg_end = np.cumsum(seg)
    cum = _pool_work_prefix(seg, real, padded)
    boundary = np.zeros(padded + 1, dtype=np.int8)
    boundary[seg_end] = 1
    boundary[0] = 1
    boundary[real:] = 1
    # pool ranges [lo, hi) and their ranks; rank r takes k heavy tokens [lo, lo + k) and
    # local - k light ones [hi - local + k, hi)
    range_lo = np.empty(2 * world_size - 1, dtype=np.int64)
    range_len = np.empty(2 * world_size - 1, dtype=np.int64)
    range_rank = np.empty(2 * world_size - 1, dtype=np.int64)
    work = np.empty(local + 1, dtype=np.int64)
    err = np.empty(local + 1, dtype=np.float64)
    lo, hi = 0, padded
    for r in range(world_size - 1):
        total = cum[hi] - cum[lo]
        target = total / (world_size - r)
        # heavy + light work of each k, exactly as integers
        np.subtract(cum[lo : lo + local + 1], cum[hi - local : hi + 1], out=work)
        work += total
        np.subtract(work, target, out=err)
        np.abs(err, out=err)
        ok = np.flatnonzero(err <= err.min() + work_tolerance * target)
        cuts = boundary[lo + ok] + boundary[hi - local + ok]
        cand = ok[cuts == cuts.max()]  # prefer cuts at document boundaries
        k = int(cand[np.argmin(err[cand])])
        range_lo[2 * r], range_len[2 * r], range_rank[2 * r] = lo, k, r
        range_lo[2 * r + 1], range_len[2 * r + 1] = hi - local + k, local - k
        range_rank[2 * r + 1] = r
        lo, hi = lo + k, hi - local + k
    range_lo[-1], range_len[-1], range_rank[-1] = lo, hi - lo, world_size - 1
    used = range_len > 0
    return _pool_to_runs(lens, order, seg, seg_end, range_lo[used], range_rank[used], real, padded)


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
