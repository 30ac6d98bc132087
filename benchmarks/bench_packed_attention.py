"""Packed-document attention benchmark: cost of the per-batch plan vs a per-document SDPA loop.

Documents: log-normal lengths (median ~245 tokens) plus three 1-token documents and one or more
documents of >= 5k tokens, shuffled, filling exactly ``S`` tokens (fixed seed).

Parts (each measurement in a freshly forked process, fwd+bwd, fp32, D=64, H=8 and GQA 8/2):

* ``single``: one process, 1 thread: ``cp_sdpa(group=None)`` on the packed row (plan built
  beforehand, as at shard time) vs a loop of ``F.scaled_dot_product_attention(is_causal=True)``
  per document over ``torch.split`` views (one concatenation in the backward). Time ratio and
  peak-memory ratios (tensor-allocation peak of one step from ``torch.profiler``; peak RSS
  delta) cpshard / loop.
* ``cp``: ``C`` gloo ranks (1 thread each, on the 2 cores) shard the batch with the ``balanced``
  or ``packed`` layout through ``make_cp_batch_and_ctx`` and run ``cp_sdpa`` per method.
  Efficiency = t(one process, per-document loop, 2 threads; least disturbed of one measurement
  per layout) / t(slowest rank); per-core efficiency = t(the loop, 1 thread) / (2 t(slowest
  rank)), which a busy shared machine disturbs less (one thread keeps its core more often).
  Balance: every rank's own attention work (its plan against the full K/V stream, fwd+bwd, no
  collectives) timed one after another in one process with 1 thread; max / mean over ranks.

Every row reports "query-key pairs computed / pairs needed" from the plan (1.0 is the limit).

Usage::

    OMP_NUM_THREADS=1 PYTHONPATH=src python benchmarks/bench_packed_attention.py \\
        --part single --seqs 16384,65536
    OMP_NUM_THREADS=1 PYTHONPATH=src python benchmarks/bench_packed_attention.py --part cp
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Any

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_attention import _alloc_profile, _peak_mb, _rss_mb


def doc_lengths(s: int, seed: int = 0) -> list[int]:
    """Log-normal document lengths incl. three 1-token and >= 5k-token documents, sum ``s``."""
    if s < 8192:
        raise ValueError(f"S must be >= 8192 to hold a >= 5k-token document, got {s}")
    rng = np.random.default_rng(seed)
    lens = [1, 1, 1] + [5000 + int(rng.integers(0, 1000)) for _ in range(max(1, s // 16384))]
    while sum(lens) < s:
        lens.append(int(max(2, rng.lognormal(5.5, 1.3))))
    lens[-1] -= sum(lens) - s
    lens = [n for n in lens if n > 0]
    rng.shuffle(lens)
    return lens


def _inputs(s: int, hq: int, hkv: int) -> tuple[Any, ...]:
    import torch

    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, hq, s, 64, generator=g)
    k = torch.randn(1, hkv, s, 64, generator=g)
    v = torch.randn(1, hkv, s, 64, generator=g)
    go = torch.randn(1, hq, s, 64, generator=g)
    return q, k, v, go


def _time(fn: Any, reps: int, sync: Any = None) -> float:
    fn()
    best = float("inf")
    for _ in range(reps):
        if sync is not None:
            sync()
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best  # shared machine: the least disturbed step


def _single(mesh: Any, s: int, hq: int, hkv: int, which: str, threads: int, reps: int) -> Any:
    import torch
    import torch.nn.functional as F

    from cpshard.attention import cp_sdpa
    from cpshard.attention.plan import attention_plan
    from cpshard.sharding.meta import TokenMeta

    torch.set_num_threads(threads)
    lens = doc_lengths(s)
    docs = torch.from_numpy(np.repeat(np.arange(len(lens)), lens))[None].long()
    meta = TokenMeta(0, 1, torch.arange(s)[None], docs)
    plan = attention_plan(meta)
    computed, needed = plan.pair_counts("all_gather")
    rss0 = _rss_mb()
    q, k, v, go = _inputs(s, hq, hkv)
    q, k, v = (t.requires_grad_() for t in (q, k, v))

    def fwd() -> Any:
        if which == "loop":
            # split (not slicing): its backward is one concatenation, not a zero-filled
            # full-size gradient per document
            outs = [
                F.scaled_dot_product_attention(qd, kd, vd, is_causal=True, enable_gqa=True)
                for qd, kd, vd in zip(
                    q.split(lens, dim=2), k.split(lens, dim=2), v.split(lens, dim=2), strict=True
                )
            ]
            return torch.cat(outs, dim=2)
        return cp_sdpa(q, k, v, group=None, meta=meta, plan=plan)

    def bwd(o: Any) -> None:
        o.backward(go)

    t = _time(lambda: bwd(fwd()), reps)
    rss = _peak_mb() - rss0
    for x in (q, k, v):
        x.grad = None
    peak, _ = _alloc_profile(fwd, bwd)
    return t, rss, peak, computed / needed, len(lens)


def _fork(target: Any, *args: Any) -> Any:
    """``target(mesh, *args)`` in one freshly forked process (its own peak RSS)."""
    from cpshard.launch import run_local_ranks

    return run_local_ranks(1, target, *args, timeout_s=3600, pg_timeout_s=3600)[0]


def _batch(s: int) -> dict[str, Any]:
    import torch

    lens = doc_lengths(s)
    return {"input_ids": torch.ones(1, s, dtype=torch.long), "seq_lens": [lens]}


def _cp_rank(mesh: Any, s: int, hq: int, hkv: int, layout: str, method: str, reps: int) -> Any:
    import torch.distributed as dist

    from cpshard import make_cp_batch_and_ctx
    from cpshard._comm import cp_group
    from cpshard.attention import cp_sdpa
    from cpshard.attention.plan import attention_plan

    _, _, sharder = make_cp_batch_and_ctx(mesh, _batch(s), layout=layout, attention=method)
    meta = sharder.token_meta
    assert meta is not None
    plan = attention_plan(meta)
    computed, needed = plan.pair_counts(method)
    group = cp_group(mesh)
    q, k, v, go = _inputs(meta.local_len, hq, hkv)
    q, k, v = (t.requires_grad_() for t in (q, k, v))

    def step() -> None:
        cp_sdpa(q, k, v, group=group, meta=meta, method=method, plan=plan).backward(go)

    t = _time(step, reps, sync=dist.barrier)
    return t, computed, needed


def _balance(mesh: Any, s: int, hq: int, hkv: int, layout: str, world: int, reps: int) -> Any:
    """Every rank's own attention work (all_gather plan, fwd+bwd), one after another."""
    import torch

    from cpshard.attention.blockwise import attend, attend_backward
    from cpshard.attention.plan import attention_plan
    from cpshard.layouts.balanced import plan_balanced
    from cpshard.layouts.documents import PackSpec
    from cpshard.layouts.packed import plan_packed
    from cpshard.sharding.meta import TokenMeta, pad_document_ids

    torch.set_num_threads(1)
    spec = PackSpec.from_seq_lens([doc_lengths(s)], s)
    lay = plan_balanced(spec, world) if layout == "balanced" else plan_packed(spec, world)
    order = lay.rank_map.reshape(1, -1)
    docs = pad_document_ids(lay.stream_document_ids[None], lay.stream_padding_mask[None])
    docs = docs.index_select(1, order[0])
    n = order.shape[1] // world
    q_all, k_all, v_all, go_all = _inputs(order.shape[1], hq, hkv)
    times = []
    for r in range(world):
        meta = TokenMeta(r, world, order, docs)
        pp = attention_plan(meta).all_gather(True, None, torch.device("cpu"))
        q, go = q_all[:, :, r * n : (r + 1) * n], go_all[:, :, r * n : (r + 1) * n]

        def work(q: Any = q, go: Any = go, pp: Any = pp) -> None:
            o, lse = attend(q, k_all, v_all, pp, scale=0.125)
            attend_backward(go, q, k_all, v_all, o, lse, pp, scale=0.125)

        times.append(_time(work, reps))
    return times


def main() -> None:
    from cpshard.names import METHOD_NAMES, PACKED_LAYOUTS  # here, like torch

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--part", choices=("single", "cp", "all"), default="all")
    parser.add_argument("--seqs", default="16384,65536", help="S values of the single part")
    parser.add_argument("--cp-seq", type=int, default=16384, help="S of the cp part")
    parser.add_argument("--worlds", default="2,4")
    parser.add_argument("--layouts", default=",".join(PACKED_LAYOUTS))
    parser.add_argument("--methods", default=",".join(METHOD_NAMES))
    parser.add_argument("--heads", default="8/8,8/2")
    parser.add_argument("--reps", type=int, default=2)
    args = parser.parse_args()
    from cpshard.launch import run_local_ranks

    print(f"load average before: {' / '.join(f'{x:.2f}' for x in os.getloadavg())}", flush=True)
    heads = [tuple(int(x) for x in h.split("/")) for h in args.heads.split(",")]
    if args.part in ("single", "all"):
        print("| S | docs | Hq/Hkv | loop s | cpshard s | time ratio | loop tensor peak MB "
              "| cpshard tensor peak MB | memory ratio | RSS delta loop / cpshard MB "
              "| pairs computed / needed |")  # fmt: skip
        print("|---|---|---|---|---|---|---|---|---|---|---|")
        for s in (int(x) for x in args.seqs.split(",")):
            reps = args.reps if s <= 16384 else 1
            for hq, hkv in heads:
                lt, lrss, lpeak, _, ndocs = _fork(_single, s, hq, hkv, "loop", 1, reps)
                ct, crss, cpeak, ratio, _ = _fork(_single, s, hq, hkv, "cpshard", 1, reps)
                print(
                    f"| {s} | {ndocs} | {hq}/{hkv} | {lt:.2f} | {ct:.2f} | {ct / lt:.2f} "
                    f"| {lpeak:.0f} | {cpeak:.0f} | {cpeak / lpeak:.2f} | {lrss:.0f} / {crss:.0f} "
                    f"| {ratio:.3f} |",
                    flush=True,
                )
    if args.part in ("cp", "all"):
        s = args.cp_seq
        print(
            "| S | Hq/Hkv | layout | cp | method | t loop 2 threads s | t loop 1 thread s "
            "| t cp slowest rank s | efficiency | per-core efficiency t_1thread/(2 t) "
            "| rank attention max/mean | pairs computed / needed (all ranks) |"
        )
        print("|---|---|---|---|---|---|---|---|---|---|---|---|")
        for hq, hkv in heads:
            base = one = float("inf")
            for layout in args.layouts.split(","):
                # the 2-thread baseline suffers most from other jobs on the 2 cores: measured
                # again before every layout, the least disturbed measurement counts
                base = min(base, _fork(_single, s, hq, hkv, "loop", 2, args.reps + 1)[0])
                one = min(one, _fork(_single, s, hq, hkv, "loop", 1, args.reps)[0])
                for world in (int(x) for x in args.worlds.split(",")):
                    times = _fork(_balance, s, hq, hkv, layout, world, args.reps)
                    imb = max(times) / (sum(times) / len(times))
                    for method in args.methods.split(","):
                        if method == "ulysses" and (hq % world or hkv % world):
                            continue
                        res = run_local_ranks(
                            world, _cp_rank, s, hq, hkv, layout, method, args.reps,
                            timeout_s=3600,
                        )  # fmt: skip
                        t = max(r[0] for r in res)
                        c = sum(r[1] for r in res)
                        n = sum(r[2] for r in res)
                        print(
                            f"| {s} | {hq}/{hkv} | {layout} | {world} | {method} | {base:.2f} "
                            f"| {one:.2f} | {t:.2f} | {base / t:.2f} | {one / (2 * t):.2f} "
                            f"| {imb:.3f} | {c / n:.3f} |",
                            flush=True,
                        )


if __name__ == "__main__":
    main()
