"""The vectorized cuts of :mod:`cpshard.attention.pieces` against straightforward per-pair loops,
piece for piece and in the same order (random runs: pads, several row groups, causal or not)."""

from __future__ import annotations

import numpy as np
import pytest

from cpshard.attention.pieces import (
    CAUSAL,
    FULL,
    IDENT,
    PAD_CLASS,
    PAD_TILE,
    Pieces,
    RunTable,
    _split_ident,
    cut_pairs,
    pair_runs,
    run_table,
)


def _runs(rng: np.random.Generator) -> tuple[RunTable, RunTable]:
    """Query and key runs of 1-3 random row groups: documents, pads by the convention (single
    ones and stretches longer than ``PAD_TILE``), shuffled blocks of positions (runs of one
    document meet in any order); the queries are a slice of the keys' slots."""
    groups, n = int(rng.integers(1, 4)), int(rng.integers(1, 1500))
    pos, doc = [], []
    for _ in range(groups):
        d = np.cumsum(rng.random(n) < 0.01).astype(np.int64)
        p = np.arange(n)
        pads = rng.random(n) < 0.2 * rng.random()
        pads[n - int(rng.integers(0, n // 2 + 1)) :] = True
        d[pads] = -1 - p[pads]
        cut = np.sort(rng.choice(n, size=min(n, 2), replace=False))
        blocks = np.split(np.arange(n), cut)
        order = np.concatenate([blocks[b] for b in rng.permutation(len(blocks))])
        pos.append(p[order])
        doc.append(d[order])
    p_all, d_all = np.stack(pos), np.stack(doc)
    a = int(rng.integers(0, n)) if rng.random() < 0.5 else 0  # else every slot
    b = int(rng.integers(a + 1, n + 1)) if a else n
    return run_table(p_all[:, a:b], d_all[:, a:b], True), run_table(p_all, d_all, True)


def _cut_by_loop(q: RunTable, k: RunTable, qi: np.ndarray, ki: np.ndarray, causal: bool) -> Pieces:
    """:func:`cut_pairs` without a window, pair by pair: the pad diagonals, then the keys before
    every query, the causal squares and the queries after the overlap (or every pair's
    rectangle, bidirectional), each part in pair order."""
    parts: list[list[tuple[int, ...]]] = [[], [], [], []]
    for i, j in zip(qi.tolist(), ki.tolist(), strict=True):
        qs, qp, ks, kp = int(q.start[i]), int(q.pos[i]), int(k.start[j]), int(k.pos[j])
        a, b, c, d = qp, qp + int(q.n[i]), kp, kp + int(k.n[j])
        lo, hi = max(a, c), min(b, d)

        def rect(part: int, qa: int, qb: int, ka: int, kb: int, kind: int, s: int = qs - qp,
                 t: int = ks - kp) -> None:  # fmt: skip
            parts[part].append((s + qa, qa, qb - qa, t + ka, ka, kb - ka, kind))

        if q.cls[i] == PAD_CLASS:
            if hi > lo:
                rect(0, lo, hi, lo, hi, IDENT)
        elif not causal:
            rect(1, a, b, c, d, FULL)
        else:
            if min(d, a) > c:
                rect(1, a, b, c, min(d, a), FULL)
            if hi > lo:
                rect(2, lo, hi, lo, hi, CAUSAL)
            if b > max(d, a) and d > lo:
                rect(3, max(d, a), b, lo, d, FULL)
    rows = [row for part in parts for row in part]
    cols = np.array(rows, dtype=np.int64).reshape(-1, 7)
    return Pieces(*(cols[:, c].copy() for c in range(7)))


def _split_by_loop(p: Pieces, keys: np.ndarray) -> tuple[Pieces, np.ndarray]:
    """:func:`_split_ident` piece by piece: the pieces kept whole, then each long pad diagonal's
    parts of at most ``PAD_TILE``."""
    kept, cut = [], []
    for i in range(p.qi.size):
        row = [int(c[i]) for c in p]
        if row[6] != IDENT or row[2] <= PAD_TILE:
            kept.append((*row, int(keys[i])))
            continue
        for off in range(0, row[2], PAD_TILE):
            n = min(row[2] - off, PAD_TILE)
            cut.append((row[0] + off, row[1] + off, n, row[3] + off, row[4] + off, n, row[6],
                        int(keys[i])))  # fmt: skip
    cols = np.array(kept + cut, dtype=np.int64).reshape(-1, 8)
    return Pieces(*(cols[:, c].copy() for c in range(7))), cols[:, 7].copy()


@pytest.mark.parametrize("causal", [True, False])
def test_cut_pairs_and_pad_splits_equal_the_per_pair_loops(causal: bool) -> None:
    rng = np.random.default_rng(11 if causal else 12)
    split = 0
    for _ in range(40):
        q, k = _runs(rng)
        qi, ki = pair_runs(q, k, causal, None)
        got = cut_pairs(q, k, qi, ki, causal, None)
        want = _cut_by_loop(q, k, qi, ki, causal)
        for g, w in zip(got, want, strict=True):
            np.testing.assert_array_equal(g, w)
        keys = rng.integers(0, 5, size=got.qi.size)
        got_split, got_keys = _split_ident(got, keys)
        split += got_split.qi.size > got.qi.size
        want_split, want_keys = _split_by_loop(want, keys)
        for g, w in zip((*got_split, got_keys), (*want_split, want_keys), strict=True):
            np.testing.assert_array_equal(g, w)
    assert split >= 5  # long pad diagonals were cut
