"""Interleaved A/B of the all_gather attention method against an earlier version of itself.

The shared 2-core machine disturbs one-after-another runs by more than the effect being measured,
so this benchmark times the candidates in the SAME two gloo ranks, round after round (order
reversed every other round, a barrier before each step, the slowest rank's time per step):

* ``old all_gather``: ``all_gather_attention`` from another file (``--old``, e.g. the version
  before the overlap: ``git show ebe01f6:src/cpshard/attention/all_gather.py > /tmp/old_ag.py``),
  called with the whole-stream plan as it was then;
* ``all_gather``: this tree's method (collectives overlapped with the own-key pieces);
* ``ring``: the control.

Workload as in ``bench_packed_attention.py --part cp`` (S=16384 packed documents, fp32, D=64,
fwd+bwd, ``balanced`` or ``packed`` layout). Prints min and median seconds per candidate and every
round's times.

Usage::

    git show ebe01f6:src/cpshard/attention/all_gather.py > /tmp/old_ag.py
    OMP_NUM_THREADS=1 PYTHONPATH=src python benchmarks/bench_all_gather_overlap.py \\
        --old /tmp/old_ag.py --layout packed --rounds 10
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
import sys
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_packed_attention import _batch, _inputs


def _load(path: str) -> Any:
    spec = importlib.util.spec_from_file_location("old_all_gather", path)
    if spec is None or spec.loader is None:
        raise ValueError(f"--old must name a Python file, got {path!r}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _rank(mesh: Any, s: int, hq: int, hkv: int, layout: str, rounds: int, old: str) -> Any:
    import torch

    from cpshard import make_cp_batch_and_ctx
    from cpshard._comm import all_reduce_sum_, cp_group
    from cpshard.attention.all_gather import all_gather_attention
    from cpshard.attention.plan import attention_plan
    from cpshard.attention.ring import ring_attention

    previous = _load(old)
    _, _, sharder = make_cp_batch_and_ctx(mesh, _batch(s), layout=layout, attention="all_gather")
    meta = sharder.token_meta
    assert meta is not None
    plan = attention_plan(meta)
    cpu = torch.device("cpu")
    whole = plan.all_gather(True, None, cpu)
    local, remote = plan.all_gather_split(True, None, cpu)
    rings = plan.ring(True, None, cpu)
    group = cp_group(mesh)
    q, k, v, go = _inputs(meta.local_len, hq, hkv)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    sc = 1.0 / 8

    def run_old() -> Any:
        return previous.all_gather_attention(q, k, v, whole, group, scale=sc)

    def run_new() -> Any:
        return all_gather_attention(q, k, v, local, remote, group, scale=sc)

    def run_ring() -> Any:
        return ring_attention(q, k, v, rings, group, scale=sc)

    fns = {"old all_gather": run_old, "all_gather": run_new, "ring": run_ring}
    times: dict[str, list[float]] = {name: [] for name in fns}
    for fn in fns.values():
        fn().backward(go)  # warm-up
    world = mesh.size()
    for r in range(rounds):
        for name in list(fns) if r % 2 == 0 else list(reversed(fns)):
            all_reduce_sum_(torch.zeros(1), group)  # barrier
            t0 = time.perf_counter()
            fns[name]().backward(go)
            t = torch.zeros(world)
            t[mesh.get_local_rank()] = time.perf_counter() - t0
            times[name].append(float(all_reduce_sum_(t, group).max()))
    return times


def main() -> None:
    from cpshard.names import PACKED_LAYOUTS  # here, like torch

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--old", required=True, help="file with the earlier all_gather_attention")
    parser.add_argument("--layout", default="packed", choices=PACKED_LAYOUTS)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--heads", default="8/8")
    parser.add_argument("--seq", type=int, default=16384)
    args = parser.parse_args()
    from cpshard.launch import run_local_ranks

    hq, hkv = (int(x) for x in args.heads.split("/"))
    print(f"load average before: {' / '.join(f'{x:.2f}' for x in os.getloadavg())}", flush=True)
    times = run_local_ranks(
        2, _rank, args.seq, hq, hkv, args.layout, args.rounds, os.path.abspath(args.old),
        timeout_s=3600, pg_timeout_s=3600,
    )[0]  # fmt: skip
    print("| layout | Hq/Hkv | method | min s | median s | every round s |")
    print("|---|---|---|---|---|---|")
    for name, ts in times.items():
        print(
            f"| {args.layout} | {hq}/{hkv} | {name} | {min(ts):.3f} | {statistics.median(ts):.3f} "
            f"| {' '.join(f'{t:.2f}' for t in ts)} |"
        )


if __name__ == "__main__":
    main()
