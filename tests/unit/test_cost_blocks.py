"""The kernel-block fact of the cost model (:class:`KernelBlocks`) against the blocks the CPU
flash kernels run for the plans' real kernel calls, and the three CPU terms of the model
(``block_rate``, ``gather_bandwidth``, ``all_to_all_bandwidth``). No process group."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
import torch

from cpshard.attention.calibration import FIT_RATES, Sample, fit_rates
from cpshard.attention.cost import (
    KV_BLOCK,
    CallShape,
    CostModel,
    causal_blocks,
    full_blocks,
    method_costs,
    plan_facts,
    query_block,
)
from cpshard.attention.pieces import Task
from cpshard.attention.plan import PairPlan, attention_plan
from cpshard.layouts.closed_form import ContiguousLayout, RoundRobinLayout
from cpshard.layouts.index import padded_length
from cpshard.sharding.meta import TokenMeta, pad_document_ids
from cpshard.tools.balance import all_plans, sample_packed_batch
from cpshard.tools.plan_cost import plan_meta

CPU = torch.device("cpu")


def _task_blocks(t: Task) -> int:
    """Blocks the CPU flash kernel runs for one call: query blocks of ``qSplitSize`` queries,
    each against the 512-key blocks up to its last key (causal: up to its last query)."""
    nq, nk = t.q1 - t.q0, t.k1 - t.k0
    qs = 256 if nq >= 768 else (64 if nq >= 192 else 32)
    out = 0
    for m in range(0, nq, qs):
        keys = min(m + qs, nk) if t.causal else nk
        out += -(-keys // KV_BLOCK)
    return out


def _plan_blocks(plan: PairPlan) -> int:
    return sum(
        (1 if rows is None else len(rows)) * sum(_task_blocks(t) for t in tasks)
        for rows, tasks in plan.groups
    )


def _dense(world: int, lens: list[int], seq: int, layout: str) -> list[TokenMeta]:
    """Dense rows of ``seq`` tokens, real lengths ``lens`` (the rest padding)."""
    padded = padded_length(seq, 2 * world)
    pad = torch.arange(padded)[None] >= torch.as_tensor(lens)[:, None]
    docs = pad_document_ids(torch.zeros(len(lens), padded, dtype=torch.long), pad)
    lay = RoundRobinLayout() if layout == "round_robin" else ContiguousLayout()
    stream = lay.rank_map(world, padded).reshape(-1)
    pos = stream[None].expand(len(lens), -1).contiguous()
    return [TokenMeta(r, world, pos, docs[:, stream].contiguous()) for r in range(world)]


def _packed(world: int, seed: int) -> list[TokenMeta]:
    spec = sample_packed_batch("lognormal", 4000 * world, seed)
    plan = all_plans(spec, world, include_torch=False)[0]
    return [plan_meta(plan, r) for r in range(world)]


def test_block_closed_forms_match_the_kernel_loop() -> None:
    for n in [1, 31, 32, 33, 191, 192, 300, 511, 512, 513, 767, 768, 1000, 2048, 5000]:
        causal = Task(0, n, 0, n, True, None, True)
        assert int(causal_blocks(np.asarray(n))) == _task_blocks(causal), n
        for nk in (1, 512, 700, 3000):
            full = Task(0, n, 0, nk, False, None, True)
            assert int(full_blocks(np.asarray(n), np.asarray(nk))) == _task_blocks(full)
    np.testing.assert_array_equal(query_block(np.asarray([1, 191, 192, 767, 768])),
                                  [32, 32, 64, 64, 256])  # fmt: skip


@pytest.mark.parametrize("world", [2, 3, 4])
@pytest.mark.parametrize("layout", ["round_robin", "contiguous"])
def test_blocks_are_what_the_kernels_run_on_long_runs(world: int, layout: str) -> None:
    """Dense padded rows (several row groups) and one whole row: the fact's blocks of every rank
    are the blocks of its real kernel calls, own-keys pass, all passes (all_gather split and
    ring alike); Ulysses's whole stream within 5% (how its pad runs join)."""
    for lens, seq in (([1000, 3000, 2100], 4096), ([4096], 4096), ([5000], 6000)):
        metas = _dense(world, lens, seq, layout)
        blocks = plan_facts(metas[0], blocks=True).blocks
        assert blocks is not None and blocks.exact
        for r, meta in enumerate(metas):
            plan = attention_plan(meta)
            local, remote = plan.all_gather_split(True, None, CPU)
            assert _plan_blocks(local) == blocks.own[r], (lens, r)
            assert _plan_blocks(local) + _plan_blocks(remote) == blocks.every[r], (lens, r)
            assert sum(_plan_blocks(b) for b in plan.ring(True, None, CPU)) == blocks.every[r]
        # Ulysses: the stream sorted by position (pad stretches joined across the ranks)
        uly = _plan_blocks(attention_plan(metas[0]).ulysses(True, None, CPU))
        assert uly == pytest.approx(blocks.stream, rel=0.05), lens


@pytest.mark.parametrize("world", [2, 4])
def test_blocks_of_packed_batches_are_close_to_the_kernels(world: int) -> None:
    """Packed lognormal batches (short documents: the plans group small pieces into masked
    tiles, one call for several pieces the fact counts one by one): within 15% per rank, never
    below the kernels' blocks by more than 1%."""
    for seed in (0, 1):
        metas = _packed(world, seed)
        blocks = plan_facts(metas[0], blocks=True).blocks
        assert blocks is not None
        for r, meta in enumerate(metas):
            local, remote = attention_plan(meta).all_gather_split(True, None, CPU)
            ran = _plan_blocks(local) + _plan_blocks(remote)
            assert 0.99 * ran <= blocks.every[r] <= 1.15 * ran, (seed, r, ran, blocks.every[r])


def test_windowed_blocks_are_an_estimate_of_the_right_size() -> None:
    metas = _dense(2, [3000, 4096], 4096, "round_robin")
    blocks = plan_facts(metas[0], True, 300, blocks=True).blocks
    assert blocks is not None and not blocks.exact
    for r, meta in enumerate(metas):
        local, remote = attention_plan(meta).all_gather_split(True, 300, CPU)
        ran = _plan_blocks(local) + _plan_blocks(remote)
        assert 0.5 * ran <= blocks.every[r] <= 2.0 * ran, (r, ran, blocks.every[r])


def _facts_and_shape() -> tuple[object, CallShape]:
    metas = _dense(4, [1000, 3000, 2100], 4096, "round_robin")
    return plan_facts(metas[0], blocks=True), CallShape(3, 8, 2, 16, 4)


BASE = CostModel(compute_rate=1e10, link_bandwidth=1e9, latency=1e-4, overlap=0.1)


def test_block_rate_charges_every_method_its_blocks() -> None:
    facts, shape = _facts_and_shape()
    bare, slow = (
        method_costs(facts, shape, BASE),
        method_costs(facts, shape, dataclasses.replace(BASE, block_rate=1e6)),
    )
    b = facts.blocks
    per = shape.batch / facts.meta_rows * shape.q_heads * 3.5 / 1e6
    for m in ("all_gather", "ring", "selective"):
        assert slow[m] > bare[m], m
        assert slow[m] - bare[m] <= b.every.max() * per * (1 + 1e-9), m
    assert slow["ulysses"] - bare["ulysses"] == pytest.approx(b.stream * per / 4, rel=1e-9)
    assert method_costs(dataclasses.replace(facts, blocks=None), shape, BASE) == bare


def test_gather_and_all_to_all_bandwidths_charge_only_their_method() -> None:
    facts, shape = _facts_and_shape()
    bare = method_costs(facts, shape, BASE)
    gathered = method_costs(facts, shape, dataclasses.replace(BASE, gather_bandwidth=1e8))
    a2a = method_costs(facts, shape, dataclasses.replace(BASE, all_to_all_bandwidth=1e8))
    slot = 2 * shape.kv_heads * shape.head_dim * shape.batch
    want = 4 * facts.local_len * slot * (shape.itemsize + 4) / 1e8
    assert gathered["all_gather"] - bare["all_gather"] == pytest.approx(want, rel=1e-9)
    assert a2a["ulysses"] > bare["ulysses"]
    for m in ("ring", "selective", "ulysses"):
        assert gathered[m] == bare[m], m
    for m in ("all_gather", "ring", "selective"):
        assert a2a[m] == bare[m], m


def test_default_model_charges_none_of_the_cpu_terms() -> None:
    facts, shape = _facts_and_shape()
    model = CostModel()
    assert model.block_rate == model.gather_bandwidth == model.all_to_all_bandwidth == math.inf
    assert method_costs(facts, shape, model) == method_costs(
        dataclasses.replace(facts, blocks=None), shape, model
    )


@pytest.mark.parametrize("name", ["block_rate", "gather_bandwidth", "all_to_all_bandwidth"])
@pytest.mark.parametrize("value", [0.0, -1.0, float("nan")])
def test_cpu_terms_are_validated(name: str, value: float) -> None:
    with pytest.raises(ValueError, match=f"{name} must be > 0 .*math.inf for no cost"):
        CostModel(**{name: value})


@pytest.mark.parametrize("name", ["block_rate", "gather_bandwidth", "all_to_all_bandwidth"])
def test_cpu_terms_scale_with_the_share_and_are_fittable(name: str) -> None:
    model = dataclasses.replace(BASE, **{name: 1e8})
    assert getattr(model.scaled(0.5), name) == 5e7
    assert name in FIT_RATES
    facts, shape = _facts_and_shape()
    truth = dataclasses.replace(BASE, **{name: 3e7})
    measured = method_costs(facts, shape, truth)
    got = fit_rates([Sample("x", facts, shape, measured)], model, (name,))  # type: ignore[arg-type]
    assert getattr(got, name) == pytest.approx(3e7, rel=1e-3)


def test_blocks_are_counted_only_when_asked_and_then_cached() -> None:
    meta = _dense(2, [1000, 3000], 4096, "round_robin")[0]
    bare = plan_facts(meta)
    assert bare.blocks is None
    counted = plan_facts(meta, blocks=True)
    assert counted.blocks is not None
    np.testing.assert_array_equal(counted.pairs, bare.pairs)
    assert plan_facts(meta) is counted and plan_facts(meta, blocks=True) is counted
    fresh = plan_facts(_dense(2, [1000, 3000], 4096, "round_robin")[0], blocks=True)
    assert fresh.blocks is not None
    np.testing.assert_array_equal(fresh.blocks.every, counted.blocks.every)
    assert not CostModel().needs_blocks() and CostModel.cpu_gloo().needs_blocks()
