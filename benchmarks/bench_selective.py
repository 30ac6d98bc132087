"""Selective K/V exchange at cluster scale, from the plan (host only): bytes moved vs needed.

For one packed batch of ``--tokens`` tokens (``--mix realistic``, the default: the ~1000-document
mix of ``_mix.py``; ``--mix lognormal``: ``cpshard.tools.balance``'s sampler, ~280 documents)
and each CP size and packed layout, from the global token meta every rank would hold:

* **needed**: per rank, the remote key slots its queries can see (``exchange_counts``: binary
  searches of each rank's merged visibility intervals);
* **moved (selective)**: per rank, the slots its :class:`SelectivePlan` receives (built for the
  ranks named by ``--ranks``: a mask over the stream, another code path than the counts), plus
  the header bytes: none, the split sizes come from the plan;
* **moved (all_gather / ring)**: ``(C - 1) * L`` slots per rank;
* **plan s**: process CPU time (and wall time) of rank ``r``'s selective plan (fresh meta built
  outside the timer, fastest
  of ``--repeat``, slowest of the ranks named), of the global cost facts ``plan_facts`` that
  ``attention="auto"`` reads, and of ``auto`` as a whole: the facts, the choice, and the plan of the
  method it chose (the method is printed after the times).

Part ``cp`` (``--part cp``): cp=2 gloo ranks on the packed benchmark batch of
``bench_packed_attention.py`` (S=16384, log-normal documents plus a >= 5k-token one, fp32, D=64,
fwd+bwd), every method plus ``auto`` (as the dispatcher resolves it) **interleaved**: each round
times one step of every method in turn, and the minimum over rounds counts, so a shared machine's
load disturbs all methods alike. Prints each method's time over the best of ``ring`` and
``all_gather``.

Part ``ranks``: C = 2..8 gloo ranks run one selective forward + backward on an 8192-token packed
batch; the payload bytes of each all-to-all (recorded by a benchmark-side wrapper) summed over
the ranks, over the bytes of the keys the queries see by the dense mask rule.

Usage::

    OMP_NUM_THREADS=1 PYTHONPATH=src python benchmarks/bench_selective.py \\
        --tokens 1048576 --cp 8,16,32,64
    OMP_NUM_THREADS=1 PYTHONPATH=src python benchmarks/bench_selective.py --part cp --rounds 5
    OMP_NUM_THREADS=1 PYTHONPATH=src python benchmarks/bench_selective.py --part ranks
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
import time
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _mix import describe, realistic_lens
from _timing import fastest_cpu_wall
from bench_packed_attention import _batch, _inputs


def _interleaved(
    mesh: Any, s: int, hq: int, hkv: int, layout: str, rounds: int
) -> dict[str, float]:
    """Every method (and auto's pick) timed in turn, ``rounds`` times; min per method."""
    import torch.distributed as dist

    from cpshard import make_cp_batch_and_ctx
    from cpshard._comm import cp_group
    from cpshard.attention import cp_sdpa
    from cpshard.names import METHOD_NAMES

    ctx, _, sharder = make_cp_batch_and_ctx(mesh, _batch(s), layout=layout)
    meta = sharder.token_meta
    assert meta is not None
    auto = ctx.facts.attention_method
    group = cp_group(mesh)
    q, k, v, go = _inputs(meta.local_len, hq, hkv)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    methods = [m for m in METHOD_NAMES if m != "ulysses" or (hq % 2 == 0 and hkv % 2 == 0)]
    best = {m: float("inf") for m in methods}
    for m in methods:  # warm-up: plans built, allocator grown
        cp_sdpa(q, k, v, group=group, meta=meta, method=m).backward(go)
    for _ in range(rounds):
        for m in methods:
            dist.barrier()
            t0 = time.perf_counter()
            cp_sdpa(q, k, v, group=group, meta=meta, method=m).backward(go)
            dist.barrier()
            best[m] = min(best[m], time.perf_counter() - t0)
    best["auto -> " + str(auto)] = best[str(auto)]
    return best


def _exchange_rank(mesh: Any, lens: list[int], layout: str) -> Any:
    """One selective fwd+bwd on the ranks; the payload bytes of every all-to-all it starts."""
    import cpshard.attention.selective as sel
    from cpshard import make_cp_batch_and_ctx
    from cpshard._comm import cp_group
    from cpshard.attention import cp_sdpa

    s = sum(lens)
    batch = {"input_ids": torch.ones(1, s, dtype=torch.long), "seq_lens": [lens]}
    _, _, sharder = make_cp_batch_and_ctx(mesh, batch, layout=layout, attention="selective")
    meta = sharder.token_meta
    assert meta is not None
    q, k, v, go = _inputs(meta.local_len, 4, 2)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    calls: list[int] = []
    real = sel.all_to_all_split_start

    def recording(x: torch.Tensor, *args: Any) -> Any:  # benchmark-side wrapper
        calls.append(x.numel() * x.element_size())
        return real(x, *args)

    sel.all_to_all_split_start = recording  # type: ignore[assignment]
    try:
        cp_sdpa(q, k, v, group=cp_group(mesh), meta=meta, method="selective").backward(go)
    finally:
        sel.all_to_all_split_start = real
    return calls, meta.positions[0].numpy(), meta.document_ids[0].numpy(), k.element_size()


def _ranks_part(worlds: list[int], layout: str) -> None:
    """Bytes each exchange moves on real ranks vs the dense mask rule's needed bytes."""
    from bench_packed_attention import doc_lengths

    from cpshard.launch import run_local_ranks

    lens = doc_lengths(8192)
    print("| C | layout | forward bytes moved / needed | backward bytes moved / needed |")
    print("|---|---|---|---|")
    for world in worlds:
        res = run_local_ranks(world, _exchange_rank, lens, layout, timeout_s=3600)
        pos, doc, item = res[0][1], res[0][2], res[0][3]
        n = pos.size // world
        needed = 0
        for r in range(world):  # keys off rank r that r's queries see, by the rule itself
            q = slice(r * n, (r + 1) * n)
            vis = (doc[q, None] == doc[None, :]) & (pos[q, None] >= pos[None, :])
            need = vis.any(axis=0)
            need[q] = False
            needed += int(need.sum())
        slot = 2 * 2 * 64 * item  # k and v, B=1, Hkv=2, D=64
        fwd = sum(r[0][0] for r in res)
        bwd = sum(r[0][1] for r in res)
        print(f"| {world} | {layout} | {fwd / (needed * slot):.3f} | {bwd / (needed * slot):.3f} |")


def _cp_part(rounds: int) -> None:
    from cpshard.launch import run_local_ranks
    from cpshard.names import PACKED_LAYOUTS

    print("| layout | Hq/Hkv | method | t step s (min of rounds, slowest rank) | / best of ring, "
          "all_gather |")  # fmt: skip
    print("|---|---|---|---|---|")
    for layout in PACKED_LAYOUTS:
        for hq, hkv in ((8, 8), (8, 2)):
            res = run_local_ranks(2, _interleaved, 16384, hq, hkv, layout, rounds, timeout_s=3600)
            times = {m: max(r[m] for r in res) for m in res[0]}
            ref = min(times["ring"], times["all_gather"])
            for m, t in times.items():
                print(f"| {layout} | {hq}/{hkv} | {m} | {t:.3f} | {t / ref:.2f} |", flush=True)


def _plan_row(plan: Any, tokens: int, ranks: list[int], repeat: int) -> str:
    """One table row: bytes moved vs needed, and the host time of each plan (slowest rank)."""
    from cpshard.attention.auto import choose_for_batch
    from cpshard.attention.cost import plan_facts
    from cpshard.attention.methods import method_named
    from cpshard.attention.plan import AttentionPlan
    from cpshard.attention.selective_plan import selective_plan
    from cpshard.tools.plan_cost import plan_meta

    cpu = torch.device("cpu")
    c = plan.world_size
    needed = plan_facts(plan_meta(plan)).recv_slots
    moved_sel = need_sel = 0
    t_sel = t_auto = (0.0, 0.0)
    chosen: set[str] = set()

    def auto(meta: Any) -> None:
        best = choose_for_batch(meta, None)
        chosen.add(best)
        method_named(best).plans(AttentionPlan(meta), True, None, cpu)

    for r in ranks:
        moved_sel += selective_plan(plan_meta(plan, r), True, None, cpu).received  # no header
        need_sel += int(needed[r])
        fresh = functools.partial(plan_meta, plan, r)
        got = fastest_cpu_wall(fresh, lambda m: selective_plan(m, True, None, cpu), repeat)
        t_sel = (max(t_sel[0], got[0]), max(t_sel[1], got[1]))
        got = fastest_cpu_wall(fresh, auto, repeat)
        t_auto = (max(t_auto[0], got[0]), max(t_auto[1], got[1]))
    t_facts = fastest_cpu_wall(functools.partial(plan_meta, plan), plan_facts, repeat)[:2]
    ag = (c - 1) * plan.padded_len // c * c
    ratio = moved_sel / need_sel if need_sel else float("nan")
    return (
        f"| {tokens} | {c} | {plan.layout} | {int(needed.max())} | {ratio:.3f} "
        f"| {ag / max(int(needed.sum()), 1):.1f} "
        f"| {t_sel[0]:.3f} ({t_sel[1]:.3f}) | {t_facts[0]:.3f} ({t_facts[1]:.3f}) "
        f"| {t_auto[0]:.3f} ({t_auto[1]:.3f}) {'/'.join(sorted(chosen))} |"
    )


def main() -> None:
    from cpshard.layouts.documents import PackSpec
    from cpshard.tools.balance import all_plans, sample_packed_batch

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=1 << 20)
    p.add_argument("--cp", default="8,16,32,64")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--mix", choices=("realistic", "lognormal"), default="realistic",
        help="realistic: benchmarks/_mix.py (~1000 documents per 1M tokens, median ~460); "
        "lognormal: cpshard balance's exp(N(7.5, 1.2)) (~280 documents per 1M tokens)",
    )  # fmt: skip
    p.add_argument("--ranks", default="0,last", help="ranks whose selective plan is built")
    p.add_argument("--repeat", type=int, default=3, help="plan builds per rank (fastest counts)")
    p.add_argument("--part", choices=("plan", "cp", "ranks"), default="plan")
    p.add_argument("--worlds", default="2,3,4,5,6,7,8", help="C of the ranks part")
    p.add_argument("--layout", default="balanced", help="layout of the ranks part")
    p.add_argument("--rounds", type=int, default=5)
    args = p.parse_args()
    print(f"load average before: {' / '.join(f'{x:.2f}' for x in os.getloadavg())}", flush=True)
    if args.part == "cp":
        _cp_part(args.rounds)
        return
    if args.part == "ranks":
        _ranks_part([int(x) for x in args.worlds.split(",")], args.layout)
        return
    if args.mix == "realistic":  # ~1000 documents per 1M tokens (issue 25)
        lens = realistic_lens(args.tokens, args.seed)
        print(f"mix: {describe(lens)}")
        spec = PackSpec.from_seq_lens([lens], args.tokens)
    else:
        spec = sample_packed_batch("lognormal", args.tokens, args.seed)
    print(
        "| tokens | C | layout | needed slots max/rank | selective moved / needed "
        "| all_gather moved / needed | selective plan CPU s (wall) | cost facts CPU s (wall) "
        "| auto: facts + its method's plan, CPU s (wall) |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for c in (int(x) for x in args.cp.split(",")):
        ranks = [c - 1 if r == "last" else int(r) for r in args.ranks.split(",")]
        for plan in all_plans(spec, c, include_torch=False):
            print(_plan_row(plan, args.tokens, ranks, args.repeat), flush=True)


if __name__ == "__main__":
    main()
