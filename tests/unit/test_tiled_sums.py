"""The prefix-sum facts of :meth:`RankRuns.tiled_sums` against the rule, token by token, and
against the binary-search path they replace, on the streams of every packed layout (TE's
``packed`` cuts each document into ``2C`` chunks and pads it) and on streams where they must
step aside (repeated positions, a rank's slots out of position order)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from test_visibility import _dense

from _attention_common import same_plan, visible
from cpshard.attention.cost import _pairs, _searched_pairs, plan_facts
from cpshard.attention.selective_plan import (
    _searched_sums,
    exchange_sums,
    meta_arrays,
    needed_slots,
    wanted_of,
)
from cpshard.layouts.documents import PackSpec
from cpshard.sharding.meta import TokenMeta
from cpshard.tools.balance import all_plans
from cpshard.tools.plan_cost import plan_meta

MASKS = ((True, None), (True, 1), (True, 3), (False, None))


def _metas(rng: np.random.Generator, world: int) -> list[tuple[str, TokenMeta]]:
    """Rank 0's meta of one random packed row under every layout."""
    tokens = 2 * world * int(rng.integers(3, 12))
    lens, left = [], tokens
    while left:
        n = min(left, int(rng.integers(1, 3 * world + 4)))
        lens.append(n)
        left -= n
    spec = PackSpec.from_seq_lens([lens], tokens)
    return [(p.layout, plan_meta(p, 0)) for p in all_plans(spec, world, include_torch=False)]


def _assert_slots(meta: TokenMeta, world: int, causal: bool, window: int | None) -> None:
    """Every rank's received slots and what it sends to each peer, against the rule."""
    a = meta_arrays(meta)
    n = a.local_len
    sees = []  # [t]: the stream slots some query of rank t sees, any row
    for t in range(world):
        sl = slice(t * n, (t + 1) * n)
        sees.append(visible(a.pos[:, sl], a.doc[:, sl], a.pos, a.doc, causal, window).any((0, 1)))
    for r in range(world):
        need = sees[r].copy()
        need[r * n : (r + 1) * n] = False
        np.testing.assert_array_equal(needed_slots(a, r, causal, window), np.flatnonzero(need))
        sends = wanted_of(a, r, causal, window)
        for t in range(world):
            want = (
                np.zeros(0, dtype=np.int64)
                if t == r
                else np.flatnonzero(sees[t][r * n : (r + 1) * n])
            )
            np.testing.assert_array_equal(sends[t], want)


def _assert_dense(meta: TokenMeta, world: int, causal: bool, window: int | None) -> None:
    _assert_slots(meta, world, causal, window)
    a = meta_arrays(meta)
    pairs, local, _, moved = _dense(a.pos, a.doc, world, causal, window)
    facts = plan_facts(meta, causal, window)
    diag = np.diag(moved)
    np.testing.assert_array_equal(facts.pairs, pairs)
    np.testing.assert_array_equal(facts.local_pairs, local)
    np.testing.assert_array_equal(facts.recv_slots, moved.sum(axis=1) - diag)
    np.testing.assert_array_equal(facts.send_slots, moved.sum(axis=0) - diag)


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_layout_streams_take_the_prefix_sums_and_equal_the_rule(world: int) -> None:
    rng = np.random.default_rng(world)
    for _ in range(6):
        for layout, meta in _metas(rng, world):
            a = meta_arrays(meta)
            runs = a.runs[0]
            assert runs.tiling() is not None, layout
            for causal in (True, False):
                tiled = runs.tiled_sums(causal)
                assert tiled is not None
                pairs, local = _searched_pairs(runs, a.frame, causal, None)
                recv, send = _searched_sums(runs, causal, None)
                np.testing.assert_array_equal(tiled.pairs, pairs)
                np.testing.assert_array_equal(tiled.local, local)
                np.testing.assert_array_equal(tiled.recv, recv)
                np.testing.assert_array_equal(tiled.send, send)
            for causal, window in MASKS:  # windows: the searches; every mask: the rule
                _assert_dense(meta, world, causal, window)


@pytest.mark.parametrize("world", [2, 3, 4])
def test_several_row_groups_take_the_prefix_sums_per_group(world: int) -> None:
    """Rows of different structure (layouts of one batch, TE's ``packed`` of several batches):
    the pairs are summed per group, the exchange is the union over the groups."""
    rng = np.random.default_rng(10 + world)
    tested = 0
    for _ in range(12):
        by_width: dict[tuple[str, int], list[TokenMeta]] = {}
        for _ in range(2):
            for layout, m in _metas(rng, world):
                key = (layout == "packed", int(m.positions.shape[1]))
                by_width.setdefault(key, []).append(m)
        for rows in by_width.values():
            if len(rows) < 2:
                continue
            pos = torch.cat([m.positions for m in rows]).clone()
            doc = torch.cat([m.document_ids for m in rows]).clone()
            meta = TokenMeta(0, world, pos, doc)
            a = meta_arrays(meta)
            if len(a.runs) < 2:
                continue
            assert all(r.tiled_sums(True) is not None for r in a.runs)
            tested += 1
            for causal, window in MASKS:
                _assert_dense(meta, world, causal, window)
    assert tested >= 6


def test_streams_that_break_the_order_step_aside() -> None:
    """Repeated positions, or a rank's slots out of position order: no prefix sums, and the
    searches still give the rule's counts."""
    world, n = 2, 4
    pos = np.arange(world * n)
    doc = np.zeros(world * n, dtype=np.int64)
    swapped = pos.copy()
    swapped[[0, 1]] = swapped[[1, 0]]  # rank 0 holds position 1 before 0
    repeated = pos // 2  # every position twice
    for p in (swapped, repeated):
        meta = TokenMeta(0, world, torch.from_numpy(p[None]), torch.from_numpy(doc[None]))
        a = meta_arrays(meta)
        assert a.runs[0].tiling() is None
        for causal, window in MASKS:
            _assert_dense(meta, world, causal, window)
            got = (*_pairs(a, causal, window), *exchange_sums(a, causal, window))
            pairs, local = _searched_pairs(a.runs[0], a.frame, causal, window)
            want = (pairs + a.runs[0].pad_tokens, local + a.runs[0].pad_tokens,
                    *_searched_sums(a.runs[0], causal, window))  # fmt: skip
            for g, w in zip(got, want, strict=True):
                np.testing.assert_array_equal(g, w)


def test_class_ids_order_like_the_distinct_classes() -> None:
    """Dense ids (an offset) and spread ids (a sort) both order the classes as their ranks."""
    from cpshard.attention.pieces import PAD_CLASS, _class_ids

    rng = np.random.default_rng(0)
    for spread in (10, 1 << 40, 1 << 62):
        cls = rng.integers(-spread, spread, size=200)
        cls[rng.random(200) < 0.2] = PAD_CLASS
        ids = _class_ids(cls)
        ranks = np.unique(cls, return_inverse=True)[1].reshape(-1)
        assert ids.min() >= 0
        np.testing.assert_array_equal(
            np.argsort(ids, kind="stable"), np.argsort(ranks, kind="stable")
        )
        np.testing.assert_array_equal(ids[:, None] == ids[None], ranks[:, None] == ranks[None])


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_remote_plan_from_the_received_runs_equals_the_gathered_one(world: int) -> None:
    """The selective plan's remote kernel plan made from the received runs' table equals the
    plan of the gathered received positions and document ids, for every rank."""
    from cpshard.attention.plan import pair_plan
    from cpshard.attention.selective_plan import selective_plan

    cpu = torch.device("cpu")
    rng = np.random.default_rng(20 + world)
    for _ in range(4):
        for _, meta0 in _metas(rng, world):
            for causal in (True, False):
                for r in range(world):
                    meta = TokenMeta(r, world, meta0.positions, meta0.document_ids)
                    a = meta_arrays(meta)
                    assert a.runs[0].tiling() is not None
                    plan = selective_plan(meta, causal, None, cpu)
                    sl = a.rank_slice(r)
                    want = pair_plan(
                        a.pos[:, sl], a.doc[:, sl], a.pos[:, plan.key_slots],
                        a.doc[:, plan.key_slots], a.rows, causal=causal, window=None,
                        device=cpu,
                    )  # fmt: skip
                    same_plan(plan.remote, want)


def test_stable_order_is_the_stable_argsort() -> None:
    from cpshard.attention.visibility import _stable_order

    rng = np.random.default_rng(1)
    for hi in (7, 1 << 16, 1 << 20, (1 << 32) - 1, 1 << 32, 1 << 50):
        for size in (5, 3000):
            x = rng.integers(0, hi, size=size, endpoint=True)
            np.testing.assert_array_equal(_stable_order(x), np.argsort(x, kind="stable"))
    x = rng.integers(-5, 5, size=3000)
    np.testing.assert_array_equal(_stable_order(x), np.argsort(x, kind="stable"))


@pytest.mark.parametrize("world", [1, 2, 3])
@pytest.mark.parametrize("causal", [True, False])
def test_a_stream_of_pads_only_has_no_tiling_and_moves_nothing(world: int, causal: bool) -> None:
    """A row of CP pads only (``-1 - position`` ids, no real token): no tiling (the searches
    answer), each rank's queries see only themselves, nothing is exchanged. Found by review: the
    empty tiling raised IndexError in its prefix sums."""
    from cpshard.attention.selective_plan import selective_plan

    n = 2
    pos = torch.arange(world * n)[None]
    for r in range(world):
        meta = TokenMeta(r, world, pos, -1 - pos)
        a = meta_arrays(meta)
        assert a.runs[0].tiling() is None
        facts = plan_facts(meta, causal, None)
        assert facts.pairs.tolist() == facts.local_pairs.tolist() == [n] * world
        assert facts.recv_slots.tolist() == facts.send_slots.tolist() == [0] * world
        assert needed_slots(a, r, causal, None).size == 0
        assert all(s.size == 0 for s in wanted_of(a, r, causal, None))
        plan = selective_plan(meta, causal, None, torch.device("cpu"))
        assert plan.recv_slots.size == 0 and sum(plan.send_splits) == 0
