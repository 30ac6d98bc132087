"""The method registry, the cost model and ``auto`` (no process group)."""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch

from _attention_common import make_case, make_meta
from cpshard.attention.auto import choose_for_batch
from cpshard.attention.core import resolve_method
from cpshard.attention.cost import CallShape, CostModel, method_costs, plan_facts
from cpshard.attention.methods import METHODS, method_named, servable
from cpshard.attention.plan import AttentionPlan
from cpshard.names import ATTENTION_CHOICES, METHOD_NAMES


def test_registry_is_keyed_by_the_method_names() -> None:
    assert tuple(METHODS) == METHOD_NAMES
    assert ("auto", *METHOD_NAMES) == ATTENTION_CHOICES
    for name, m in METHODS.items():
        assert m.name == name and method_named(name) is m
    with pytest.raises(ValueError, match=r"unknown CP attention method 'zigzag'; valid methods"):
        method_named("zigzag")


def test_only_ulysses_refuses_heads_not_divisible() -> None:
    assert servable(4, 2, 2) == METHOD_NAMES
    assert "ulysses" not in servable(3, 1, 2)
    assert servable(1, 1, 1) == METHOD_NAMES
    with pytest.raises(ValueError, match="divisible by the CP size"):
        METHODS["ulysses"].check(3, 1, 2)


def _metas(layout: str, world: int, n_docs: int = 3) -> list:
    rmap, docs = make_case(layout, world, 64 * world, 1, n_docs, 0, 1)
    return [make_meta(rmap, docs, r) for r in range(world)]


def test_plan_facts_count_the_visible_pairs_and_are_the_same_on_every_rank() -> None:
    metas = _metas("random", 3)
    facts = [plan_facts(m) for m in metas]
    pos, doc = metas[0].positions[0].numpy(), metas[0].document_ids[0].numpy()
    vis = (doc[:, None] == doc[None, :]) & (pos[:, None] >= pos[None, :])
    n = metas[0].local_len
    for r in range(3):
        rows = vis[r * n : (r + 1) * n]
        assert facts[r].pairs[r] == rows.sum()
        assert facts[r].local_pairs[r] == rows[:, r * n : (r + 1) * n].sum()
        for f in facts:
            np.testing.assert_array_equal(f.pairs, facts[0].pairs)
            np.testing.assert_array_equal(f.recv_slots, facts[0].recv_slots)
            np.testing.assert_array_equal(f.send_slots, facts[0].send_slots)


def test_selective_never_modelled_slower_than_all_gather() -> None:
    """Same compute, fewer or equal bytes, same overlap rule."""
    for layout in ("contiguous", "round_robin", "random"):
        for world in (2, 4):
            facts = plan_facts(_metas(layout, world)[0])
            costs = method_costs(facts, CallShape(1, 8, 2, 64, 2), CostModel())
            assert costs["selective"] <= costs["all_gather"] + 1e-12, (layout, world, costs)


def test_auto_is_deterministic_identical_on_every_rank_and_recorded(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Decided from global facts: every rank's meta gives the same choice, and the same again."""
    for layout in ("contiguous", "round_robin", "random"):
        for world in (2, 3, 4):
            metas = _metas(layout, world)
            got = {choose_for_batch(m, None) for m in metas}
            got |= {choose_for_batch(make_meta_like(m), None) for m in metas}
            assert len(got) == 1, (layout, world, got)
            (best,) = got
            assert best in METHOD_NAMES and best != "ulysses"  # heads unknown at the dispatcher
            costs = metas[0].plan_cache["attention_costs"]
            assert costs[best] == min(costs[m] for m in servable(1, 1, world))
    # a slow link makes the selective exchange win on documents cut by the random layout
    model = CostModel(link_bandwidth=1e6)
    mesh = _Mesh()  # the log memo's key (any weakly referenceable object)
    with caplog.at_level(logging.INFO, logger="cpshard.attention"):
        for _ in range(3):
            assert choose_for_batch(_metas("random", 4, n_docs=12)[0], mesh, model) == "selective"  # type: ignore[arg-type]
        # one document in random order on a moderate link: each ring hop hides behind one remote
        # block's compute, the one exchange does not hide behind the small own-keys compute
        ring = CostModel(link_bandwidth=1e10, compute_rate=1e12)
        assert choose_for_batch(_metas("random", 4, n_docs=1)[0], mesh, ring) == "ring"  # type: ignore[arg-type]
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2 and "chose selective at cp=4" in lines[0], lines  # once per change


class _Mesh:
    pass


def make_meta_like(meta):  # type: ignore[no-untyped-def]
    """A fresh copy of ``meta`` (empty plan cache): nothing cached decides."""
    from cpshard.sharding.meta import TokenMeta

    return TokenMeta(meta.rank, meta.world_size, meta.positions.clone(), meta.document_ids.clone())


def test_auto_never_picks_a_method_that_would_refuse() -> None:
    """Contiguous causal is compute-imbalanced: with a fast link and slow compute ulysses (which
    balances every pair) is the cheapest, unless its head check refuses the call."""
    meta = _metas("contiguous", 4, n_docs=1)[0]
    plan = AttentionPlan(meta)
    model = CostModel(link_bandwidth=1e15, compute_rate=1e9, latency=0.0)
    assert resolve_method("auto", plan, CallShape(1, 8, 4, 64, 8), 4, model) == "ulysses"
    assert resolve_method("auto", plan, CallShape(1, 6, 2, 64, 8), 4, model) != "ulysses"
    assert resolve_method("ring", plan, CallShape(1, 6, 2, 64, 8), 4, model) == "ring"


def test_cost_model_rejects_bad_rates() -> None:
    with pytest.raises(ValueError, match="link_bandwidth must be > 0"):
        CostModel(link_bandwidth=0)
    with pytest.raises(ValueError, match="latency must be >= 0"):
        CostModel(latency=-1)


def test_auto_under_cp_sdpa_equals_the_method_it_picks() -> None:
    from _attention_common import inputs
    from cpshard.attention import cp_sdpa

    meta = _metas("contiguous", 1)[0]
    q, k, v, _ = inputs(1, 4, 2, meta.local_len, 8, 0)
    want = cp_sdpa(q, k, v, group=None, meta=meta, method="all_gather")
    torch.testing.assert_close(cp_sdpa(q, k, v, group=None, meta=meta), want)


def test_dispatcher_records_the_method_in_the_facts() -> None:
    import cpshard

    batch = {"input_ids": torch.ones(1, 12, dtype=torch.long), "seq_lens": [[5, 7]]}
    ctx, _, _ = cpshard.make_cp_batch_and_ctx(None, batch)  # attention="auto" by default
    assert ctx.facts.attention_method == "all_gather"  # cp=1: every method costs the same
    ctx, _, _ = cpshard.make_cp_batch_and_ctx(None, batch, attention="selective")
    assert ctx.facts.attention_method == "selective"
    with pytest.raises(TypeError, match="attention_cost must be a .*CostModel"):
        cpshard.make_cp_batch_and_ctx(None, batch, attention_cost=100e9)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="attention must be one of"):
        cpshard.make_cp_batch_and_ctx(None, batch, attention="zigzag")
