"""Pair query runs with key runs and cut their visible pairs into kernel calls (host, numpy).

A *run* is a maximal stretch of slots of one document with consecutive positions, contiguous in
the tensor. A stretch of padding (slots whose document id is ``-1 - position``: every pad sees
only itself) is one run too, of the *pad class*, whatever its length.

Pairing is by sorted intervals, never all against all: the key runs are sorted by (class, first
position) and every query run finds its key runs with two binary searches (:func:`pair_runs`):
the key runs of its document that start before it ends (causal) and end inside its window; a
pad run finds the pad runs whose positions overlap its own. Every pair is then cut, vectorized,
into *pieces* whose pairs are all visible:

* ``FULL``: every key at or before every query (and inside the window) -> kernel without a mask;
* ``CAUSAL``: the same positions on both sides -> the kernel's own ``is_causal``;
* ``EDGE``: a bounded piece on the border of a sliding window (at most :data:`TILE` square);
* ``IDENT``: a stretch of padding against itself (the diagonal; at most :data:`PAD_TILE` long).

Small pieces (at most :data:`SMALL_PAIRS` pairs), window borders and pad diagonals that lie in the
same aligned :data:`TILE` x :data:`TILE` cell of (query slot, key slot) are grouped into one
*masked tile* whose bool mask is the union of their patterns; a piece alone in its cell keeps its
kernel call (a mask only where its pattern needs one: the pad diagonal shares one identity).
The host work is a few sorts and searches over the runs plus one Python step per kernel call.

Import rules: the rows of ``RULES`` in tests/unit/test_architecture.py that cover this module.
"""

from __future__ import annotations

import contextlib
import gc
import itertools
from collections.abc import Iterator
from typing import Any, NamedTuple

import numpy as np
import numpy.typing as npt
import torch

__all__ = [
    "PAD_TILE",
    "SMALL_PAIRS",
    "TILE",
    "Pieces",
    "RunTable",
    "Task",
    "cut_pairs",
    "join_runs",
    "pair_runs",
    "run_table",
    "tasks_by_key",
    "tasks_of",
]

TILE = 64
"""Largest extent (query and key slots) of a grouped masked tile and of a window-border piece."""

SMALL_PAIRS = 32 * 32
"""Pieces with at most this many query-key pairs are grouped into masked tiles."""

PAD_TILE = 256
"""Longest pad diagonal of one kernel call (its identity mask costs ``PAD_TILE`` pairs per pad:
long pad stretches take few calls, at a small extra cost)."""

FULL, CAUSAL, EDGE, IDENT = 0, 1, 2, 3

PAD_CLASS = np.iinfo(np.int64).min
"""The class of pad runs (no document id can be this value after :func:`run_table`)."""

_I64 = npt.NDArray[np.int64]


class Task(NamedTuple):
    """One kernel call: query slots ``[q0, q1)`` against key slots ``[k0, k1)``.

    Attributes:
        q0, q1: Query slice of the query tensor.
        k0, k1: Key slice of the key tensor.
        causal: Run the kernel with ``is_causal=True`` (``q1 - q0 == k1 - k0``).
        mask: Bool ``[1, q1 - q0, k1 - k0]`` (``True`` = visible) for a masked tile, else ``None``.
        first: No earlier task of the same pair writes any of these query rows (assign, not merge).
    """

    q0: int
    q1: int
    k0: int
    k1: int
    causal: bool
    mask: torch.Tensor | None
    first: bool


class RunTable(NamedTuple):
    """The runs of one slot set, as columns: run ``i`` is slots ``[start[i], start[i] + n[i])``
    with positions ``[pos[i], pos[i] + n[i])`` in class ``cls[i]`` (document id, or
    :data:`PAD_CLASS`) of row group ``grp[i]`` (runs of different groups never meet)."""

    start: _I64
    n: _I64
    pos: _I64
    cls: _I64
    grp: _I64


class Pieces(NamedTuple):
    """Visible pieces as columns (slot starts, position starts, extents, kind)."""

    qi: _I64
    qp: _I64
    nq: _I64
    ki: _I64
    kp: _I64
    nk: _I64
    kind: _I64

    @staticmethod
    def empty() -> Pieces:
        z = np.zeros(0, dtype=np.int64)
        return Pieces(z, z, z, z, z, z, z)

    def take(self, sel: npt.NDArray[np.bool_] | _I64) -> Pieces:
        return Pieces(*(c[sel] for c in self))

    @staticmethod
    def concat(parts: list[Pieces]) -> Pieces:
        parts = [p for p in parts if p.qi.size]
        if not parts:
            return Pieces.empty()
        return Pieces(*(np.concatenate(cols) for cols in zip(*parts, strict=True)))


def run_table(pos: _I64, doc: _I64, merge_pads: bool, breaks: int = 0) -> RunTable:
    """The runs of one slot set per row group.

    Args:
        pos: ``[G, N]`` positions, one row per row group (the slots are numbered row-major:
            slot ``g * N + i``).
        doc: ``[G, N]`` document ids.
        merge_pads: Slots with ``doc == -1 - pos`` form pad runs (class :data:`PAD_CLASS`) instead
            of one one-token document each (only valid when every negative id is such a pad).
        breaks: Also end runs at every multiple of ``breaks`` slots (the rank blocks of the
            stream; a divisor of ``N``), or ``0``.
    """
    n = pos.shape[1]
    flat_pos, flat_doc = pos.reshape(-1), doc.reshape(-1)
    if flat_pos.size == 0:
        z = np.zeros(0, dtype=np.int64)
        return RunTable(z, z, z, z, z)
    cls = flat_doc
    if merge_pads:
        cls = np.where(flat_doc == -1 - flat_pos, PAD_CLASS, flat_doc)
    brk = np.empty(flat_pos.size, dtype=bool)
    brk[0] = True
    np.not_equal(flat_pos[1:], flat_pos[:-1] + 1, out=brk[1:])
    brk[1:] |= cls[1:] != cls[:-1]
    brk[:: breaks if breaks else n] = True
    if breaks:
        brk[::n] = True
    starts = np.flatnonzero(brk)
    lens = np.diff(np.append(starts, flat_pos.size))
    return RunTable(starts, lens, flat_pos[starts], cls[starts], starts // n)


def join_runs(table: RunTable, width: int, cut: int = 0) -> RunTable:
    """``table`` with every two neighbouring runs joined where the second continues the first
    (same row group and class, next slot, next position) and their border is not a multiple of
    ``cut`` slots (``0``: no cuts): the runs :func:`~cpshard.attention.pieces.run_table` finds
    for the same slots (with ``breaks=cut``), given runs that cut them finer.

    Args:
        table: Runs sorted by slot; slot ``g * width + i`` is slot ``i`` of row group ``g``.
        width: Slots per row group.
        cut: Keep the borders at multiples of ``cut`` slots of a row group.
    """
    if table.start.size < 2:
        return table
    end = table.start + table.n
    go_on = table.grp[1:] == table.grp[:-1]
    go_on &= table.start[1:] == end[:-1]
    go_on &= table.pos[1:] == table.pos[:-1] + table.n[:-1]
    go_on &= table.cls[1:] == table.cls[:-1]
    if cut:
        go_on &= (table.start[1:] - table.grp[1:] * width) % cut != 0
    if not go_on.any():
        return table
    head = np.ones(table.start.size, dtype=bool)
    head[1:] = ~go_on
    first = np.flatnonzero(head)
    n = np.add.reduceat(table.n, first)
    return RunTable(table.start[first], n, table.pos[first], table.cls[first], table.grp[first])


def pair_runs(q: RunTable, k: RunTable, causal: bool, window: int | None) -> tuple[_I64, _I64]:
    """Index pairs ``(query run, key run)`` with at least one visible pair, by sorted intervals.

    Same class and, for causal attention, a key at or before a query (inside the window); pad runs
    meet pad runs whose positions overlap (a pad sees only itself), causal or not.

    Returns:
        ``(qi, ki)`` int64 arrays of run indices (``ki`` into ``k`` as given).
    """
    if not q.n.size or not k.n.size:
        z = np.zeros(0, dtype=np.int64)
        return z, z
    groups = int(max(q.grp.max(), k.grp.max())) + 1
    inv = _class_ids(np.concatenate([q.cls, k.cls])) * groups
    qc, kc_all = inv[: q.cls.size] + q.grp, inv[q.cls.size :] + k.grp
    order = np.lexsort((k.pos, kc_all))
    kcr = kc_all[order]
    a, b = q.pos, q.pos + q.n
    kp = k.pos[order]
    kend = kp + k.n[order]
    # a causal window's first visible position per query run (comparisons use only these
    # values and a, b, kp, kend)
    wa = a - window + 1 if window is not None and causal else None
    w = 0 if window is None else window
    lo = int(min(q.pos.min(), kp.min())) - w - 2
    hi = int(max(b.max(), kend.max())) + 2
    span = hi - lo + 1
    if (int(inv.max()) + groups) * span >= 1 << 62:  # (class, position) keys would overflow
        a, b, kp, kend, wa = _ranked(a, b, kp, kend, wa)  # same order, small values
        lo, hi = -2, int(max(b.max(), kend.max())) + 2
        span = hi - lo + 1
    key_start = kcr * span + (kp - lo)
    key_end = kcr * span + (kend - lo)
    ends_sorted = bool((key_end[1:] >= key_end[:-1]).all())
    pad = q.cls == PAD_CLASS
    base = qc * span
    # upper bound on a key run's first position: it starts before the query run ends
    upper = np.where(pad | causal, b - lo, span)
    hi_idx = key_start.searchsorted(base + upper, side="left")
    # lower bound on a key run's end: a key inside the window / overlapping the pad run
    lower = np.full(a.shape, -1, dtype=np.int64)
    if wa is not None:
        lower = wa - lo
    lower = np.where(pad, a - lo, lower)
    if ends_sorted:
        lo_idx = key_end.searchsorted(base + np.maximum(lower, 0), side="right")
    else:  # overlapping key runs of one class: take the class block, filter exactly below
        lo_idx = key_start.searchsorted(base, side="left")
    counts = np.maximum(hi_idx - lo_idx, 0)
    total = int(counts.sum())
    qi = np.arange(q.n.size, dtype=np.int64).repeat(counts)
    offs = counts.cumsum() - counts
    ki = lo_idx[qi] + (np.arange(total, dtype=np.int64) - offs[qi])
    keep = kcr[ki] == qc[qi]
    keep &= (kp[ki] < b[qi]) | ~(pad[qi] | causal)
    keep &= np.where(pad[qi], kend[ki] > a[qi], kend[ki] - lo > lower[qi])
    qi, ki = qi[keep], ki[keep]
    return qi, order[ki]


def _ranked(*values: _I64 | None) -> tuple[Any, ...]:
    """Each array replaced by the ranks of its values among all the arrays' values (``None``
    kept): every ``<``, ``<=`` and ``==`` between them holds as before, in values below the
    number of distinct values."""
    given = [v for v in values if v is not None]
    u = np.unique(np.concatenate(given))
    return tuple(None if v is None else np.searchsorted(u, v) for v in values)


def _class_ids(cls: _I64) -> _I64:
    """Small non-negative ids of the classes, in their order (:data:`PAD_CLASS` lowest): the
    offset from the lowest document id where the ids lie in a range of at most ``8 * N + 4096``
    (one pass; every built-in layout's ids), else the rank among the distinct classes (a
    sort)."""
    real = cls != PAD_CLASS
    if real.any():
        ids = cls[real]
        lo, hi = int(ids.min()), int(ids.max())
        if hi - lo <= 8 * cls.size + 4096:
            out: _I64 = np.where(real, cls - (lo - 1), 0)
            return out
    _, inv = np.unique(cls, return_inverse=True)
    ranked: _I64 = inv.reshape(-1).astype(np.int64)
    return ranked


def _emit(out: list[tuple[int, ...]], qi: int, qp: int, ki: int, kp: int, qa: int, qb: int,
          ka: int, kb: int, kind: int) -> None:  # fmt: skip
    out.append((qi + qa - qp, qa, qb - qa, ki + ka - kp, ka, kb - ka, kind))


def _full(out: list[tuple[int, ...]], base: tuple[int, int, int, int], w: int, qa: int, qb: int,
          ka: int, kb: int) -> None:  # fmt: skip
    """Positions with every key ``<=`` every query, clipped by the window ``w`` (recursive)."""
    if (qb - 1) - ka < w:
        _emit(out, *base, qa, qb, ka, kb, FULL)
    elif qa - (kb - 1) >= w:
        return
    elif qb - qa <= TILE and kb - ka <= TILE:
        _emit(out, *base, qa, qb, ka, kb, EDGE)
    elif qb - qa >= kb - ka:
        m = (qa + qb) // 2
        _full(out, base, w, qa, m, ka, kb)
        _full(out, base, w, m, qb, ka, kb)
    else:
        m = (ka + kb) // 2
        _full(out, base, w, qa, qb, ka, m)
        _full(out, base, w, qa, qb, m, kb)


def _diag(out: list[tuple[int, ...]], base: tuple[int, int, int, int], w: int, a: int,
          b: int) -> None:  # fmt: skip
    """The causal square of positions ``[a, b)``, clipped by the window ``w`` (recursive)."""
    if (b - 1) - a < w:
        _emit(out, *base, a, b, a, b, CAUSAL)
    elif b - a <= TILE:
        _emit(out, *base, a, b, a, b, EDGE)
    else:
        m = (a + b) // 2
        _diag(out, base, w, a, m)
        _diag(out, base, w, m, b)
        _full(out, base, w, m, b, a, m)


def _rects(
    qs: _I64, qp: _I64, ks: _I64, kp: _I64,
    parts: list[tuple[npt.NDArray[np.bool_], _I64, _I64, _I64, _I64, int]],
) -> Pieces:  # fmt: skip
    """The pieces of several parts ``(sel, qa, qb, ka, kb, kind)`` of the run pairs (slot and
    position starts ``qs, qp, ks, kp``): positions ``[qa, qb) x [ka, kb)`` of each pair where
    ``sel`` holds, of kind ``kind``; part after part, each in pair order (every part's columns
    gathered at once)."""
    size = max(qs.size, 1)
    at = np.concatenate([part[0] for part in parts]).nonzero()[0]
    j = at % size  # the pair of each piece
    qa, qb, ka, kb = (np.concatenate([part[i] for part in parts])[at] for i in range(1, 5))
    kind = np.array([part[5] for part in parts], dtype=np.int64)[at // size]
    return Pieces(qs[j] + qa - qp[j], qa, qb - qa, ks[j] + ka - kp[j], ka, kb - ka, kind)


def _clip_window(p: Pieces, window: int) -> Pieces:
    """Window-clip FULL and CAUSAL pieces: inside -> kept, outside -> dropped, straddling ->
    cut recursively into pieces inside the window and bounded ``EDGE`` pieces."""
    a, b, c, d = p.qp, p.qp + p.nq, p.kp, p.kp + p.nk
    full = p.kind == FULL
    inside = np.where(full, (b - 1) - c < window, (b - 1) - a < window)
    outside = full & (a - (d - 1) >= window)
    keep = p.take(inside)
    cut = np.flatnonzero(~inside & ~outside)
    out: list[tuple[int, ...]] = []
    for j in cut.tolist():
        base = (int(p.qi[j]), int(p.qp[j]), int(p.ki[j]), int(p.kp[j]))
        qa, qb = int(a[j]), int(b[j])
        if full[j]:
            _full(out, base, window, qa, qb, int(c[j]), int(d[j]))
        else:
            _diag(out, base, window, qa, qb)
    if not out:
        return keep
    arr = np.array(out, dtype=np.int64).reshape(-1, 7)
    return Pieces.concat([keep, Pieces(*(arr[:, i].copy() for i in range(7)))])


def cut_pairs(
    q: RunTable, k: RunTable, qi: _I64, ki: _I64, causal: bool, window: int | None
) -> Pieces:
    """Cut the run pairs ``(q[qi], k[ki])`` of :func:`pair_runs` into visible pieces."""
    qs, qp, qn = q.start[qi], q.pos[qi], q.n[qi]
    ks, kp, kn = k.start[ki], k.pos[ki], k.n[ki]
    a, b, c, d = qp, qp + qn, kp, kp + kn
    pad = q.cls[qi] == PAD_CLASS
    reg = ~pad
    lo, hi = np.maximum(a, c), np.minimum(b, d)
    # a pad stretch against itself: the diagonal of the shared positions
    parts = [(pad & (hi > lo), lo, hi, lo, hi, IDENT)]
    if not causal:
        parts.append((reg, a, b, c, d, FULL))
        return _rects(qs, qp, ks, kp, parts)
    m, after = np.minimum(d, a), np.maximum(d, a)
    parts += [
        (reg & (m > c), a, b, c, m, FULL),  # keys before every query
        (reg & (hi > lo), lo, hi, lo, hi, CAUSAL),  # the shared positions: a causal square
        # queries after every key of the overlap's columns
        (reg & (b > after) & (d > lo), after, b, lo, d, FULL),
    ]
    pieces = _rects(qs, qp, ks, kp, parts)
    if window is None:
        return pieces
    ident = pieces.kind == IDENT
    return Pieces.concat([pieces.take(ident), _clip_window(pieces.take(~ident), window)])


def _split_ident(p: Pieces, keys: _I64) -> tuple[Pieces, _I64]:
    """Cut pad diagonals longer than :data:`PAD_TILE` into diagonals of at most that: the other
    pieces in their order, then the cut ones (each diagonal's parts in order); and the key of
    each piece (a cut diagonal's parts keep its key)."""
    long = (p.kind == IDENT) & (p.nq > PAD_TILE)
    if not long.any():
        return p, keys
    keep, cut = (~long).nonzero()[0], long.nonzero()[0]
    parts = (p.nq[cut] + PAD_TILE - 1) // PAD_TILE
    idx = cut.repeat(parts)
    off = (np.arange(idx.size) - (parts.cumsum() - parts).repeat(parts)) * PAD_TILE
    j = np.concatenate([keep, idx])  # the piece each output piece comes from
    shift = np.zeros(j.size, dtype=np.int64)
    shift[keep.size :] = off
    n = p.nq[j]
    n[keep.size :] = np.minimum(n[keep.size :] - off, PAD_TILE)
    nk = p.nk[j]
    nk[keep.size :] = n[keep.size :]  # a pad diagonal is square
    out = Pieces(p.qi[j] + shift, p.qp[j] + shift, n, p.ki[j] + shift, p.kp[j] + shift, nk,
                 p.kind[j])  # fmt: skip
    return out, keys[j]


def _row_spans(p: Pieces, idx: _I64, window: int | None) -> tuple[_I64, _I64, _I64, _I64]:
    """The visible key columns of every query row of the pieces ``idx``, as intervals.

    Every piece's pattern is one interval of key columns per query row: ``FULL`` all ``nk``,
    ``IDENT`` the diagonal, ``CAUSAL`` / ``EDGE`` the keys at or before the row's position (and
    inside the window). Returns ``(member, row, lo, hi)``: per query row, the index into ``idx``
    of its piece, the row within the piece and the columns ``[lo, hi)`` (``hi <= lo``: none).
    """
    nq = p.nq[idx]
    member = np.repeat(np.arange(idx.size, dtype=np.int64), nq)
    row = np.arange(member.size, dtype=np.int64) - np.repeat(np.cumsum(nq) - nq, nq)
    j = idx[member]
    kind, nk = p.kind[j], p.nk[j]
    last = p.qp[j] - p.kp[j] + row  # the key column at the row's own position
    lo = np.zeros(row.size, dtype=np.int64)
    if window is not None:
        lo = np.maximum(last - window + 1, 0)
    hi = np.minimum(last + 1, nk)
    full, ident = kind == FULL, kind == IDENT
    lo = np.where(full, 0, np.where(ident, row, lo))
    hi = np.where(full, nk, np.where(ident, np.minimum(row + 1, nk), hi))
    return member, row, lo, hi


def _pairs(p: Pieces, window: int | None) -> _I64:
    """Visible pairs of every piece (closed forms; EDGE pieces are at most TILE square)."""
    out = np.where(
        p.kind == FULL, p.nq * p.nk, np.where(p.kind == CAUSAL, p.nq * (p.nq + 1) // 2, p.nq)
    )
    edge = np.flatnonzero(p.kind == EDGE)
    if edge.size:
        member, _, lo, hi = _row_spans(p, edge, window)
        out[edge] = np.bincount(member, weights=np.maximum(hi - lo, 0), minlength=edge.size)
    return out


def _word(a: _I64, b: _I64) -> npt.NDArray[np.uint64]:
    """``uint64`` words with bits ``[a, b)`` set (``0 <= a <= b <= 64``)."""
    au, bu = a.astype(np.uint64), b.astype(np.uint64)
    one, ones = np.uint64(1), np.uint64(0xFFFFFFFFFFFFFFFF)
    upper = np.where(bu >= TILE, ones, np.left_shift(one, np.minimum(bu, TILE - 1)) - one)
    out: npt.NDArray[np.uint64] = upper & ~(np.left_shift(one, au) - one)
    return out


def _masks(
    p: Pieces, idx: _I64, slot: _I64, r0: _I64, c0: _I64, shape: tuple[_I64, _I64],
    window: int | None, device: torch.device,
) -> tuple[list[torch.Tensor], _I64]:  # fmt: skip
    """Bool masks ``[1, h[m], w[m]]`` (``shape = (h, w)``): mask ``slot[i]`` holds piece
    ``idx[i]``'s pattern at row ``r0[i]``, column ``c0[i]`` (the union where several pieces
    share a mask). Returns ``(views, of)``: ``views[j]`` is mask ``of[j]`` (the masks in their
    layout order, so the caller places them with one permutation of its own).

    Vectorized over the pieces' rows: a mask row is at most :data:`TILE` = 64 columns, so each
    row of each mask is one ``uint64`` word, the OR of its pieces' column intervals; the words
    are unpacked into one flat host buffer (masks laid out by width, each contiguous), moved to
    ``device`` in one transfer, and each width's masks are views of it from one ``split``.
    """
    h, w = shape
    order = np.lexsort((h, w))  # masks of one width are consecutive lines
    rank = np.empty(order.size, dtype=np.int64)
    rank[order] = np.arange(order.size)
    hs, ws = h[order], w[order]
    line0 = np.cumsum(hs) - hs  # first line of each mask, in layout order
    n_lines = int(hs.sum())
    first = line0[rank[slot]] + r0  # the line of each piece's first row
    # a FULL piece has one interval for all its rows: its word is made once and repeated
    full = p.kind[idx] == FULL
    fi = np.flatnonzero(full & (p.nk[idx] > 0))
    nq = p.nq[idx[fi]]
    offset = np.arange(int(nq.sum()), dtype=np.int64) - np.repeat(np.cumsum(nq) - nq, nq)
    lines = [np.repeat(first[fi], nq) + offset]
    bits = [np.repeat(_word(c0[fi], c0[fi] + p.nk[idx[fi]]), nq)]
    oi = np.flatnonzero(~full)
    member, row, lo, hi = _row_spans(p, idx[oi], window)
    keep = hi > lo
    m = oi[member[keep]]
    lines.append(first[m] + row[keep])
    bits.append(_word(c0[m] + lo[keep], c0[m] + hi[keep]))
    line, bits_all = np.concatenate(lines), np.concatenate(bits)
    words = np.zeros(n_lines, dtype="<u8")
    np.bitwise_or.at(words, line, bits_all)
    # masks of one width are one block of lines: unpack each block's ``width`` bits per line
    # into one contiguous host buffer, then each width's masks are views of it from one split
    flat = np.empty(int((hs * ws).sum()), dtype=bool)
    as_bytes = words.view(np.uint8).reshape(-1, 8)
    mask_cut = np.flatnonzero(np.diff(ws)) + 1
    groups = np.concatenate([[0], mask_cut, [h.size]]).tolist()
    line_at = np.append(line0, n_lines)[groups].tolist()
    h_of, w_of = hs.tolist(), ws.tolist()
    at = 0
    blocks = []
    for (s, e), (l0, l1) in zip(
        itertools.pairwise(groups), itertools.pairwise(line_at), strict=True
    ):
        width = w_of[s]
        unpacked = np.unpackbits(as_bytes[l0:l1, : (width + 7) // 8], axis=1, count=width,
                                 bitorder="little")  # fmt: skip
        flat[at : at + (l1 - l0) * width] = unpacked.reshape(-1).view(bool)
        blocks.append((at, l1 - l0, width, s, e))
        at += (l1 - l0) * width
    big = torch.from_numpy(flat).to(device)
    views: list[torch.Tensor] = []
    for at, rows, width, s, e in blocks:
        block = big[at : at + rows * width].view(1, rows, width)
        views.extend(block.split_with_sizes(h_of[s:e], dim=1))
    return views, order


KeyedTasks = list[tuple[tuple[Task, ...], int, int]]


def tasks_of(
    pieces: Pieces, window: int | None, device: torch.device
) -> tuple[tuple[Task, ...], int, int]:
    """Kernel calls for the pieces of one pair: ``(tasks, computed pairs, needed pairs)``."""
    return tasks_by_key(pieces, np.zeros(pieces.qi.size, dtype=np.int64), 1, window, device)[0]


def tasks_by_key(
    pieces: Pieces, keys: _I64, n_keys: int, window: int | None, device: torch.device
) -> KeyedTasks:
    """Kernel calls of several pairs at once: ``(tasks, computed, needed)`` per key.

    ``keys[i]`` in ``[0, n_keys)`` names the pair of piece ``i`` (a row group, a ring block);
    slots are those of that pair's tensors. Large FULL / CAUSAL pieces are direct calls; the
    small ones, window borders and pad diagonals of one aligned :data:`TILE` cell of one pair
    become one masked tile (a lone small FULL / CAUSAL piece stays a direct call; a lone pad
    diagonal shares one identity mask). Every mask is made in one host buffer, vectorized over
    the pieces (:func:`_masks`), and moved to ``device`` in one transfer; tasks hold views
    of it. No Python step per piece or tile, one per kernel call (its :class:`Task`).

    Python's cyclic garbage collector is paused while the tasks are made (:func:`_gc_paused`).
    """
    with _gc_paused():
        return _tasks_by_key(pieces, keys, n_keys, window, device)


@contextlib.contextmanager
def _gc_paused() -> Iterator[None]:
    """Pause the cyclic garbage collector for a block that makes many objects without cycles.

    A plan makes tens of thousands of tasks and mask views at once; each allocation counts
    towards the collector's thresholds, so building one triggers dozens of young-generation
    passes and, every few plans, a pass over the whole heap (half of the build time measured on
    a 1M-token plan), none of which can free anything here. Only the collector's schedule
    changes (the counts carry over; nothing is left uncollected); restored on exit, also on an
    error, and left alone if it was off.
    """
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def _tasks_by_key(
    pieces: Pieces, keys: _I64, n_keys: int, window: int | None, device: torch.device
) -> KeyedTasks:
    p, keys = _split_ident(pieces, keys)
    out: KeyedTasks = [((), 0, 0)] * n_keys
    if not p.qi.size:
        return out
    needed_k = np.bincount(keys, weights=_pairs(p, window), minlength=n_keys)
    small = (p.kind >= EDGE) | (p.nq * p.nk <= SMALL_PAIRS)
    cq, ck = p.qi // TILE, p.ki // TILE
    fits = small & ((p.qi + p.nq - 1) // TILE == cq) & ((p.ki + p.nk - 1) // TILE == ck)
    span_k = int(ck.max()) + 1
    span_q = int(cq.max()) + 1
    cell = np.where(fits, (keys * span_q + cq) * span_k + ck, -1)
    fit_idx = fits.nonzero()[0]
    # the pieces that fit a cell, sorted by (cell, index) once; a cell with several is a tile
    by_cell = fit_idx[cell[fit_idx].argsort(kind="stable")]
    sorted_cells = cell[by_cell]
    new_cell = np.ones(by_cell.size, dtype=bool)
    new_cell[1:] = sorted_cells[1:] != sorted_cells[:-1]
    cell_id = new_cell.cumsum() - 1
    shared = np.bincount(cell_id)[cell_id] > 1 if by_cell.size else new_cell
    members, cells = by_cell[shared], sorted_cells[shared]  # by (cell, index)
    grouped = np.zeros(p.qi.size, dtype=bool)
    grouped[members] = True
    # direct calls: every piece that is not in a cell with others
    direct = (~grouped).nonzero()[0]
    q0s, k0s = p.qi[direct], p.ki[direct]
    q1s, k1s = q0s + p.nq[direct], k0s + p.nk[direct]
    kinds, tkeys = p.kind[direct], keys[direct]
    dq, dk = p.nq[direct], p.nk[direct]
    computed_k = np.bincount(
        tkeys, weights=np.where(kinds == CAUSAL, dq * (dq + 1) // 2, dq * dk), minlength=n_keys
    ).astype(np.float64)  # empty input: bincount gives int64
    # masks: the direct window borders (their own pattern), then the masked tiles (the cells
    # holding several pieces; the union of their patterns)
    edge = (kinds == EDGE).nonzero()[0]
    n_tiles = 0
    m_idx, m_slot, m_r, m_c = [direct[edge]], [np.arange(edge.size)], [0 * edge], [0 * edge]
    m_h, m_w = [dq[edge]], [dk[edge]]
    if members.size:
        heads = np.append(0, np.flatnonzero(np.diff(cells)) + 1)
        n_tiles = heads.size
        tile = np.zeros(members.size, dtype=np.int64)
        tile[heads[1:]] = 1
        np.cumsum(tile, out=tile)  # the tile of every member
        g_q0 = np.minimum.reduceat(p.qi[members], heads)
        g_q1 = np.maximum.reduceat(p.qi[members] + p.nq[members], heads)
        g_k0 = np.minimum.reduceat(p.ki[members], heads)
        g_k1 = np.maximum.reduceat(p.ki[members] + p.nk[members], heads)
        t_keys = keys[members[heads]]
        computed_k += np.bincount(t_keys, weights=(g_q1 - g_q0) * (g_k1 - g_k0), minlength=n_keys)
        m_idx.append(members)
        m_slot.append(edge.size + tile)
        m_r.append(p.qi[members] - g_q0[tile])
        m_c.append(p.ki[members] - g_k0[tile])
        m_h.append(g_q1 - g_q0)
        m_w.append(g_k1 - g_k0)
        q0s, q1s = np.concatenate([q0s, g_q0]), np.concatenate([q1s, g_q1])
        k0s, k1s = np.concatenate([k0s, g_k0]), np.concatenate([k1s, g_k1])
        tkeys = np.concatenate([tkeys, t_keys])
        kinds = np.concatenate([kinds, np.full(n_tiles, -1, dtype=np.int64)])
    # every task's mask as an index into one pool: the masks, the pad identities, then None
    pool: list[torch.Tensor | None] = []
    of_task = np.full(q0s.size, -1, dtype=np.int64)
    n_masks = edge.size + n_tiles
    if n_masks:
        cat = np.concatenate
        where = (cat(m_idx), cat(m_slot), cat(m_r), cat(m_c))
        views, of_view = _masks(p, *where, (cat(m_h), cat(m_w)), window, device)
        at = np.concatenate([edge, direct.size + np.arange(n_tiles)])
        of_task[at[of_view]] = np.arange(len(views))
        pool.extend(views)
    ident = (kinds == IDENT).nonzero()[0]
    if ident.size:  # one identity per distinct size (IDENT pieces are square, <= PAD_TILE)
        eye = torch.eye(PAD_TILE, dtype=torch.bool, device=device)[None]
        size = q1s[ident] - q0s[ident]
        present = np.bincount(size, minlength=PAD_TILE + 1) > 0
        of_task[ident] = len(pool) + (present.cumsum() - 1)[size]
        pool.extend(eye if n == PAD_TILE else eye[:, :n, :n] for n in present.nonzero()[0].tolist())
    of_task[of_task < 0] = len(pool)
    pool.append(None)
    # order by (pair, q0, k0); a task is "first" when no earlier task of its pair wrote its rows
    order = np.lexsort((k0s, q0s, tkeys))
    shift = (int(q1s.max()) + 1) * tkeys[order]  # pairs never see each other's rows
    reach = np.maximum.accumulate(q1s[order] + shift)
    firsts = np.ones(order.size, dtype=bool)
    firsts[1:] = reach[:-1] <= (q0s[order] + shift)[1:]
    cuts = tkeys[order].searchsorted(np.arange(n_keys + 1)).tolist()
    columns = zip(
        q0s[order].tolist(), q1s[order].tolist(), k0s[order].tolist(), k1s[order].tolist(),
        (kinds[order] == CAUSAL).tolist(), map(pool.__getitem__, of_task[order].tolist()),
        firsts.tolist(), strict=True,
    )  # fmt: skip
    tasks: list[Task] = list(map(tuple.__new__, itertools.repeat(Task, order.size), columns))
    computed, needed = computed_k.tolist(), needed_k.tolist()
    return [
        (tuple(tasks[cuts[key] : cuts[key + 1]]), int(computed[key]), int(needed[key]))
        for key in range(n_keys)
    ]
