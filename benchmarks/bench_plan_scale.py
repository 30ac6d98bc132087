"""Host-side attention plan build time at scale (host-simulated ranks, one process).

Usage: ``python benchmarks/bench_plan_scale.py [--tokens 1048576] [--cps 8 16 32 64]
[--ranks 2] [--methods all_gather ring ulysses]``

The batch: one packed row of ``--tokens`` tokens in the realistic mix of :mod:`_mix` (the scale
benchmarks' mix, as in ``bench_scale.py``: ~1000 log-normal documents per 1M tokens, median
~460, a few of 5-6k tokens and a few of 1 token; seed 0). For every layout (``contiguous``,
``round_robin``, ``packed``, ``balanced``), CP size ``C`` and method, the token meta of rank ``r``
is built exactly as ``shard_batch_packed`` builds it, and the plan that rank's method runs is
built from scratch (``AttentionPlan(meta).for_method(...)``, causal, no window): the host work
one rank does per batch. Reported: the process CPU time of the build (the fastest of
``--repeat`` builds; CPU time, because the shared machine's load inflates wall time), max over
the ``--ranks`` ranks timed (the first and the last rank by default), its wall time, and the
number of kernel calls (tasks) of that rank's plan.
"""

from __future__ import annotations

import argparse
import functools
import platform

import torch
from _mix import describe, realistic_lens
from _timing import fastest_cpu_wall

from cpshard.attention.plan import AttentionPlan, PairPlan
from cpshard.layouts.balanced import plan_balanced
from cpshard.layouts.closed_form import ContiguousLayout, RoundRobinLayout
from cpshard.layouts.documents import PackSpec
from cpshard.layouts.packed import PackedPlan, plan_closed_form, plan_packed
from cpshard.sharding.meta import TokenMeta, pad_document_ids

LAYOUTS = ("contiguous", "round_robin", "packed", "balanced")
METHODS = ("all_gather", "ring", "ulysses")


def batch(tokens: int, seed: int = 0) -> PackSpec:
    """One packed row of ``tokens`` tokens in the realistic mix (:func:`_mix.realistic_lens`)."""
    return PackSpec.from_seq_lens([realistic_lens(tokens, seed)], tokens)


def layout_plan(spec: PackSpec, layout: str, world: int) -> PackedPlan:
    if layout == "packed":
        return plan_packed(spec, world)
    if layout == "balanced":
        return plan_balanced(spec, world)
    closed = ContiguousLayout() if layout == "contiguous" else RoundRobinLayout()
    return plan_closed_form(spec, world, closed)


def meta_of(plan: PackedPlan, rank: int) -> TokenMeta:
    """The token meta ``shard_batch_packed`` gives rank ``rank``."""
    docs = pad_document_ids(plan.stream_document_ids[None], plan.stream_padding_mask[None])
    order = plan.rank_map.reshape(1, -1)
    return TokenMeta(rank, plan.world_size, order, docs.index_select(1, order[0]))


def fresh_meta(meta: TokenMeta) -> TokenMeta:
    """The same token meta with empty caches (no tensor copied)."""
    return TokenMeta(meta.rank, meta.world_size, meta.positions, meta.document_ids)


def _tasks(plans: PairPlan | tuple[PairPlan, ...]) -> int:
    seq = plans if isinstance(plans, tuple) else (plans,)
    return sum(len(t) for p in seq for _, t in p.groups)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--tokens", type=int, default=1 << 20)
    p.add_argument("--cps", type=int, nargs="+", default=[8, 16, 32, 64])
    p.add_argument("--layouts", nargs="+", default=list(LAYOUTS))
    p.add_argument("--methods", nargs="+", default=list(METHODS))
    p.add_argument("--ranks", type=int, default=2, help="ranks timed per C (first, last, ...)")
    p.add_argument("--repeat", type=int, default=3, help="builds per rank; the fastest counts")
    a = p.parse_args()
    torch.set_num_threads(1)
    spec = batch(a.tokens)
    cpu = torch.device("cpu")
    print(f"machine: {platform.machine()}, {platform.python_version()}, torch {torch.__version__}")
    print(f"batch: one packed row, {describe(realistic_lens(a.tokens))}\n")
    print("| layout | C | method | plan build CPU s | wall s | kernel calls |")
    print("|---|---|---|---|---|---|")
    for layout in a.layouts:
        for c in a.cps:
            lp = layout_plan(spec, layout, c)
            ranks = sorted({0, c - 1, *range(0, c, max(1, c // max(1, a.ranks - 1)))})[: a.ranks]
            metas = [meta_of(lp, r) for r in ranks]
            for method in a.methods:
                worst, calls = 0.0, 0
                worst_wall = 0.0
                for meta in metas:
                    # a fresh meta per build: the host copy cached on a meta is part of the plan
                    cpu_s, wall_s, plans = fastest_cpu_wall(
                        functools.partial(fresh_meta, meta),
                        lambda m, method=method: AttentionPlan(m).for_method(
                            method, True, None, cpu
                        ),
                        a.repeat,
                    )
                    if cpu_s >= worst:
                        worst, worst_wall, calls = cpu_s, wall_s, _tasks(plans)
                print(f"| {layout} | {c} | {method} | {worst:.3f} | {worst_wall:.3f} | {calls} |",
                      flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
