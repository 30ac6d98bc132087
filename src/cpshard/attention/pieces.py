"""Cut the visible pairs of (query run, key run) pairs into kernel calls (host side, numpy).

A *run* is a maximal stretch of slots of one document with consecutive positions, contiguous in
the tensor. Every (query run, key run) pair of one document is cut into *pieces* whose pairs are
all visible (``FULL``: every key at or before every query and inside the window; ``CAUSAL``: the
same positions on both sides, the kernel's ``is_causal``; ``EDGE``: a bounded piece on a sliding
window's border). Pieces with few pairs and window borders are grouped into masked tiles of at
most :data:`TILE` x :data:`TILE` slots whose mask is the union of their pieces' patterns.

Imports only torch and numpy; :mod:`cpshard.attention.plan` is its one user.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

__all__ = ["SMALL_PAIRS", "TILE", "Cutter", "Task", "runs", "tasks_of"]

TILE = 64
"""Largest extent (query and key slots) of a grouped masked tile and of a window-border piece."""

SMALL_PAIRS = 32 * 32
"""Pieces with at most this many query-key pairs are grouped into masked tiles."""

_FULL, _CAUSAL, _EDGE = 0, 1, 2

# piece: (q index start, q position start, nq, k index start, k position start, nk, kind)
_Piece = tuple[int, int, int, int, int, int, int]


@dataclass(frozen=True)
class Task:
    """One kernel call: query slots ``[q0, q1)`` against key slots ``[k0, k1)``.

    Attributes:
        q0, q1: Query slice of the query tensor.
        k0, k1: Key slice of the key tensor.
        causal: Run the kernel with ``is_causal=True`` (``q1 - q0 == k1 - k0``).
        mask: Bool ``[1, q1 - q0, k1 - k0]`` (``True`` = visible) for a grouped tile, else ``None``.
        first: No earlier task of the same pair writes any of these query rows (assign, not merge).
    """

    q0: int
    q1: int
    k0: int
    k1: int
    causal: bool
    mask: torch.Tensor | None
    first: bool


def runs(pos: np.ndarray, doc: np.ndarray) -> list[tuple[int, int, int, int]]:
    """Maximal runs ``(start, end, document, first position)`` of consecutive positions."""
    n = pos.shape[0]
    if n == 0:
        return []
    brk = np.ones(n, dtype=bool)
    brk[1:] = (pos[1:] != pos[:-1] + 1) | (doc[1:] != doc[:-1])
    starts = np.flatnonzero(brk)
    ends = np.append(starts[1:], n)
    return list(
        zip(starts.tolist(), ends.tolist(), doc[starts].tolist(), pos[starts].tolist(), strict=True)
    )


class Cutter:
    """Cuts one (query run, key run) pair of a document into visible pieces."""

    def __init__(self, causal: bool, window: int | None) -> None:
        self.causal = causal
        self.window = window
        self.pieces: list[_Piece] = []
        self._qi = self._qp = self._ki = self._kp = 0

    def pair(self, qi: int, qp: int, nq: int, ki: int, kp: int, nk: int) -> None:
        """Add the pieces of query slots ``qi..`` (positions ``qp..``) x key slots ``ki..``."""
        self._qi, self._qp, self._ki, self._kp = qi, qp, ki, kp
        a, b, c, d = qp, qp + nq, kp, kp + nk
        if not self.causal:
            self._emit(a, b, c, d, _FULL)
            return
        if min(d, a) > c:  # keys before every query
            self._full(a, b, c, min(d, a))
        lo, hi = max(a, c), min(b, d)
        if hi > lo:  # the shared positions: a causal square
            self._diag(lo, hi)
        if b > max(d, a) and d > lo:  # queries after every key of the overlap's columns
            self._full(max(d, a), b, lo, d)

    def _emit(self, qa: int, qb: int, ka: int, kb: int, kind: int) -> None:
        self.pieces.append(
            (self._qi + qa - self._qp, qa, qb - qa, self._ki + ka - self._kp, ka, kb - ka, kind)
        )

    def _full(self, qa: int, qb: int, ka: int, kb: int) -> None:
        """Positions with every key ``<=`` every query; clipped by the window."""
        w = self.window
        if w is None or (qb - 1) - ka < w:
            self._emit(qa, qb, ka, kb, _FULL)
        elif qa - (kb - 1) >= w:
            return
        elif qb - qa <= TILE and kb - ka <= TILE:
            self._emit(qa, qb, ka, kb, _EDGE)
        elif qb - qa >= kb - ka:
            m = (qa + qb) // 2
            self._full(qa, m, ka, kb)
            self._full(m, qb, ka, kb)
        else:
            m = (ka + kb) // 2
            self._full(qa, qb, ka, m)
            self._full(qa, qb, m, kb)

    def _diag(self, a: int, b: int) -> None:
        """The causal square of positions ``[a, b)``; clipped by the window."""
        w = self.window
        if w is None or (b - 1) - a < w:
            self._emit(a, b, a, b, _CAUSAL)
        elif b - a <= TILE:
            self._emit(a, b, a, b, _EDGE)
        else:
            m = (a + b) // 2
            self._diag(a, m)
            self._diag(m, b)
            self._full(m, b, a, m)


def _pattern(p: _Piece, causal: bool, window: int | None) -> np.ndarray:
    """Bool ``[nq, nk]`` visibility of one piece (one document, consecutive positions)."""
    _, qp, nq, _, kp, nk, _ = p
    diff = (qp + np.arange(nq))[:, None] - (kp + np.arange(nk))[None, :]
    vis = np.ones((nq, nk), dtype=bool)
    if causal:
        vis &= diff >= 0
    if window is not None:
        vis &= diff < window
    return vis


def _pairs_of(p: _Piece, causal: bool, window: int | None) -> int:
    _, _, nq, _, _, nk, kind = p
    if kind == _FULL:
        return nq * nk
    if kind == _CAUSAL:
        return nq * (nq + 1) // 2
    return int(_pattern(p, causal, window).sum())


def tasks_of(
    pieces: list[_Piece], causal: bool, window: int | None, device: torch.device
) -> tuple[tuple[Task, ...], int, int]:
    """Kernel calls for the pieces: big ones direct, small ones grouped into masked tiles."""
    needed = 0
    computed = 0
    raw: list[tuple[int, int, int, int, bool, np.ndarray | None]] = []
    small: list[_Piece] = []
    for p in pieces:
        qi, _, nq, ki, _, nk, kind = p
        needed += _pairs_of(p, causal, window)
        if kind != _EDGE and nq * nk > SMALL_PAIRS:
            raw.append((qi, qi + nq, ki, ki + nk, kind == _CAUSAL, None))
            computed += nq * (nq + 1) // 2 if kind == _CAUSAL else nq * nk
        else:
            small.append(p)
    small.sort(key=lambda p: (p[0], p[3]))
    tile: list[_Piece] = []
    bounds = (0, 0, 0, 0)

    def flush() -> None:
        nonlocal computed
        if not tile:
            return
        q0, q1, k0, k1 = bounds
        mask = np.zeros((q1 - q0, k1 - k0), dtype=bool)
        for p in tile:
            qi, _, nq, ki, _, nk, _ = p
            mask[qi - q0 : qi - q0 + nq, ki - k0 : ki - k0 + nk] |= _pattern(p, causal, window)
        computed += mask.size
        raw.append((q0, q1, k0, k1, False, mask))
        tile.clear()

    for p in small:
        qi, _, nq, ki, _, nk, _ = p
        if tile:
            q0, q1, k0, k1 = bounds
            nb = (min(q0, qi), max(q1, qi + nq), min(k0, ki), max(k1, ki + nk))
            if nb[1] - nb[0] <= TILE and nb[3] - nb[2] <= TILE:
                tile.append(p)
                bounds = nb
                continue
            flush()
        tile.append(p)
        bounds = (qi, qi + nq, ki, ki + nk)
    flush()
    raw.sort(key=lambda t: (t[0], t[2]))
    tasks = []
    # A task is "first" when no earlier task wrote any of its rows: it assigns instead of merging.
    written = np.zeros(max((t[1] for t in raw), default=0), dtype=bool)
    for q0, q1, k0, k1, is_causal, mask in raw:
        first = not bool(written[q0:q1].any())
        written[q0:q1] = True
        m = None if mask is None else torch.from_numpy(mask)[None].to(device)
        tasks.append(Task(q0, q1, k0, k1, is_causal, m, first))
    return tuple(tasks), computed, needed
