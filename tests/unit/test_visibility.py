"""Counts by closed forms over runs against the dense visibility rule (no process group).

The plan facts behind ``attention="auto"`` (pairs per rank, what the selective exchange receives
and sends) and the selective plan's slots are computed from runs of the stream
(:mod:`cpshard.attention.visibility`); here every one of them is compared with the rule itself,
token by token, on streams with every feature the runs must survive: windows, bidirectional
masks, pads by the convention and negative ids that are not pads, positions that repeat,
document ids spread over all of int64, and meta rows of different structure.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from _attention_common import visible
from cpshard.attention.cost import _pairs, plan_facts
from cpshard.attention.selective_plan import (
    exchange_counts,
    exchange_sums,
    meta_arrays,
    selective_plan,
    wanted_of,
)
from cpshard.attention.visibility import KeyCounts, RankRuns, StreamRuns, Union
from cpshard.sharding.meta import TokenMeta

CPU = torch.device("cpu")
MASKS = ((True, None), (True, 1), (True, 3), (False, None))


def _stream(rng: np.random.Generator, kind: str) -> tuple[int, np.ndarray, np.ndarray]:
    """``(C, pos [B, C*L], doc [B, C*L])``: a random rank-major stream of one ``kind``."""
    world, local = int(rng.integers(1, 6)), int(rng.integers(1, 16))
    s = world * local
    rows = int(rng.integers(1, 4))
    shared = rng.permutation(s)
    pos_rows, doc_rows = [], []
    for b in range(rows):
        perm = shared if b % 2 == 0 else rng.permutation(s)  # rows 0 and 2: one structure
        doc = np.zeros(s, dtype=np.int64)
        for cut in rng.choice(np.arange(1, s), size=min(int(rng.integers(0, 4)), s - 1),
                              replace=False) if s > 1 else []:  # fmt: skip
            doc[cut:] += 1
        pos = np.arange(s)
        pads = int(rng.integers(0, s // 2 + 1))
        if kind == "pads":  # pads by the convention: each sees only itself
            doc[s - pads :] = -1 - pos[s - pads :]
        elif kind == "negative":  # a negative id that is not a pad: one document
            doc[s - pads :] = -7
        elif kind == "repeats":  # every position twice
            pos = pos // 2
        elif kind == "pad_repeats":  # pads by the convention at repeated positions see each other
            pos = pos // 2
            doc[s - pads :] = -1 - pos[s - pads :]
        elif kind == "sparse":  # ids anywhere in int64, e.g. hashes
            doc = doc * (1 << 55) - (1 << 61)
        pos_rows.append(pos[perm])
        doc_rows.append(doc[perm])
    return world, np.stack(pos_rows), np.stack(doc_rows)


def _dense(
    pos: np.ndarray, doc: np.ndarray, world: int, causal: bool, window: int | None
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """``(pairs [C], local pairs [C], exchange [C, C], moved [C, C])`` by the rule, token by
    token: ``exchange`` sums over row structures (capped at ``L``), ``moved[t, o]`` counts the
    slots of rank ``o`` some query of rank ``t`` sees in *any* row (what the exchange moves)."""
    n = pos.shape[1] // world
    pairs = np.zeros(world, dtype=np.int64)
    local = np.zeros(world, dtype=np.int64)
    exchange = np.zeros((world, world), dtype=np.int64)
    need = np.zeros((world, pos.shape[1]), dtype=bool)
    counted: set[bytes] = set()  # one exchange count per row structure
    for p, d in zip(pos, doc, strict=True):
        vis = visible(p, d, p, d, causal, window)
        structure = p.tobytes() + b"|" + d.tobytes()
        for t in range(world):
            rows = vis[t * n : (t + 1) * n]
            pairs[t] += rows.sum()
            local[t] += rows[:, t * n : (t + 1) * n].sum()
            need[t] |= rows.any(axis=0)
            if structure not in counted:
                exchange[t] += rows.any(axis=0).reshape(world, n).sum(axis=1)
        counted.add(structure)
    moved = need.reshape(world, world, n).sum(axis=2)
    return pairs, local, np.minimum(exchange, n), moved


KINDS = ["plain", "pads", "negative", "repeats", "pad_repeats", "sparse"]


@pytest.mark.parametrize("kind", KINDS)
def test_facts_and_plans_equal_the_rule_token_by_token(kind: str) -> None:
    rng = np.random.default_rng(KINDS.index(kind))
    for _ in range(60):
        world, pos, doc = _stream(rng, kind)
        metas = [
            TokenMeta(r, world, torch.from_numpy(pos.copy()), torch.from_numpy(doc.copy()))
            for r in range(world)
        ]
        n = metas[0].local_len
        for causal, window in MASKS:
            pairs, local, exchange, moved = _dense(pos, doc, world, causal, window)
            facts = plan_facts(metas[0], causal, window)
            np.testing.assert_array_equal(facts.pairs, pairs)
            np.testing.assert_array_equal(facts.local_pairs, local)
            np.testing.assert_array_equal(
                exchange_counts(meta_arrays(metas[0]), causal, window), exchange
            )
            diag = np.diag(moved)  # the union over rows: one slot moves once for every row
            np.testing.assert_array_equal(facts.recv_slots, moved.sum(axis=1) - diag)
            np.testing.assert_array_equal(facts.send_slots, moved.sum(axis=0) - diag)
            for r, meta in enumerate(metas):  # the slots themselves, any row
                plan = selective_plan(meta, causal, window, CPU)
                sl = slice(r * n, (r + 1) * n)
                vis = visible(pos[:, sl], doc[:, sl], pos, doc, causal, window)
                need = vis.any(axis=(0, 1))
                need[r * n : (r + 1) * n] = False
                np.testing.assert_array_equal(plan.recv_slots, np.flatnonzero(need))


@pytest.mark.parametrize("kind", KINDS)
def test_rank_blocks_answer_as_rank_by_rank(kind: str) -> None:
    """The every-rank-at-once path (rank blocks) and the rank-by-rank path agree."""
    rng = np.random.default_rng(10 + KINDS.index(kind))
    for _ in range(40):
        world, pos, doc = _stream(rng, kind)
        meta = TokenMeta(0, world, torch.from_numpy(pos[:1]), torch.from_numpy(doc[:1]))
        a = meta_arrays(meta)
        assert a.runs[0].blocked
        loops = dataclasses.replace(
            a, runs=tuple(RankRuns(r.runs, world, a.frame, blocked=False) for r in a.runs)
        )
        for causal, window in MASKS:
            for got, want in zip(
                (*exchange_sums(a, causal, window), *_pairs(a, causal, window)),
                (*exchange_sums(loops, causal, window), *_pairs(loops, causal, window)),
                strict=True,
            ):
                np.testing.assert_array_equal(got, want)
            for r in range(world):
                for got, want in zip(
                    wanted_of(a, r, causal, window),
                    wanted_of(loops, r, causal, window),
                    strict=True,
                ):
                    np.testing.assert_array_equal(got, want)


def test_positions_too_sparse_to_code_are_refused() -> None:
    pos = torch.tensor([[0, 1 << 61, 2, 3]])
    doc = torch.tensor([[0, 1, 2, 3]])
    with pytest.raises(ValueError, match=r"documents \* span < 2\*\*62"):
        plan_facts(TokenMeta(0, 2, pos, doc))


def test_key_counts_are_exact_where_the_squares_overflow_int64() -> None:
    """Codes near 2**40: their squares wrap uint64, the counts must not."""
    rng = np.random.default_rng(5)
    base = 1 << 40
    lo = base + np.sort(rng.integers(0, 10_000, size=50))
    hi = lo + rng.integers(0, 300, size=50)  # overlapping runs: a multiset
    counts = KeyCounts(lo, hi)
    xs = base + rng.integers(-50, 10_500, size=40)
    keys = [c for a, b in zip(lo.tolist(), hi.tolist(), strict=True) for c in range(a, b)]
    want_below = [sum(1 for k in keys if k < x) for x in xs.tolist()]
    np.testing.assert_array_equal(counts.below(xs), want_below)
    u = np.minimum(xs, xs[::-1])
    v = np.maximum(xs, xs[::-1])
    pairs = zip(u.tolist(), v.tolist(), strict=True)
    want = [sum(sum(1 for k in keys if k < x) for x in range(a, b)) for a, b in pairs]
    np.testing.assert_array_equal(counts.range_sum(u, v), want)


def test_union_counts_and_slots() -> None:
    u = Union(np.array([10, 0, 12, 30]), np.array([15, 5, 20, 31]))
    np.testing.assert_array_equal(u.lo, [0, 10, 30])
    np.testing.assert_array_equal(u.hi, [5, 20, 31])
    np.testing.assert_array_equal(
        u.count(np.array([0, 3, 18, 25]), np.array([40, 12, 40, 26])), [16, 4, 3, 0]
    )


def test_union_equals_the_set_of_its_codes() -> None:
    """Random multisets of intervals (nested, touching, overlapping, repeated): the disjoint
    intervals, the measure below any code, the members and the covered slots of runs are those
    of the set of codes the intervals hold."""
    rng = np.random.default_rng(9)
    for _ in range(60):
        m = int(rng.integers(1, 30))
        lo = rng.integers(0, 200, size=m)
        hi = lo + rng.integers(1, 40, size=m)
        u = Union(lo, hi)
        codes = sorted(
            {c for a, b in zip(lo.tolist(), hi.tolist(), strict=True) for c in range(a, b)}
        )
        spans: list[list[int]] = []  # maximal stretches of consecutive codes
        for c in codes:
            if spans and spans[-1][1] == c:
                spans[-1][1] = c + 1
            else:
                spans.append([c, c + 1])
        np.testing.assert_array_equal(u.lo, [a for a, _ in spans])
        np.testing.assert_array_equal(u.hi, [b for _, b in spans])
        xs = rng.integers(-5, 260, size=20)
        np.testing.assert_array_equal(u.measure_below(xs), [sum(c < x for c in codes) for x in xs])
        np.testing.assert_array_equal(u.members(), codes)
        r = int(rng.integers(0, 12))
        code, n = rng.integers(-20, 240, size=r), rng.integers(1, 30, size=r)
        start, shift = np.cumsum(n) - n + 1000, rng.integers(-3, 4, size=r)
        z = np.zeros(r, dtype=np.int64)
        runs = StreamRuns(start, n, z, z, z, z.astype(bool), code)
        want = [(int(start[i]) + t, i) for i in range(r) for t in range(int(n[i]))
                if int(code[i] + shift[i]) + t in set(codes)]  # fmt: skip
        slots, of = u.covered_slots(runs, shift)
        assert list(zip(slots.tolist(), of.tolist(), strict=True)) == want
