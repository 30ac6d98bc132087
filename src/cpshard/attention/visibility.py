"""How many keys each query sees, and which, by closed forms over runs of the stream (host).

The facts behind the selective exchange and the cost model of ``attention="auto"`` are counts of
visible (query, key) pairs and sets of visible key slots. Computing them token by token costs a
sort of the whole stream and a binary search per token and rank pair; at 1M tokens over 64 ranks
that is seconds per batch. Here the stream is cut into *runs* (:func:`~cpshard.attention.pieces.
run_table`: consecutive slots of one rank, one document, consecutive positions; a stretch of
padding is one run) and every count is a closed form over runs: the work grows with the number
of runs (documents times their cuts), not with the tokens.

Encoding: ``(document, position)`` is one int64 code, ``doc * span + (pos - lo_pos)`` with
``doc`` the document's index among the stream's documents (:class:`Frame`: any int64 ids, however
sparse, give codes below ``documents * span``), so the keys of one document occupy one range of
codes and the keys a query sees are one code interval:

* causal: ``[doc start, code(q) + 1)``, with a window ``[code(q - window + 1), code(q) + 1)``
  (clipped to the document's start);
* bidirectional: the document's whole range.

A set of key runs is a multiset of code intervals ``[c_j, e_j)``. The number of its keys below a
code ``x`` is ``F(x) = sum_j max(0, x - c_j) - max(0, x - e_j)``, and the sum of ``F`` over the
codes ``[u, v)`` has the closed form ``Q(v) - Q(u)`` with
``2 Q(x) = sum_{c_j < x} (x - c_j)^2 - (x - c_j)`` (minus the same over the ends). Both come from
prefix sums of the sorted ends and binary searches: :class:`KeyCounts`. The prefix sums of
squares exceed int64 for large codes, so they are taken modulo ``2**64`` (numpy ``uint64``
wraps): every result is a count that fits in int64, and a difference of values that agree
modulo ``2**64`` is exact.

Where the runs *tile* their documents (no two real tokens share a code, and each rank's runs
are in code order in the stream: every built-in layout), the runs sorted by code once answer
without any search (:class:`Tiling`): a run's keys below it are the tokens of its document's
earlier runs (a prefix sum), a rank's queries of a document see the document up to the end of
its last run there, and a key run is seen whole or not at all. Without a window the facts
(:meth:`RankRuns.tiled_sums`) and the selective plan's slots are prefix sums over the sorted
runs, ``O(R)`` after one linear sort; a window keeps the searches above.

A pad (document id ``-1 - position``) sees only itself: pad runs count one pair per token, on
their own rank, and are never keys of anyone else.

Import rules: the rows of ``RULES`` in tests/unit/test_architecture.py that cover this module.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from cpshard.attention.pieces import PAD_CLASS, RunTable
from cpshard.layouts.index import arange_runs

__all__ = [
    "Depth",
    "Frame",
    "KeyCounts",
    "RankRuns",
    "StreamRuns",
    "TiledSums",
    "Tiling",
    "Union",
    "coded",
    "per_rank",
    "query_intervals",
    "raw_runs",
    "remote_slot_matrix",
    "table_ids",
    "visible_pairs",
    "wanted_slots",
]

_I64 = npt.NDArray[np.int64]
_U64 = npt.NDArray[np.uint64]


@dataclass(frozen=True)
class Frame:
    """The ``(document, position)`` -> code map of one batch.

    Attributes:
        docs: Sorted distinct document ids of the real (non-pad) runs; a run's document is
            coded by its index here.
        lo_pos: Lowest position.
        span: Codes per document: ``max position - lo_pos + 2`` (room for one past the last
            position, and a code after it that no key has).
    """

    docs: _I64
    lo_pos: int
    span: int

    def doc_start(self, doc: _I64) -> _I64:
        """Code of document index ``doc``'s lowest possible position (its keys are at or above)."""
        out: _I64 = doc * self.span
        return out

    def code(self, doc: _I64, pos: _I64) -> _I64:
        """Code of ``(document index, pos)``, positions clipped into the document's range."""
        out: _I64 = self.doc_start(doc) + np.clip(pos - self.lo_pos, 0, self.span - 1)
        return out


@dataclass(frozen=True)
class StreamRuns:
    """The runs of one row group's stream (rank-major; runs never cross a rank boundary).

    Attributes:
        start: ``[R]`` stream slot of each run's first token.
        n: ``[R]`` tokens of each run.
        pos: ``[R]`` position of each run's first token.
        doc: ``[R]`` document index in :attr:`Frame.docs` (pad runs: 0).
        rank: ``[R]`` rank holding the run.
        pad: ``[R]`` the run is a stretch of padding (each token sees only itself).
        code: ``[R]`` code of the first token (meaningless for pad runs).
    """

    start: _I64
    n: _I64
    pos: _I64
    doc: _I64
    rank: _I64
    pad: npt.NDArray[np.bool_]
    code: _I64

    def take(self, sel: npt.NDArray[np.bool_] | _I64 | slice) -> StreamRuns:
        """The runs where ``sel`` holds (a bool mask, indices or a slice)."""
        if isinstance(sel, np.ndarray) and sel.dtype == np.bool_:
            sel = sel.nonzero()[0]  # the mask read once, not once per column
        return StreamRuns(
            self.start[sel], self.n[sel], self.pos[sel], self.doc[sel], self.rank[sel],
            self.pad[sel], self.code[sel],
        )  # fmt: skip


def table_ids(table: RunTable) -> _I64:
    """The document id of every run's first slot: its class, or ``-1 - position`` for a pad run
    (the id of its first pad), so a table stands for the ids it was cut from."""
    pad = table.cls == PAD_CLASS
    out: _I64 = np.where(pad, -1 - table.pos, table.cls)
    return out


def raw_runs(table: RunTable, width: int, groups: int, local_len: int) -> list[StreamRuns]:
    """The runs of every stream row, with their document *ids* and no codes yet (see
    :func:`coded`).

    Args:
        table: The stream's runs of every row group, cut at the rank blocks
            (``run_table(pos, doc, merge_pads, breaks=max(local_len, 1))``, or the same table
            found otherwise); slot ``g * width + i`` is slot ``i`` of row group ``g``.
        width: Slots per row group, ``C * L``.
        groups: Row groups ``G``.
        local_len: Tokens per rank ``L``.

    Returns:
        One :class:`StreamRuns` per row group (slots relative to the row).
    """
    start = table.start - table.grp * width
    pad = table.cls == PAD_CLASS
    rank = start // max(local_len, 1)
    ids = table_ids(table)
    cuts = np.searchsorted(table.grp, np.arange(groups + 1))
    out = []
    for g in range(groups):
        sl = slice(int(cuts[g]), int(cuts[g + 1]))
        out.append(
            StreamRuns(
                start[sl], table.n[sl], table.pos[sl], ids[sl], rank[sl], pad[sl], 0 * rank[sl]
            )
        )
    return out


def coded(runs: StreamRuns, frame: Frame) -> StreamRuns:
    """``runs`` (from :func:`raw_runs`) with document indices of ``frame`` and codes."""
    docs = frame.docs
    if docs.size and docs[0] >= 0 and int(docs[-1]) <= 8 * runs.doc.size + 4096:
        index = np.zeros(int(docs[-1]) + 1, dtype=np.int64)  # dense ids: one lookup, no search
        index[docs] = np.arange(docs.size, dtype=np.int64)
        doc = np.where(runs.pad, 0, index[np.where(runs.pad, 0, runs.doc)])
    else:
        doc = np.where(runs.pad, 0, np.searchsorted(docs, runs.doc))
    code = np.where(runs.pad, 0, frame.code(doc, runs.pos))
    return StreamRuns(runs.start, runs.n, runs.pos, doc, runs.rank, runs.pad, code)


def per_rank(rank: _I64, values: _I64, world: int) -> _I64:
    """``[C]`` int64: the sum of ``values`` per ``rank`` (exact, unlike a float ``bincount``)."""
    out = np.zeros(world, dtype=np.int64)
    np.add.at(out, rank, values)
    return out


def _is_sorted(x: _I64) -> bool:
    """Whether ``x`` is non-decreasing (one pass; then no sort is needed)."""
    return x.size < 2 or bool((x[1:] >= x[:-1]).all())


def _prefix(x: _U64) -> _U64:
    out = np.zeros(x.size + 1, dtype=np.uint64)
    x.cumsum(out=out[1:])
    return out


class KeyCounts:
    """Counts over a multiset of key code intervals ``[lo_j, hi_j)`` (see the module doc).

    Args:
        lo: ``[K]`` first code of each key run.
        hi: ``[K]`` one past its last code.
    """

    def __init__(self, lo: _I64, hi: _I64) -> None:
        self._ends = []
        for e in (lo, hi):
            e_sorted = e if _is_sorted(e) else np.sort(e)
            s = e_sorted.astype(np.uint64)
            self._ends.append((e_sorted, _prefix(s), _prefix(s * s)))

    def below(self, x: _I64) -> _I64:
        """``[N]``: keys with a code ``< x`` (a key run contributes its part below ``x``)."""
        (lo, lo1, _), (hi, hi1, _) = self._ends
        k, j = lo.searchsorted(x, side="left"), hi.searchsorted(x, side="left")
        # the sum of x - e over the k starts below x, minus the same over the j ends below x
        total = (k - j).astype(np.uint64) * x.astype(np.uint64) - lo1[k] + hi1[j]
        out: _I64 = total.view(np.int64)
        return out

    def _twice_q(self, x: _I64) -> _U64:
        """``2 Q(x)`` (modulo ``2**64``): the sum of ``(x - e)^2 - (x - e)``, that is
        ``x (x - 1) - (2 x - 1) e + e^2``, over the starts ``e`` below ``x``, minus the same over
        the ends below ``x``."""
        (lo, lo1, lo2), (hi, hi1, hi2) = self._ends
        k, j = lo.searchsorted(x, side="left"), hi.searchsorted(x, side="left")
        xu = x.astype(np.uint64)
        total: _U64 = (k - j).astype(np.uint64) * (xu * xu - xu)
        total -= (xu + xu - np.uint64(1)) * (lo1[k] - hi1[j])
        total += lo2[k] - hi2[j]
        return total

    def range_sum(self, u: _I64, v: _I64) -> _I64:
        """``[N]``: ``sum of below(x) for u <= x < v`` (``u <= v``)."""
        both = self._twice_q(np.concatenate([u, v]))  # one pass for both bounds
        twice: _I64 = (both[u.size :] - both[: u.size]).view(np.int64)
        return twice // 2


def visible_pairs(
    q: StreamRuns,
    keys: KeyCounts,
    frame: Frame,
    causal: bool,
    window: int | None,
    shift: _I64 | int = 0,
) -> _I64:
    """``[R]`` visible (query, key) pairs of each non-pad query run against ``keys``.

    Args:
        q: Query runs, none of them pad runs.
        keys: The key set.
        frame: The code map.
        causal: Causal masking.
        window: Sliding window (causal only) or ``None``.
        shift: Added to every code of the queries (``[R]`` or a scalar): the rank blocks of
            :class:`RankRuns`, where ``keys`` holds every rank's keys shifted alike.
    """
    n = q.n
    ds = frame.doc_start(q.doc) + shift
    if not causal:
        return n * (keys.below(ds + frame.span - 1) - keys.below(ds))
    code = q.code + shift
    upper = keys.range_sum(code + 1, code + n + 1)
    if window is None:
        return upper - n * keys.below(ds)
    first = q.pos - window + 1  # lowest key position of the run's first query
    clipped = np.clip(frame.lo_pos - first, 0, n)  # queries whose window starts before lo_pos
    lower = clipped * keys.below(ds) + keys.range_sum(
        ds + (first + clipped - frame.lo_pos), ds + (first + n - frame.lo_pos)
    )
    out: _I64 = upper - lower
    return out


def query_intervals(
    q: StreamRuns, frame: Frame, causal: bool, window: int | None
) -> tuple[_I64, _I64]:
    """``(lo, hi)``: the code interval of the keys each non-pad query run's queries see."""
    ds = frame.doc_start(q.doc)
    if not causal:
        return ds, ds + frame.span - 1
    hi = q.code + q.n
    if window is None:
        return ds, hi
    return frame.code(q.doc, q.pos - window + 1), hi


class Union:
    """The union of code intervals, as sorted disjoint intervals.

    Args:
        lo: ``[N]`` interval starts.
        hi: ``[N]`` interval ends (exclusive).
    """

    def __init__(self, lo: _I64, hi: _I64) -> None:
        order = lo.argsort(kind="stable")
        lo, hi = lo[order], hi[order]
        if lo.size:
            hi = np.maximum.accumulate(hi)
            start = np.empty(lo.size + 1, dtype=bool)  # and one past the last interval
            start[0] = start[-1] = True
            np.greater(lo[1:], hi[:-1], out=start[1:-1])  # a gap before it: a new interval
            lo, hi = lo[start[:-1]], hi[start[1:]]  # a first start, the last end before the next
        self.lo: _I64 = lo
        self.hi: _I64 = hi
        self._before = np.zeros(lo.size + 1, dtype=np.int64)
        (hi - lo).cumsum(out=self._before[1:])

    def measure_below(self, x: _I64) -> _I64:
        """``[N]``: codes ``< x`` inside the union."""
        if not self.lo.size:
            return np.zeros(x.shape, dtype=np.int64)
        k = self.lo.searchsorted(x, side="left")  # intervals starting below x
        last = np.maximum(k - 1, 0)
        inside = np.minimum(x - self.lo[last], self.hi[last] - self.lo[last])
        out: _I64 = np.where(k > 0, self._before[last] + inside, 0)
        return out

    def count(self, lo: _I64, hi: _I64) -> _I64:
        """``[N]``: codes of each interval ``[lo, hi)`` inside the union."""
        return self.measure_below(hi) - self.measure_below(lo)

    def members(self) -> _I64:
        """Every code inside the union, sorted."""
        return _aranges(self.lo, self.hi)

    def covered_slots(self, runs: StreamRuns, shift: _I64 | int = 0) -> tuple[_I64, _I64]:
        """Stream slots of ``runs`` whose code (plus ``shift``) lies inside the union, in run
        order, and the index of the run each slot belongs to."""
        a, b, run = self.covered_spans(runs, shift)
        return _aranges(a, b), np.repeat(run, np.maximum(b - a, 0))

    def covered_spans(self, runs: StreamRuns, shift: _I64 | int = 0) -> tuple[_I64, _I64, _I64]:
        """The slots of :meth:`covered_slots` as slot ranges ``[a, b)`` (in run order, each
        inside one run, so inside its rank's block) and the index of the run of each range."""
        if not self.lo.size or not runs.n.size:
            z = np.zeros(0, dtype=np.int64)
            return z, z, z
        c = runs.code + shift
        e = c + runs.n
        i0 = self.hi.searchsorted(c, side="right")  # first interval ending after c
        i1 = self.lo.searchsorted(e, side="left")  # intervals starting before e
        counts = np.maximum(i1 - i0, 0)
        run = np.arange(c.size).repeat(counts)
        offs = counts.cumsum() - counts
        iv = i0[run] + (np.arange(run.size) - offs[run])
        a = np.maximum(c[run], self.lo[iv]) - c[run] + runs.start[run]
        b = np.minimum(e[run], self.hi[iv]) - c[run] + runs.start[run]
        return a, b, run


class Depth:
    """A step function of codes: ``D(x) = sum of step[k] for every end[k] <= x`` (e.g. +1 at each
    interval start and -1 at each end: how many intervals cover ``x``), and its integral.

    Args:
        end: ``[N]`` codes where the function steps.
        step: ``[N]`` the step at each.
    """

    def __init__(self, end: _I64, step: _I64) -> None:
        order = np.argsort(end, kind="stable")
        self._at = end[order]
        self._level = np.cumsum(step[order])  # D on [at[k], at[k + 1])
        widths = np.diff(self._at) * self._level[:-1] if self._at.size else self._at
        self._area = np.zeros(self._at.size, dtype=np.int64)  # integral up to at[k]
        if self._at.size > 1:
            np.cumsum(widths, out=self._area[1:])

    def integral(self, x: _I64) -> _I64:
        """``[N]``: ``sum of D(y) for y < x``."""
        if not self._at.size:
            return np.zeros(x.shape, dtype=np.int64)
        k = np.searchsorted(self._at, x, side="right") - 1  # last step at or below x
        last = np.maximum(k, 0)
        out: _I64 = np.where(k >= 0, self._area[last] + self._level[last] * (x - self._at[last]), 0)
        return out


class RankRuns:
    """The runs of one row group's stream, by rank, with the counting structures the plans share
    (built on first use, then kept for the batch).

    Args:
        runs: The stream's runs (rank-major, so each rank's runs are one slice).
        world: CP size ``C``.
        frame: The code map.
        blocked: Answer per-rank questions for every rank at once in rank blocks (see
            :meth:`shift`); default: when the shifted codes fit int64.

    Attributes:
        runs: Every run.
    """

    def __init__(
        self, runs: StreamRuns, world: int, frame: Frame, blocked: bool | None = None
    ) -> None:
        self.runs = runs
        self.frame = frame
        self.world = world
        self.stride = max(frame.docs.size, 1) * frame.span
        self.blocked = self.stride * world < 1 << 62 if blocked is None else blocked
        self._keys: dict[int | None, KeyCounts] = {}
        self._by_code: StreamRuns | None = None
        self._order: _I64 | None = None
        self._tiled: dict[bool, TiledSums | None] = {}
        self._tiling: list[Tiling | None] = []
        self._block_keys: KeyCounts | None = None
        self._seen: dict[tuple[int | None, bool, int | None], Union] = {}

    @functools.cached_property
    def real(self) -> StreamRuns:
        """The runs that are not padding (the keys anyone but their own token can see).

        Made on first use, as are :attr:`pad_tokens` and the rank bounds: the row groups asked
        all at once (:class:`~cpshard.attention.grouped_runs.GroupedRuns`) read neither."""
        return self.runs.take(~self.runs.pad)

    @functools.cached_property
    def pad_tokens(self) -> _I64:
        """``[C]`` pad tokens of each rank."""
        pad = self.runs.pad
        return per_rank(self.runs.rank[pad], self.runs.n[pad], self.world)

    @functools.cached_property
    def _bounds(self) -> _I64:
        out: _I64 = self.real.rank.searchsorted(np.arange(self.world + 1), side="left")
        return out

    def of(self, rank: int) -> StreamRuns:
        """The real runs of ``rank``."""
        return self.real.take(slice(int(self._bounds[rank]), int(self._bounds[rank + 1])))

    def by_code(self) -> StreamRuns:
        """The real runs sorted by code (stable): queries in this order make the binary searches
        of :class:`KeyCounts` walk their sorted ends forward (each rank's runs are mostly sorted
        already, so the sort merges ``C`` sorted blocks)."""
        if self._by_code is None:
            order = _stable_order(self.real.code)
            self._order = order
            self._by_code = self.real.take(order)
        return self._by_code

    def tiling(self) -> Tiling | None:
        """The :class:`Tiling` of the real runs, or ``None`` where it does not hold: two real
        tokens share a ``(document, position)``, a rank's runs are not in code order in the
        stream, or there is no real token. Every built-in layout's stream with a real token has
        one (each position once, each rank's slots in position order)."""
        if not self._tiling:
            ordered = self.by_code()
            assert self._order is not None
            self._tiling.append(_tiling(self.real, ordered, self._order))
        return self._tiling[0]

    def tiled_sums(self, causal: bool) -> TiledSums | None:
        """The per-rank sums of :class:`TiledSums` without a window, by prefix sums in code order
        (``O(R)`` after :meth:`by_code`'s sort, no binary search), or ``None`` without a
        :meth:`tiling` (then :func:`visible_pairs` and the unions answer, as for a window)."""
        if causal not in self._tiled:
            tiling = self.tiling()
            sums = None if tiling is None else _tiled_sums(self.real, tiling, self.world, causal)
            self._tiled[causal] = sums
        return self._tiled[causal]

    def keys(self, rank: int | None = None) -> KeyCounts:
        """The :class:`KeyCounts` of ``rank``'s real runs (``None``: of every rank's).

        Every rank's keys are counted over the runs joined where they touch in code order (the
        ranks' pieces of one document: a layout that cuts documents into ``2C`` chunks has
        ~``R / 2C`` intervals left), so the searches run over a small, cache-resident array.
        Joining ``[a, b)`` and ``[b, c)`` into ``[a, c)`` leaves every count of
        :class:`KeyCounts` unchanged (both are sums over the codes an interval holds)."""
        hit = self._keys.get(rank)
        if hit is None:
            if rank is None:
                lo, hi = _joined(self.by_code())
            else:
                r = self.of(rank)
                lo, hi = r.code, r.code + r.n
            hit = self._keys[rank] = KeyCounts(lo, hi)
        return hit

    def block_keys(self) -> KeyCounts:
        """The :class:`KeyCounts` of every rank's real runs, each in its rank block."""
        if self._block_keys is None:
            lo = self.real.code + self.shift()
            self._block_keys = KeyCounts(lo, lo + self.real.n)
        return self._block_keys

    def shift(self, rank: _I64 | None = None) -> _I64:
        """The *rank blocks*: rank ``r``'s codes shifted by ``r * stride`` lie in
        ``[r * stride, (r + 1) * stride)``, so one structure answers per-rank questions for every
        rank at once (only when :attr:`blocked`: the shifted codes fit int64).

        Args:
            rank: Ranks (default: of every real run).
        """
        out: _I64 = (self.real.rank if rank is None else rank) * self.stride
        return out

    def seen(self, rank: int, causal: bool, window: int | None) -> Union:
        """The codes of the keys ``rank``'s real queries see."""
        return self._union(rank, causal, window)

    def block_seen(self, causal: bool, window: int | None) -> Union:
        """The codes of the keys every rank's real queries see, each rank in its rank block."""
        return self._union(None, causal, window)

    def _union(self, rank: int | None, causal: bool, window: int | None) -> Union:
        key = (rank, causal, window)
        hit = self._seen.get(key)
        if hit is None:
            q = self.real if rank is None else self.of(rank)
            lo, hi = query_intervals(q, self.frame, causal, window)
            if rank is None:
                lo, hi = lo + self.shift(), hi + self.shift()
            hit = self._seen[key] = Union(lo, hi)
        return hit


@dataclass(frozen=True)
class TiledSums:
    """Per-rank sums of one row group's real runs for a mask without a window (see
    :meth:`RankRuns.tiled_sums`); pad tokens are not counted.

    Attributes:
        pairs: ``[C]`` visible pairs of each rank's queries against every key.
        local: ``[C]`` of those, against the rank's own keys.
        recv: ``[C]`` remote key slots each rank's queries see.
        send: ``[C]`` sum over the other ranks of the rank's key slots they see.
    """

    pairs: _I64
    local: _I64
    recv: _I64
    send: _I64


@dataclass(frozen=True)
class Tiling:
    """The real runs of one row group sorted by code when they tile their documents: no two
    real tokens share a code, so the runs of a document in code order are disjoint and
    ascending, and each rank's runs are in code order in the stream too (see
    :meth:`RankRuns.tiling`).

    Attributes:
        order: ``[R]`` the real runs (stream order) in code order: ``ordered = real.take(order)``.
        ordered: The real runs in code order.
        head: ``[R]`` (code order) the run is its document's first.
        before: ``[R]`` (code order) tokens of the document's earlier runs.
        doc_total: ``[R]`` (code order) tokens of the run's document.
        last: ``[R]`` (code order) the run is its rank's last of the document.
        own_head: ``[R]`` (stream order) the run is its rank's first of the document.
    """

    order: _I64
    ordered: StreamRuns
    head: npt.NDArray[np.bool_]
    before: _I64
    doc_total: _I64
    last: npt.NDArray[np.bool_]
    own_head: npt.NDArray[np.bool_]

    def marks(self) -> tuple[_I64, _I64]:
        """``(marks, in_doc)`` per run (code order): the :attr:`last` marks of its document
        before it, and in its whole document (each rank with runs there has one)."""
        return _group_prefix(self.last.astype(np.int64), self.head)

    def covered(self, rank: int, causal: bool) -> npt.NDArray[np.bool_]:
        """``[R]`` (code order): the runs some query of ``rank`` sees (its own included): its
        documents' runs up to its last run there (causal), or all of them."""
        mine = (self.ordered.rank == rank).astype(np.int64)
        seen, in_doc = _group_prefix(mine, self.head)
        out: npt.NDArray[np.bool_] = (in_doc > seen) if causal else (in_doc > 0)
        return out

    def needed_runs(self, rank: int, causal: bool) -> npt.NDArray[np.bool_]:
        """``[R]`` (stream order): the other ranks' runs some query of ``rank`` sees (whole)."""
        seen = self.covered(rank, causal) & (self.ordered.rank != rank)
        take = np.zeros(seen.size, dtype=bool)
        take[self.order] = seen
        return take

    def wanted(self, rank: int, world: int, local_len: int, causal: bool) -> list[_I64]:
        """Per rank ``t``: the sorted local slots of ``rank`` some query of ``t`` sees (none for
        ``rank`` itself). A run of ``rank`` is seen by the ranks whose last run of its document
        is at or after it (causal), or by every rank with a run there."""
        s = self.ordered
        size = s.n.size
        own = np.flatnonzero(s.rank == rank)  # code order: also its stream order
        marks = np.zeros(size + 1, dtype=np.int64)
        np.cumsum(self.last, out=marks[1:])
        first = np.flatnonzero(self.head)
        doc = np.cumsum(self.head)[own] - 1
        ends = np.append(first[1:], size)[doc]
        lo = marks[own] if causal else marks[first[doc]]
        counts = marks[ends] - lo
        run = np.repeat(np.arange(own.size, dtype=np.int64), counts)
        offs = np.cumsum(counts) - counts
        mark = lo[run] + (np.arange(run.size, dtype=np.int64) - offs[run])
        to = s.rank[np.flatnonzero(self.last)[mark]]
        keep = to != rank
        run, to = run[keep], to[keep]
        by_peer = _stable_order(to)  # per peer, in this rank's slot order
        run, to = run[by_peer], to[by_peer]
        j = own[run]
        a = s.start[j] - rank * local_len
        slots = _aranges(a, a + s.n[j])
        cuts = np.zeros(world + 1, dtype=np.int64)
        np.cumsum(per_rank(to, s.n[j], world), out=cuts[1:])
        return [slots[cuts[t] : cuts[t + 1]] for t in range(world)]


def remote_slot_matrix(
    parts: Iterable[tuple[StreamRuns, Union, Callable[[_I64, _I64], _I64]]],
    world: int,
    local_len: int,
) -> _I64:
    """``[C, C]`` int64: ``m[t, o]`` = slots of rank ``o`` some query of rank ``t`` sees, over
    every part (0 on the diagonal).

    A part is ``(keys, seen, shift)``: real key runs, the codes every rank's queries see with
    each rank in its block, and ``shift(to, rep)``, the code shift of run ``rep`` into rank
    ``to``'s block. Each part's remote key runs are tiled once per ``t`` (a few ranks per pass,
    at most ~2**21 runs at once); their slot ranges, moved to ``t * C * L + slot``, form one
    union measured at every ``(t * C + o) * L``.
    """
    c, n = world, local_len
    lo, hi = [np.zeros(0, dtype=np.int64)], [np.zeros(0, dtype=np.int64)]
    for keys, seen, shift in parts:
        step = max(1, (1 << 21) // max(keys.n.size, 1))
        for t0 in range(0, c, step):
            ts = np.arange(t0, min(c, t0 + step), dtype=np.int64)
            to = ts.repeat(keys.n.size)
            rep = _tiled(np.arange(keys.n.size), ts.size)
            remote = keys.rank[rep] != to
            to, rep = to[remote], rep[remote]
            s0, s1, run = seen.covered_spans(keys.take(rep), shift(to, rep))
            base = to[run] * (c * n)
            lo.append(base + s0)
            hi.append(base + s1)
    measured = Union(np.concatenate(lo), np.concatenate(hi)).measure_below(
        np.arange(c * c + 1, dtype=np.int64) * n
    )
    out: _I64 = (measured[1:] - measured[:-1]).reshape(c, c)
    return out


def wanted_slots(
    parts: Iterable[tuple[StreamRuns, Union, Callable[[_I64, _I64], _I64]]],
    rank: int,
    world: int,
    local_len: int,
) -> list[_I64]:
    """Per rank ``t``: the sorted local slots of ``rank`` some query of ``t`` sees in any part
    (none for ``rank`` itself): what ``rank`` sends to ``t``.

    Parts as in :func:`remote_slot_matrix`. Each part's runs of ``rank`` are tiled once per peer
    ``t`` and found in ``t``'s block; their slot ranges, moved to ``t * L + local slot``, form one
    union cut at every ``t * L``.
    """
    c, n = world, local_len
    peers = np.arange(c, dtype=np.int64)
    peers = peers[peers != rank]
    lo, hi = [np.zeros(0, dtype=np.int64)], [np.zeros(0, dtype=np.int64)]
    for keys, seen, shift in parts:
        own = (keys.rank == rank).nonzero()[0]
        rep = _tiled(own, peers.size)
        to = peers.repeat(own.size)
        s0, s1, run = seen.covered_spans(keys.take(rep), shift(to, rep))
        base = (to[run] - rank) * n  # rank's block moved to t's lane
        lo.append(base + s0)
        hi.append(base + s1)
    lanes = Union(np.concatenate(lo), np.concatenate(hi)).members()
    cuts = lanes.searchsorted(np.arange(c + 1) * n).tolist()
    return [lanes[cuts[t] : cuts[t + 1]] - t * n for t in range(c)]


def _tiled(x: _I64, times: int) -> _I64:
    """``np.tile(x, times)`` of a 1-D ``x`` (one repeat of a row: no per-call dispatch of
    ``np.tile``, which costs more than the copy for the few runs of a batch)."""
    out: _I64 = x[None].repeat(times, axis=0).reshape(-1)
    return out


def _stable_order(x: _I64) -> _I64:
    """``np.argsort(x, kind="stable")``; for values in ``[0, 2**32)`` by two stable passes over
    16-bit digits (numpy sorts 16-bit keys by counting, in linear time)."""
    if x.size < 1024 or int(x.min()) < 0 or int(x.max()) >= 1 << 32:
        out: _I64 = np.argsort(x, kind="stable")
        return out
    if int(x.max()) < 1 << 16:
        small: _I64 = np.argsort(x.astype(np.uint16), kind="stable")
        return small
    low = np.argsort((x & 0xFFFF).astype(np.uint16), kind="stable")
    high = np.argsort((x[low] >> 16).astype(np.uint16), kind="stable")
    order: _I64 = low[high]
    return order


def _group_prefix(n: _I64, head: npt.NDArray[np.bool_]) -> tuple[_I64, _I64]:
    """``(before, total)``: per element, the sum of ``n`` over the earlier elements of its group
    (groups start where ``head`` holds, ``head[0]`` true) and its group's whole sum."""
    incl = np.cumsum(n)
    excl = incl - n
    gid = np.cumsum(head) - 1
    first = np.flatnonzero(head)
    last = np.append(first[1:], n.size) - 1
    before: _I64 = excl - excl[first][gid]
    total: _I64 = (incl[last] - excl[first])[gid]
    return before, total


def _tiling(real: StreamRuns, ordered: StreamRuns, order: _I64) -> Tiling | None:
    """:meth:`RankRuns.tiling` from the real runs (stream order) and the same runs sorted by code
    (``ordered = real.take(order)``)."""
    code, n, rank = real.code, real.n, real.rank
    if not n.size:  # no real token: nothing to tile (the searches answer an all-pad stream)
        return None
    same_rank = rank[1:] == rank[:-1]
    if not bool(((code[1:] >= code[:-1] + n[:-1]) | ~same_rank).all()):
        return None  # a rank's runs out of code order, or overlapping
    s_code, s_n = ordered.code, ordered.n
    if not bool((s_code[1:] >= s_code[:-1] + s_n[:-1]).all()):
        return None  # two real tokens share a (document, position)
    head = np.ones(s_n.size, dtype=bool)
    head[1:] = ordered.doc[1:] != ordered.doc[:-1]
    before, doc_total = _group_prefix(s_n, head)
    own_head = np.ones(n.size, dtype=bool)
    own_head[1:] = ~same_rank | (real.doc[1:] != real.doc[:-1])
    last = np.empty(n.size, dtype=bool)  # the last run of its (rank, document), stream order
    last[:-1] = own_head[1:]
    last[-1] = True
    return Tiling(order, ordered, head, before, doc_total, last[order], own_head)


def _tiled_sums(real: StreamRuns, tiling: Tiling, world: int, causal: bool) -> TiledSums:
    """:meth:`RankRuns.tiled_sums`.

    A query ``q`` of run ``i`` sees ``before(i) + (q - code(i)) + 1`` keys (causal; all of its
    document's keys otherwise). A rank's queries of one document see the codes up to the end
    of its last run there (causal), which holds every key of the document's runs up to that
    one: rank ``t`` receives those minus its own, and a key run is seen whole by every rank
    whose last run of the document is at or after it (by none of the others).
    """
    c = world
    n, rank = real.n, real.rank
    s_n, s_rank = tiling.ordered.n, tiling.ordered.rank
    before, doc_total, s_last = tiling.before, tiling.doc_total, tiling.last
    own_before, own_total = _group_prefix(n, tiling.own_head)
    mine = per_rank(rank, n, c)
    marks, in_doc = tiling.marks()
    if causal:
        pairs = per_rank(s_rank, s_n * before + s_n * (s_n + 1) // 2, c)
        local = per_rank(rank, n * own_before + n * (n + 1) // 2, c)
        seen = before + s_n  # keys of the document up to the end of each run
        after = in_doc - marks  # ranks whose last run of the document is at or after each run
    else:
        pairs = per_rank(s_rank, s_n * doc_total, c)
        local = per_rank(rank, n * own_total, c)
        seen, after = doc_total, in_doc
    recv = per_rank(s_rank[s_last], seen[s_last], c) - mine
    send = per_rank(s_rank, s_n * after, c) - mine
    return TiledSums(pairs, local, recv, send)


def _joined(runs: StreamRuns) -> tuple[_I64, _I64]:
    """``(lo, hi)``: the code intervals of ``runs`` (sorted by code), each chain of intervals that
    touch in this order (``lo[i + 1] == hi[i]``) joined into one; overlaps are kept apart, so
    the multiset of codes is the same."""
    lo, hi = runs.code, runs.code + runs.n
    if lo.size < 2:
        return lo, hi
    head = np.ones(lo.size, dtype=bool)
    head[1:] = lo[1:] != hi[:-1]
    first = np.flatnonzero(head)
    last = np.append(first[1:], lo.size) - 1
    return lo[first], hi[last]


def _aranges(a: _I64, b: _I64) -> _I64:
    """Concatenation of ``arange(a[i], b[i])`` over ``i`` (empty ranges skipped):
    :func:`~cpshard.layouts.index.arange_runs` of the ranges' lengths."""
    return arange_runs(a, np.maximum(b - a, 0), 1)
