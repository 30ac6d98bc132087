"""The selective exchange's plan against a dense visibility reference (no process group)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from _attention_common import LAYOUTS, make_case, make_meta, visible
from cpshard.attention.selective_plan import exchange_counts, meta_arrays, selective_plan
from cpshard.sharding.meta import TokenMeta

CPU = torch.device("cpu")


def _visible(meta: TokenMeta, causal: bool, window: int | None) -> np.ndarray:
    """Bool ``[B, S, S]`` (query slot, key slot) of the stream, from the rule itself."""
    pos = meta.positions.numpy()
    doc = meta.document_ids.numpy()
    vis: np.ndarray = visible(pos, doc, pos, doc, causal, window)
    return vis


def _needed(meta: TokenMeta, rank: int, causal: bool, window: int | None) -> np.ndarray:
    """Stream slots off ``rank`` that some query of ``rank`` sees (any row)."""
    n = meta.local_len
    vis = _visible(meta, causal, window)[:, rank * n : (rank + 1) * n, :]
    need = vis.any(axis=(0, 1))
    need[rank * n : (rank + 1) * n] = False
    return np.flatnonzero(need)


CASES = [
    (lay, world, causal, window, meta_batch)
    for lay in LAYOUTS
    for world in (1, 2, 3, 4)
    for causal, window in ((True, None), (True, 5), (False, None))
    for meta_batch in (1, 2)
]


@pytest.mark.parametrize(("layout", "world", "causal", "window", "meta_batch"), CASES)
def test_exchange_moves_exactly_what_queries_see(
    layout: str, world: int, causal: bool, window: int | None, meta_batch: int
) -> None:
    rmap, docs = make_case(layout, world, 13 * world - 3, 1, 4, world, meta_batch)
    metas = [make_meta(rmap, docs, r) for r in range(world)]
    plans = [selective_plan(m, causal, window, CPU) for m in metas]
    n = metas[0].local_len
    for r, (meta, plan) in enumerate(zip(metas, plans, strict=True)):
        want = _needed(meta, r, causal, window)
        np.testing.assert_array_equal(plan.recv_slots, want)  # moved == needed, slot for slot
        assert plan.recv_splits[r] == 0 and plan.send_splits[r] == 0
        assert plan.received == want.size
        # what r sends to t is what t expects from r, slot for slot
        start = 0
        for t in range(world):
            sent = plan.send_index[start : start + plan.send_splits[t]].numpy() + r * n
            start += plan.send_splits[t]
            theirs = plans[t].recv_slots
            np.testing.assert_array_equal(sent, theirs[(theirs >= r * n) & (theirs < (r + 1) * n)])
            assert plan.send_splits[t] == plans[t].recv_splits[r]
    counts = exchange_counts(meta_arrays(metas[0]), causal, window)
    if meta_batch == 1:  # exact for one row group
        for t in range(world):
            assert counts[t].sum() - counts[t, t] == plans[t].received


def test_balanced_packed_documents_move_a_fraction_of_the_all_gather() -> None:
    """Whole documents on one rank need no exchange: only the cut documents' keys move."""
    world, n = 4, 64
    docs = torch.repeat_interleave(torch.arange(8), 32)[None]  # 8 documents of 32 tokens
    rmap = torch.arange(world * n).view(world, n)  # contiguous: two whole documents per rank
    for r in range(world):
        plan = selective_plan(make_meta(rmap, docs, r), True, None, CPU)
        assert plan.received == 0 and plan.sent == 0 and plan.remote.empty
    # documents of 64 cut in halves across ranks; the wrapped one (ids 3) is at both ends
    docs = torch.repeat_interleave(torch.arange(4), 64)[None].roll(32, dims=1)
    got = [selective_plan(make_meta(rmap, docs, r), True, None, CPU).received for r in range(4)]
    # rank r > 0 needs the first half of the document it ends in (rank 0 holds doc 3's earliest
    # positions, which rank 3's queries see too): 32 keys, rank 3 twice that
    assert got == [0, 32, 32, 64]


def test_plan_is_cached_per_mask_and_device() -> None:
    rmap, docs = make_case("random", 2, 30, 1, 3, 0, 1)
    meta = make_meta(rmap, docs, 0)
    a = selective_plan(meta, True, None, CPU)
    assert selective_plan(meta, True, None, CPU) is a
    assert selective_plan(meta, True, 4, CPU) is not a
