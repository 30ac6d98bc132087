"""CP attention benchmark: fwd+bwd time, bytes sent and peak memory, cp=2 vs one process.

Every measurement runs in freshly forked processes (``cpshard.launch.run_local_ranks``, so peak RSS
is per measurement): one process with 2 threads on the full sequence
(``F.scaled_dot_product_attention(is_causal=True)``, the fastest single-process path), or 2 gloo
ranks with 1 thread each running ``cpshard.attention.cp_sdpa`` on
round_robin shards. Efficiency is ``t_single / t_cp``: 1.0 means perfect 2x scaling of the work.

Memory, two measures per process (max over ranks):

* peak RSS delta: ``ru_maxrss`` minus the RSS before the inputs were made; crude (inputs included,
  glibc keeps freed blocks, gloo buffers, allocator slack).
* tensor allocations (:func:`_alloc_profile`): one extra, untimed fwd+bwd step under
  ``torch.profiler(profile_memory=True)``, which records every CPU tensor allocation and free made
  on the calling thread (inside kernels too). From that sequence: *peak* live bytes allocated during
  the step (inputs excluded, output and gradients included) and *saved* bytes still live when the
  backward starts (the output plus what the forward keeps for the backward: the activation memory).

Usage::

    OMP_NUM_THREADS=1 PYTHONPATH=src python benchmarks/bench_attention.py [--long] [--out FILE]
"""

from __future__ import annotations

import argparse
import os
import platform
import resource
import time
from typing import Any

ACC_BYTES = 4  # gradients travel in fp32 accumulators


def _cpu_name() -> str:
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.machine()


def _rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def _peak_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _inputs(s: int, hq: int, hkv: int, d: int) -> tuple[Any, ...]:
    import torch

    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, hq, s, d, generator=g)
    k = torch.randn(1, hkv, s, d, generator=g)
    v = torch.randn(1, hkv, s, d, generator=g)
    go = torch.randn(1, hq, s, d, generator=g)
    return q, k, v, go


_BWD = "cpshard_bench_backward"


def _alloc_profile(fwd: Any, bwd: Any) -> tuple[float, float]:
    """``(peak, saved)`` MB of CPU tensor allocations in one fwd+bwd step, from the profiler.

    ``peak``: the maximum over the step of (bytes allocated - bytes freed) since its start.
    ``saved``: that running sum when the backward starts (output + tensors kept for backward).
    Allocations of other threads (gloo's, OpenMP workers') are not recorded; CPU SDPA allocates
    its buffers on the calling thread.
    """
    from torch._C._profiler import _EventType
    from torch.profiler import ProfilerActivity, profile, record_function

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        o = fwd()
        with record_function(_BWD):
            bwd(o)
        del o
    allocs: list[tuple[int, int]] = []
    bwd_start: int | None = None
    stack = list(prof.profiler.kineto_results.experimental_event_tree())  # type: ignore[union-attr]
    while stack:
        node = stack.pop()
        if node.tag == _EventType.Allocation and node.extra_fields.device.type == "cpu":
            allocs.append((node.start_time_ns, node.extra_fields.alloc_size))
        elif node.name == _BWD and bwd_start is None:
            bwd_start = node.start_time_ns
        stack.extend(node.children)
    assert bwd_start is not None
    allocs.sort()
    cur = peak = 0
    saved = None
    for t, size in allocs:
        if saved is None and t >= bwd_start:
            saved = cur
        cur += size
        peak = max(peak, cur)
    return peak / 2**20, (cur if saved is None else saved) / 2**20


def _time(fn: Any, reps: int, sync: Any = None) -> float:
    fn()  # warm-up
    times = []
    for _ in range(reps):
        if sync is not None:
            sync()
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)  # the machine is shared: the minimum is the least disturbed step


def _single(mesh: Any, cfg: dict[str, int], reps: int, threads: int) -> tuple[float, ...]:
    """One process on the full sequence (``mesh`` is the launcher's 1-rank mesh, unused)."""
    import torch
    import torch.nn.functional as F

    torch.set_num_threads(threads)
    rss0 = _rss_mb()
    q, k, v, go = _inputs(cfg["s"], cfg["hq"], cfg["hkv"], cfg["d"])
    q, k, v = (t.requires_grad_() for t in (q, k, v))

    def fwd() -> Any:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)

    def bwd(o: Any) -> None:
        o.backward(go)

    t = _time(lambda: bwd(fwd()), reps)
    rss = _peak_mb() - rss0
    for x in (q, k, v):
        x.grad = None
    return (0, t, rss, *_alloc_profile(fwd, bwd), 1.0)


def _rank(mesh: Any, cfg: dict[str, int], method: str, reps: int) -> tuple[float, ...]:
    import torch
    import torch.distributed as dist

    from cpshard.attention import cp_sdpa
    from cpshard.attention.plan import attention_plan
    from cpshard.layouts.closed_form import RoundRobinLayout
    from cpshard.sharding.meta import TokenMeta

    rank = mesh.get_local_rank()
    group = mesh.get_group()
    rss0 = _rss_mb()
    s = cfg["s"]
    rmap = RoundRobinLayout().rank_map(2, s)
    stream = rmap.reshape(1, -1)
    meta = TokenMeta(rank, 2, stream, torch.zeros_like(stream))
    computed, needed = attention_plan(meta).pair_counts(method)
    # local shards only (values do not matter for timing), so the peak RSS is the rank's own
    ql, kl, vl, gl = _inputs(s // 2, cfg["hq"], cfg["hkv"], cfg["d"])
    ql, kl, vl = (t.requires_grad_() for t in (ql, kl, vl))

    def fwd() -> Any:
        return cp_sdpa(ql, kl, vl, group=group, meta=meta, method=method, causal=True)

    def bwd(o: Any) -> None:
        o.backward(gl)

    t = _time(lambda: bwd(fwd()), reps, sync=dist.barrier)
    dist.barrier()
    rss = _peak_mb() - rss0
    for x in (ql, kl, vl):
        x.grad = None
    dist.barrier()
    return (rank, t, rss, *_alloc_profile(fwd, bwd), computed / needed)


def _run(target: Any, nprocs: int, *args: Any) -> tuple[float, float, float, float, float]:
    from cpshard.launch import run_local_ranks

    res = run_local_ranks(nprocs, target, *args, timeout_s=1800, pg_timeout_s=600)
    return (
        max(r[1] for r in res),
        max(r[2] for r in res),
        max(r[3] for r in res),
        max(r[4] for r in res),
        max(r[5] for r in res),
    )


def comm_bytes(method: str, c: int, cfg: dict[str, int], itemsize: int) -> tuple[int, int]:
    """Bytes one rank sends per layer (forward, backward), from the shapes handed to ``_comm``.

    ring: ``C-1`` K/V hops forward; ``C-1`` K/V hops + ``C`` fp32 dK/dV hops backward.
    all_gather: ring all-gather of K/V forward; fp32 reduce-scatter of dK/dV backward.
    ulysses: all-to-all of q,k,v and of the output forward; of dout and fp32 dq,dk,dv backward.
    """
    s, hq, hkv, d = cfg["s"], cfg["hq"], cfg["hkv"], cfg["d"]
    local = s // c
    kv = 2 * hkv * local * d
    if method == "ring":
        return (c - 1) * kv * itemsize, (c - 1) * kv * itemsize + c * kv * ACC_BYTES
    if method == "all_gather":
        return (c - 1) * kv * itemsize, (c - 1) * kv * ACC_BYTES
    frac = (c - 1) / c
    fwd = frac * (hq + 2 * hkv + hq) * local * d * itemsize
    bwd = frac * (hq * local * d * itemsize + (hq + 2 * hkv) * local * d * ACC_BYTES)
    return int(fwd), int(bwd)


def main() -> None:
    from cpshard.names import METHOD_NAMES  # here, like torch: workers import what they need

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--long", action="store_true", help="also S=16384 (several minutes)")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--methods", default=",".join(METHOD_NAMES), help="comma-separated subset")
    parser.add_argument(
        "--out", default="attention.md", help="markdown file; its tables go into BENCHMARKS.md"
    )
    args = parser.parse_args()
    import torch

    load = " / ".join(f"{x:.2f}" for x in os.getloadavg())
    seqs = [4096, 16384] if args.long else [4096]
    rows = []
    for s in seqs:
        reps = min(args.reps, 2) if s > 8192 else args.reps
        for hq, hkv in ((8, 8), (8, 2)):
            cfg = {"s": s, "hq": hq, "hkv": hkv, "d": 64}
            t1, *m1 = _run(_single, 1, cfg, reps, 2)
            t0, *m0 = _run(_single, 1, cfg, reps, 1)
            base = m1[1]
            rows.append((s, f"{hq}/{hkv}", "single, 2 threads", t1, 1.0, t0 / (2 * t1), 0, 0, *m1,
                         1.0))  # fmt: skip
            rows.append((s, f"{hq}/{hkv}", "single, 1 thread", t0, t1 / t0, 0.5, 0, 0, *m0,
                         m0[1] / base))  # fmt: skip
            print(rows[-2:], flush=True)
            formula = (2 - 1) / 2 * s * 2 * hkv * 64 * 4
            for method in args.methods.split(","):
                t2, *m2 = _run(_rank, 2, cfg, method, reps)
                fwd_b, _ = comm_bytes(method, 2, cfg, 4)
                rows.append(
                    (s, f"{hq}/{hkv}", f"cp=2 {method}", t2, t1 / t2, t0 / (2 * t2), fwd_b,
                     formula, *m2, m2[1] / base)
                )  # fmt: skip
                print(rows[-1], flush=True)
    head = (
        "| S | Hq/Hkv | run | fwd+bwd s | efficiency t_single/t_cp | per-core efficiency "
        "t_1thread/(2 t) | fwd MB sent/rank/layer | formula (C-1)/C*S*2*Hkv*D*b MB "
        "| peak RSS delta MB/rank | tensor peak MB/rank | saved at bwd start MB/rank "
        "| tensor peak / single | pairs computed / needed |\n"
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|\n"
    )
    body = "".join(
        f"| {s} | {h} | {name} | {t:.3f} | {eff:.2f} | {core:.2f} | {b / 2**20:.2f} "
        f"| {f / 2**20:.2f} | {m:.0f} | {peak:.1f} | {saved:.1f} | {ratio:.2f} | {pairs:.3f} |\n"
        for s, h, name, t, eff, core, b, f, m, peak, saved, pairs, ratio in rows
    )
    cmd = "OMP_NUM_THREADS=1 PYTHONPATH=src python benchmarks/bench_attention.py" + (
        " --long" if args.long else ""
    )
    text = (
        "# CP attention benchmark\n\n"
        f"Command: `{cmd}`\n\n"
        f"Machine: {os.cpu_count()} vCPU {_cpu_name()}, "
        f"torch {torch.__version__}, B=1, D=64, fp32, round_robin layout, causal, one document.\n"
        "Single = one process, 2 threads, `F.scaled_dot_product_attention(is_causal=True)` on the "
        "full sequence; cp=2 = two gloo ranks, 1 thread each, `cp_sdpa`. Times are the minimum of "
        f"{args.reps} (S=4096) / {min(args.reps, 2)} (S=16384) steps after a warm-up, max over "
        f"ranks. Load average before the run: {load}.\n\n" + head + body
    )
    print(text)
    with open(args.out, "w") as f:
        f.write(text)


if __name__ == "__main__":
    main()
