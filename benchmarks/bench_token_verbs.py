"""Token verbs vs the bare operations they wrap (foundation benchmarks).

Usage: ``python benchmarks/bench_token_verbs.py [--seq 32768] [--batch 8] [--repeat 100]``

* ``shard_token_tensor`` on ``[B, S]`` fp32/bf16 vs a bare ``index_select`` with precomputed
  indices (target <= 1.2x).
* ``gather_token_tensor`` at 2 and 4 ranks vs a bare ``all_gather_single`` of the same payload
  (target <= 1.3x), with the collectives and bytes this rank hands to them.
Timings are medians of interleaved runs (ours, bare, ours, bare, ...).
"""

from __future__ import annotations

import argparse
import platform
from typing import Any

import torch
import torch.distributed as dist
from _timing import CommBytes, paired_median_times
from torch.distributed.device_mesh import DeviceMesh

import cpshard
from cpshard.launch import run_local_ranks


def _one_dtype(
    sharder: cpshard.CPSharder, group: Any, dtype: torch.dtype, batch: int, repeat: int
) -> dict[str, Any]:
    padded = sharder.padded_seq_len
    assert padded is not None
    world = sharder.cp_size
    idx = sharder._token_index(padded, torch.device("cpu")).local
    x = torch.randn(batch, padded).to(dtype)
    t_ours, t_bare = paired_median_times(
        [lambda: sharder.shard_token_tensor(x), lambda: x.index_select(1, idx)], repeat=repeat
    )
    local = sharder.shard_token_tensor(x)
    out = torch.empty(world * batch, local.shape[1], dtype=dtype)

    def bare_gather_alloc() -> None:
        dist.all_gather_single(torch.empty_like(out), local, group=group)

    g_ours, g_bare, g_alloc = paired_median_times(
        [
            lambda: sharder.gather_token_tensor(local),
            lambda: dist.all_gather_single(out, local, group=group),
            bare_gather_alloc,
        ],
        repeat=repeat,
        sync=lambda: dist.barrier(group=group),
    )
    with CommBytes() as counter:
        sharder.gather_token_tensor(local)
    return {
        "dtype": str(dtype).replace("torch.", ""),
        "shard": t_ours * 1e3,
        "index_select": t_bare * 1e3,
        "gather": g_ours * 1e3,
        "all_gather": g_bare * 1e3,
        "all_gather_alloc": g_alloc * 1e3,
        "calls": dict(counter.calls),
        "bytes": counter.bytes_in,
        "payload": local.numel() * local.element_size(),
    }


def _bench(cp_mesh: DeviceMesh, batch: int, seq: int, repeat: int) -> list[dict[str, Any]]:
    ids = torch.zeros(batch, seq, dtype=torch.long)
    _, _, sharder = cpshard.make_cp_batch_and_ctx(cp_mesh, {"input_ids": ids})
    group = cp_mesh.get_group()
    return [_one_dtype(sharder, group, dt, batch, repeat) for dt in (torch.float32, torch.bfloat16)]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--seq", type=int, default=32768)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--repeat", type=int, default=100)
    a = p.parse_args()
    print(
        f"machine: {platform.machine()}, {torch.get_num_threads()} threads in the parent, "
        f"torch {torch.__version__}; B={a.batch}, S={a.seq}, 1 thread per rank, gloo, round_robin"
    )
    print(
        "| ranks | dtype | shard ms | index_select ms | ratio | gather ms | all_gather ms "
        "(preallocated / allocating) | ratio (pre / alloc) | collectives per gather "
        "| bytes sent / payload |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for world in (2, 4):
        for r in run_local_ranks(world, _bench, a.batch, a.seq, a.repeat)[0]:
            calls = ", ".join(f"{k} x{v}" for k, v in r["calls"].items())
            print(
                f"| {world} | {r['dtype']} | {r['shard']:.3f} | {r['index_select']:.3f} | "
                f"{r['shard'] / r['index_select']:.2f}x | {r['gather']:.3f} | "
                f"{r['all_gather']:.3f} / {r['all_gather_alloc']:.3f} | "
                f"{r['gather'] / r['all_gather']:.2f}x / {r['gather'] / r['all_gather_alloc']:.2f}x"
                f" | {calls} | "
                f"{r['bytes']} / {r['payload']} |"
            )


if __name__ == "__main__":
    main()
