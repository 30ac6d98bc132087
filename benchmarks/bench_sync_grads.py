"""``cpshard.sync_grads`` vs the hand-written per-parameter all-reduce it replaces.

Usage: ``python benchmarks/bench_sync_grads.py [--hidden 256] [--layers 4] [--repeat 30]``

A TinyDecoder's gradients (fp32) are summed over a CP group of 2 and 4 gloo ranks, either by
``sync_grads`` (one flag all-reduce + one coalesced all-reduce per dtype) or by a loop of
``dist.all_reduce(p.grad)`` per parameter (what ``examples/train_cp.py`` did before). Timings are
medians of interleaved runs; the collectives per call are counted with a dispatch mode.
"""

from __future__ import annotations

import argparse
from typing import Any

import torch
import torch.distributed as dist
from _timing import CommBytes, paired_median_times
from torch.distributed.device_mesh import DeviceMesh

import cpshard
from cpshard.launch import run_local_ranks
from cpshard.models import TinyDecoder, TinyDecoderConfig


def _rank(mesh: DeviceMesh, hidden: int, layers: int, repeat: int) -> dict[str, Any]:
    cfg = TinyDecoderConfig(
        hidden_size=hidden, num_layers=layers, intermediate_size=2 * hidden, num_heads=4,
        num_kv_heads=2,
    )  # fmt: skip
    model = TinyDecoder.from_config(cfg)
    params = list(model.parameters())
    for p in params:
        p.grad = torch.randn_like(p)
    group = mesh.get_group()

    def loop() -> None:
        for p in params:
            assert p.grad is not None
            dist.all_reduce(p.grad, group=group)

    ours, bare = paired_median_times(
        [lambda: cpshard.sync_grads(model, mesh), loop],
        repeat=repeat,
        sync=lambda: dist.barrier(group=group),
    )
    with CommBytes() as c_ours:
        cpshard.sync_grads(model, mesh)
    with CommBytes() as c_bare:
        loop()
    return {
        "ranks": mesh.size(),
        "params": len(params),
        "numel": sum(p.numel() for p in params),
        "sync_grads_ms": ours * 1e3,
        "loop_ms": bare * 1e3,
        "calls_ours": sum(c_ours.calls.values()),
        "calls_loop": sum(c_bare.calls.values()),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--repeat", type=int, default=30)
    a = p.parse_args()
    print(
        "| ranks | tensors | elements | sync_grads ms | per-param loop ms | ratio "
        "| collectives ours / loop |"
    )
    print("|---|---|---|---|---|---|---|")
    for world in (2, 4):
        r = run_local_ranks(world, _rank, a.hidden, a.layers, a.repeat)[0]
        print(
            f"| {r['ranks']} | {r['params']} | {r['numel']} | {r['sync_grads_ms']:.2f} | "
            f"{r['loop_ms']:.2f} | {r['sync_grads_ms'] / r['loop_ms']:.2f}x | "
            f"{r['calls_ours']} / {r['calls_loop']} |"
        )


if __name__ == "__main__":
    main()
