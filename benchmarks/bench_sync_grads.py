"""``cpshard.sync_grads`` vs the hand-written per-parameter all-reduce it replaces.

Usage: ``python benchmarks/bench_sync_grads.py [--hidden 256] [--layers 4] [--repeat 30]``

A TinyDecoder's gradients (fp32) are summed over a CP group of 2 and 4 gloo ranks, either by
``sync_grads`` (one flag all-reduce + one coalesced all-reduce per dtype) or by a loop of
``dist.all_reduce(p.grad)`` per parameter (what ``examples/train_cp.py`` did before). Timings are
medians of interleaved runs; the collectives per call are counted with a dispatch mode.

Before each timed call (outside the timer) every rank runs one small CP forward + backward under
``ctx()`` from zeroed gradients: ``sync_grads`` refuses gradients that no CP forward made, and a
second sync of the very gradients it summed (both would be wrong), so each call sums fresh ones.
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
    model = TinyDecoder.from_config(cfg, seed=0)  # the same weights on every rank
    params = list(model.parameters())
    group = mesh.get_group()
    gen = torch.Generator().manual_seed(0)  # the same batch on every rank
    batch = {"input_ids": torch.randint(1, cfg.vocab_size, (1, 16 * mesh.size()), generator=gen)}

    def fresh_grads() -> None:
        """One CP forward + backward from zeroed gradients (outside the timer)."""
        model.zero_grad(set_to_none=True)
        ctx, local, _ = cpshard.prepare_cp_forward(model, mesh, batch, padding_token_id=0)
        with ctx():
            logits = model(local["input_ids"], local["position_ids"])
        logits.float().pow(2).mean().backward()
        dist.barrier(group=group)

    def loop() -> None:
        for p in params:
            if p.grad is not None:  # what sync_grads sums too
                dist.all_reduce(p.grad, group=group)

    ours, bare = paired_median_times(
        [lambda: cpshard.sync_grads(model, mesh), loop],
        repeat=repeat,
        sync=fresh_grads,
    )
    fresh_grads()
    with CommBytes() as c_ours:
        cpshard.sync_grads(model, mesh)
    fresh_grads()
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
