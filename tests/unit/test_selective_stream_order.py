"""Selective's received keys in stream order: when the plan uses it, and that the plan it makes is
the token pass's plan of the same keys in that order (no process group)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from _attention_common import make_meta, same_plan, te_packed_case
from cpshard.attention.pieces import PAD_CLASS, RunTable
from cpshard.attention.plan import PairPlan, host_rows
from cpshard.attention.selective_plan import (
    _pair_plans,
    meta_arrays,
    needed_slots,
    selective_plan,
    stream_order,
)

CPU = torch.device("cpu")


def _te_packed(world: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    return te_packed_case(np.random.default_rng(seed).integers(20, 200, size=40).tolist(), world)


def _calls(plan: PairPlan) -> int:
    return sum(len(tasks) for _, tasks in plan.groups)


@pytest.mark.parametrize("world", [8, 16])
def test_te_packed_chunks_arrive_as_runs_that_stream_order_joins(world: int) -> None:
    """Documents of 20-200 tokens cut into ``2C`` chunks: most ranks read their received keys in
    stream order; those keys are the needed slots sorted by (document, position), and the plan
    over them is the token pass's plan of the same keys in the same order, with fewer kernel
    calls and fewer pairs computed in masked tiles than in arrival order."""
    rmap, docs = _te_packed(world, world)
    ordered = 0
    for rank in range(world):
        meta = make_meta(rmap, docs, rank)
        a = meta_arrays(meta)
        for window in (None, 7):
            plan = selective_plan(meta, True, window, CPU)
            recv = needed_slots(a, rank, True, window)
            np.testing.assert_array_equal(plan.recv_slots, recv)
            keys = plan.key_slots
            if plan.recv_order is None:
                np.testing.assert_array_equal(keys, recv)
                continue
            ordered += 1
            order = plan.recv_order.numpy()
            np.testing.assert_array_equal(np.sort(order), np.arange(recv.size))  # a permutation
            doc, pos = a.doc[0, keys], a.pos[0, keys]
            np.testing.assert_array_equal(np.lexsort((pos, doc)), np.arange(keys.size))
            own = a.rank_slice(rank)
            merge = host_rows(meta).merge
            _, remote = _pair_plans(a, own, keys, merge, True, window, CPU)
            same_plan(plan.remote, remote)
            _, arrival = _pair_plans(a, own, recv, merge, True, window, CPU)
            assert plan.remote.needed == arrival.needed
            assert _calls(plan.remote) < _calls(arrival)  # fewer calls, less masked waste
            assert plan.remote.computed <= arrival.computed
    assert ordered >= world // 2  # the rule picks it on some of the ranks


def _runs(pos: list[int], doc: list[int], n: list[int], grp: list[int] | None = None) -> RunTable:
    count = np.array(n, dtype=np.int64)
    start = np.cumsum(count) - count
    g = np.zeros(count.size, dtype=np.int64) if grp is None else np.array(grp, dtype=np.int64)
    return RunTable(start, count, np.array(pos), np.array(doc), g)


def test_the_rule_orders_only_short_runs_that_join_four_times_fewer() -> None:
    # document 0 in 8 chunks of 2 slots, received from 4 ranks: (0, 2, ...) chunk by chunk
    pos = [2, 12, 4, 10, 6, 8, 0, 14]
    joined, order = stream_order(_runs(pos, [0] * 8, [2] * 8), 16)
    assert order is not None
    assert joined.n.tolist() == [16] and joined.pos.tolist() == [0] and joined.start.tolist() == [0]
    got = np.array([2, 3, 12, 13, 4, 5, 10, 11, 6, 7, 8, 9, 0, 1, 14, 15])[order]
    assert got.tolist() == list(range(16))  # the received slots' positions, in stream order
    # unchanged: long runs, too little joined, several row groups, pad runs, one run
    long_runs = _runs([32 * p for p in pos], [0] * 8, [64] * 8)  # a kernel tile's width
    assert stream_order(long_runs, 512)[1] is None
    two_docs = _runs([2, 0, 6, 4], [0, 0, 1, 1], [2, 2, 2, 2])  # 4 runs joined into 2
    assert stream_order(two_docs, 8)[1] is None
    assert stream_order(_runs(pos, [0] * 8, [2] * 8, [0, 1] * 4), 16)[1] is None
    assert stream_order(_runs(pos, [0] * 7 + [PAD_CLASS], [2] * 8), 16)[1] is None
    assert stream_order(_runs([0], [0], [2]), 2)[1] is None
