"""Plan a cluster run on a laptop: per layout and method, the work, the bytes and the modelled time.

For one packed batch and CP size ``C``, every layout's :class:`~cpshard.layouts.packed.PackedPlan`
gives the global token meta every rank would hold; from it (host work only, no ranks, no GPU):

* **pairs per rank**: visible query-key pairs the rank's kernels compute (max and mean over ranks;
  ``ulysses`` computes ``1/C`` of the heads of every pair, so its ranks are equal);
* **bytes moved vs received**: forward K/V bytes a rank receives per layer with the method (max
  over ranks), and the bytes of the remote key slots its queries see, which is what ``selective``
  receives (whole slots: a slot one meta row's queries see is received for every row); the ratio
  is the group's total moved over that total received;
* **plan ms**: wall time to build rank 0's plans of the method (fresh meta, nothing cached);
* **modelled ms**: one layer's forward + backward attention at each given link bandwidth, by the
  cost model of :mod:`cpshard.attention.cost` (its assumptions are documented there).

Import rules: the rows of ``RULES`` in tests/unit/test_architecture.py that cover this module.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from cpshard.attention.cost import CostModel, PlanFacts, method_costs, plan_facts
from cpshard.attention.methods import METHODS, method_named
from cpshard.attention.plan import AttentionPlan
from cpshard.layouts.packed import PackedPlan
from cpshard.sharding.meta import TokenMeta

__all__ = ["PLAN_COLUMNS", "MethodRow", "method_rows", "plan_meta"]

PLAN_COLUMNS: dict[str, str] = {
    "batch": "the packed batch: length distribution, tokens, sampling seed",
    "C": "CP size",
    "layout": "how tokens are assigned to ranks",
    "method": "CP attention method",
    "pairs max": "max over ranks of the query-key pairs its kernels compute (visible pairs)",
    "pairs max/mean": "that max over the mean: 1.0 is a balanced step",
    "moved MB": "max over ranks of the forward K/V MB it receives per layer (assumed shape)",
    "received MB": "max over ranks of the MB of the remote key slots its queries see (what "
    "selective receives)",
    "moved/received": "total moved over that total received, whole group (1.0: what selective "
    "moves)",
    "plan ms": "wall time to build rank 0's plans for the method (fresh meta); - when skipped",
    "model ms @ BW": "one layer's forward + backward attention at link bandwidth BW, modelled "
    "(cpshard.attention.cost)",
}


@dataclass(frozen=True)
class MethodRow:
    """One (layout, C, method) row of ``cpshard plan``.

    Attributes:
        layout: Layout label.
        world: CP size.
        method: Method name.
        pairs_max: Max over ranks of computed pairs.
        pairs_mean: Mean over ranks.
        moved_bytes: Max over ranks of forward K/V bytes received per layer.
        received_bytes: Max over ranks of the bytes of the remote key slots its queries see
            (what ``selective`` receives).
        moved_over_received: Total moved / total of those received over the group (``inf`` if
            none received but some moved, 1.0 if neither).
        plan_seconds: Rank 0's plan build time, or ``None`` when not timed.
        modelled_seconds: Modelled seconds per bandwidth, in the order given.
    """

    layout: str
    world: int
    method: str
    pairs_max: int
    pairs_mean: float
    moved_bytes: float
    received_bytes: float
    moved_over_received: float
    plan_seconds: float | None
    modelled_seconds: tuple[float, ...]


def plan_meta(plan: PackedPlan, rank: int = 0) -> TokenMeta:
    """The token meta rank ``rank`` holds for ``plan`` (as the packed sharder builds it: from
    the plan's placement)."""
    return TokenMeta.of(plan.placement(plan.rank_map.device), rank)


def _moved_slots(method: str, facts: PlanFacts, model: CostModel) -> np.ndarray:
    """Forward K/V-slot equivalents each rank receives per layer."""
    c, n = facts.world, facts.local_len
    if method == "selective":
        return facts.recv_slots.astype(np.float64)
    if method == "ulysses":  # q, k, v in and the output back, in K/V-slot units
        heads = 2 * model.q_heads + 2 * model.kv_heads
        return np.full(c, (c - 1) / c * n * heads / (2 * model.kv_heads))
    return np.full(c, float((c - 1) * n))


def method_rows(
    plan: PackedPlan,
    model: CostModel,
    bandwidths: Sequence[float],
    *,
    time_plans: bool = True,
) -> list[MethodRow]:
    """Every method's row for one layout's plan.

    Args:
        plan: The layout's packed plan.
        model: Compute rate, latency and assumed layer shape (its bandwidth is replaced by each
            of ``bandwidths``).
        bandwidths: Link bandwidths in bytes/s.
        time_plans: Build and time rank 0's plans of every method.

    Returns:
        One :class:`MethodRow` per method of the registry.
    """
    meta = plan_meta(plan)
    facts = plan_facts(meta)
    c = facts.world
    slot_bytes = 2 * model.kv_heads * model.head_dim * model.itemsize
    received = facts.recv_slots.astype(np.float64)  # selective's received slots
    shape = model.shape(1)
    costs = [
        method_costs(facts, shape, dataclasses.replace(model, link_bandwidth=bw))
        for bw in bandwidths
    ]
    rows = []
    for name in METHODS:
        if name == "ulysses":
            per_rank = np.full(c, facts.pairs.sum() / c)
        else:
            per_rank = facts.pairs.astype(np.float64)
        moved = _moved_slots(name, facts, model)
        ratio = (
            float(moved.sum() / received.sum())
            if received.sum() > 0
            else (1.0 if moved.sum() == 0 else float("inf"))
        )
        seconds = None
        if time_plans:
            fresh = plan_meta(plan)
            t0 = time.perf_counter()
            method_named(name).plans(AttentionPlan(fresh), True, None, torch.device("cpu"))
            seconds = time.perf_counter() - t0
        rows.append(
            MethodRow(
                plan.layout,
                c,
                name,
                int(per_rank.max()),
                float(per_rank.mean()),
                float(moved.max() * slot_bytes),
                float(received.max() * slot_bytes),
                ratio,
                seconds,
                tuple(cs[name] for cs in costs),
            )
        )
    return rows
