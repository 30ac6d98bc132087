"""The selective volume the cost model charges is exactly what the selective plans move.

For dense padded multi-row batches (rows of different lengths, so several row groups), packed
rows under every packed layout, windows and bidirectional masks, the cost facts' receive / send
slots of every rank equal the slots its :class:`SelectivePlan` receives / sends (the plan is
another code path: masks over the stream per rank), and :func:`method_bytes` turns them into the
bytes the exchange moves. No process group.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from cpshard.attention.cost import (
    BACKWARD_FACTOR,
    CallShape,
    CostModel,
    method_bytes,
    method_costs,
    pad_tile_pairs,
    plan_facts,
    wire_bytes,
)
from cpshard.attention.pieces import PAD_TILE
from cpshard.attention.plan import attention_plan
from cpshard.attention.selective_plan import selective_plan
from cpshard.layouts.closed_form import ContiguousLayout, RoundRobinLayout
from cpshard.layouts.index import padded_length
from cpshard.sharding.meta import TokenMeta, pad_document_ids
from cpshard.tools.balance import all_plans, sample_packed_batch
from cpshard.tools.plan_cost import plan_meta

CPU = torch.device("cpu")
MASKS = ((True, None), (True, 7), (False, None))


def _dense_padded(layout: str, world: int, rows: int, seed: int) -> list[TokenMeta]:
    """``rows`` dense rows of random real lengths (pads by the convention), ``layout``."""
    rng = np.random.default_rng(seed)
    seq = int(rng.integers(8, 40)) * world
    padded = padded_length(seq, 2 * world)
    lens = torch.as_tensor(rng.integers(1, seq + 1, size=rows))
    pad = torch.arange(padded)[None] >= lens[:, None]
    docs = torch.zeros(rows, padded, dtype=torch.long)
    if seed % 2:  # some rows hold two documents
        docs[:, padded // 3 :] = 1
    docs = pad_document_ids(docs, pad)
    lay = RoundRobinLayout() if layout == "round_robin" else ContiguousLayout()
    stream = lay.rank_map(world, padded).reshape(-1)
    pos = stream[None].expand(rows, -1).contiguous()
    return [TokenMeta(r, world, pos, docs[:, stream].contiguous()) for r in range(world)]


def _packed(layout_index: int, world: int, seed: int) -> list[TokenMeta]:
    spec = sample_packed_batch("lognormal", 600 * world, seed)
    plan = all_plans(spec, world, include_torch=False)[layout_index]
    return [plan_meta(plan, r) for r in range(world)]


def _check(metas: list[TokenMeta], causal: bool, window: int | None) -> None:
    facts = plan_facts(metas[0], causal, window)
    plans = [selective_plan(m, causal, window, CPU) for m in metas]
    np.testing.assert_array_equal(facts.recv_slots, [p.received for p in plans])
    np.testing.assert_array_equal(facts.send_slots, [p.sent for p in plans])
    shape = CallShape(metas[0].positions.shape[0], 8, 2, 16, 2, causal, window)
    slot = 2 * 2 * 16 * shape.batch  # K and V elements of one slot, every row
    want = max(max(p.received, p.sent) for p in plans) * slot * (2 + 4)  # bf16 fwd, fp32 bwd
    got = method_bytes(facts, shape)["selective"]
    assert got.max() == want
    np.testing.assert_array_equal(got, [max(p.received, p.sent) * slot * (2 + 4) for p in plans])
    assert wire_bytes(facts, shape)["selective"] == sum(p.sent for p in plans) * slot * (2 + 4)


@pytest.mark.parametrize("layout", ["round_robin", "contiguous"])
@pytest.mark.parametrize("world", [2, 3, 4])
def test_dense_padded_rows_volume_is_what_the_plans_move(layout: str, world: int) -> None:
    for seed in range(6):
        metas = _dense_padded(layout, world, rows=int(2 + seed % 4), seed=seed)
        assert metas[0].positions.shape[0] > 1
        for causal, window in MASKS:
            _check(metas, causal, window)


@pytest.mark.parametrize("layout_index", [0, 1, 2, 3])  # contiguous, round_robin, packed, balanced
@pytest.mark.parametrize("world", [2, 3, 4])
def test_packed_rows_volume_is_what_the_plans_move(layout_index: int, world: int) -> None:
    for seed in range(2):
        metas = _packed(layout_index, world, seed)
        for causal, window in MASKS:
            _check(metas, causal, window)


def test_round_robin_padded_rows_were_overstated_by_the_capped_sum() -> None:
    """The case of issue 25: rows of different real lengths under round_robin. The per-group
    sum capped at ``L`` counted a slot once per row that needs it; the exchange moves it once."""
    metas = _dense_padded("round_robin", 3, rows=4, seed=2)
    facts = plan_facts(metas[0])
    from cpshard.attention.selective_plan import exchange_counts, meta_arrays

    capped = exchange_counts(meta_arrays(metas[0]), True, None)
    capped_recv = capped.sum(axis=1) - np.diag(capped)
    assert (capped_recv >= facts.recv_slots).all() and (capped_recv > facts.recv_slots).any()


def test_method_bytes_is_what_method_costs_charges_the_link() -> None:
    """With free compute, no latency and no overlap a method's time is its bytes over the link."""
    model = CostModel(link_bandwidth=1e9, compute_rate=1e30, latency=0.0, overlap=0.0)
    for metas in (_dense_padded("round_robin", 4, 3, 1), _packed(3, 4, 0)):
        facts = plan_facts(metas[0])
        shape = CallShape(metas[0].positions.shape[0], 8, 4, 16, 2)
        costs, moved = method_costs(facts, shape, model), method_bytes(facts, shape)
        for m, t in costs.items():
            assert t * model.link_bandwidth == pytest.approx(moved[m].max(), rel=1e-9), m


def _long_padded(world: int, lens: list[int], seq: int) -> list[TokenMeta]:
    """Dense rows of ``seq`` tokens whose real lengths are ``lens`` (the rest padding, long pad
    stretches: diagonals of several PAD_TILE tiles), round_robin."""
    padded = padded_length(seq, 2 * world)
    pad = torch.arange(padded)[None] >= torch.as_tensor(lens)[:, None]
    docs = pad_document_ids(torch.zeros(len(lens), padded, dtype=torch.long), pad)
    stream = RoundRobinLayout().rank_map(world, padded).reshape(-1)
    pos = stream[None].expand(len(lens), -1).contiguous()
    return [TokenMeta(r, world, pos, docs[:, stream].contiguous()) for r in range(world)]


@pytest.mark.parametrize("world", [2, 3, 4])
def test_pad_pairs_are_what_the_kernels_compute_beyond_the_visible(world: int) -> None:
    """Visible pairs plus pad_pairs of every rank are the pairs its all-gather plan's kernels
    compute (each pad diagonal in tiles of at most PAD_TILE, computed whole)."""
    for lens in ([1000, 3000, 2100], [4096], [700]):
        metas = _long_padded(world, lens, 4096)
        facts = plan_facts(metas[0])
        pads = np.zeros(world, dtype=np.int64) if facts.pad_pairs is None else facts.pad_pairs
        for r, meta in enumerate(metas):
            computed = attention_plan(meta).all_gather(True, None, CPU).computed
            assert int(facts.pairs[r] + pads[r]) == computed, (lens, r)
    whole = padded_length(4096, 2 * world)  # a row without padding: no pad stretch
    assert plan_facts(_long_padded(world, [whole], whole)[0]).pad_pairs is None


def test_pad_tile_pairs_counts_whole_tiles() -> None:
    t = PAD_TILE
    got = pad_tile_pairs(np.asarray([1, 2, t, t + 1, 3 * t + 5], dtype=np.int64))
    np.testing.assert_array_equal(
        got, [0, 2, t * t - t, t * t + 1 - (t + 1), 3 * t * t + 25 - (3 * t + 5)]
    )


def test_pad_pairs_add_compute_on_the_padded_ranks() -> None:
    """The same facts without their pad_pairs model every method faster; ulysses by the pad
    diagonals of every rank over C, the others by at least the padded rank's."""
    metas = _long_padded(4, [1000, 3000, 2100], 4096)
    facts = plan_facts(metas[0])
    assert facts.pad_pairs is not None and (facts.pad_pairs > 0).any()
    bare = dataclasses.replace(facts, pad_pairs=None)
    shape = CallShape(3, 8, 2, 16, 4)
    model = CostModel(compute_rate=1e10, link_bandwidth=1e9, latency=0.0)
    with_pads, without = method_costs(facts, shape, model), method_costs(bare, shape, model)
    flop = 4 * 16 * 8 * (1 + BACKWARD_FACTOR) / model.compute_rate  # per meta row's pair
    assert with_pads["ulysses"] - without["ulysses"] == pytest.approx(
        facts.pad_pairs.sum() * flop / 4, rel=1e-9
    )
    for m in ("all_gather", "ring", "selective"):
        assert with_pads[m] > without[m], m
