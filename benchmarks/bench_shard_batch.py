"""``make_cp_batch_and_ctx`` per rank (the attention plan included) vs a bare ``index_select``.

Usage: ``python benchmarks/bench_shard_batch.py [--batch 8] [--seq 32768] [--ranks 2]
[--repeat 30]``

Two batches of ``[B, S]`` ``input_ids`` + ``labels`` (int64):

* ``dense padded``: every row keeps a random real length in ``[S/4, S]`` and pads the rest
  (``attention_mask``), round_robin layout: the padding stretches are what the plan must not
  turn into one document per token;
* ``packed``: the same tokens as one packed batch (``seq_lens`` per row, log-normal documents
  with the row end padding), balanced layout.

Both with the batch check off (``check_consistency=False``, so the time is the sharding and the
plan) and on. ``bare`` is one ``index_select`` per key with precomputed indices: the floor.
Reported on rank 0, gloo ranks, 1 thread each: the median process CPU time with the check off
(no collective then, so it is the work itself, whatever the machine's load), and the median wall
times of interleaved runs (ours, bare, ours, ...).
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time
from typing import Any

import numpy as np
import torch
from _timing import paired_median_times
from torch.distributed.device_mesh import DeviceMesh

import cpshard
from cpshard.launch import run_local_ranks
from cpshard.tools.balance import LOGNORMAL_MU, LOGNORMAL_SIGMA


def _batches(b: int, s: int) -> dict[str, dict[str, Any]]:
    rng = np.random.default_rng(0)
    ids = torch.from_numpy(rng.integers(1, 32000, size=(b, s)))
    real = rng.integers(s // 4, s + 1, size=b)
    keep = torch.arange(s)[None] < torch.from_numpy(real)[:, None]
    seq_lens = []
    for n in real.tolist():
        lens, total = [], 0
        while total < n:
            d = min(
                n - total, max(1, round(float(np.exp(rng.normal(LOGNORMAL_MU, LOGNORMAL_SIGMA)))))
            )
            lens.append(d)
            total += d
        seq_lens.append(lens)
    labels = ids.masked_fill(~keep, -100)
    return {
        "dense padded": {"input_ids": ids, "labels": labels, "attention_mask": keep.long()},
        "packed": {"input_ids": ids, "labels": labels, "seq_lens": seq_lens},
    }


def _bench(cp_mesh: DeviceMesh, b: int, s: int, repeat: int) -> list[dict[str, Any]]:
    torch.set_num_threads(1)
    rows = []
    for name, batch in _batches(b, s).items():
        layout = "balanced" if name == "packed" else "round_robin"
        _, out, sharder = cpshard.make_cp_batch_and_ctx(cp_mesh, batch, layout=layout)
        local = sharder.rank_map[cp_mesh.get_local_rank()]  # type: ignore[index]
        flat = {k: v.reshape(1, -1) if name == "packed" else v for k, v in batch.items()
                if isinstance(v, torch.Tensor)}  # fmt: skip

        def bare(flat: dict[str, torch.Tensor] = flat, local: torch.Tensor = local) -> None:
            for v in flat.values():
                v.index_select(1, local.clamp(max=v.shape[1] - 1))

        def ours(check: bool, batch: dict[str, Any] = batch, layout: str = layout) -> None:
            cpshard.make_cp_batch_and_ctx(cp_mesh, batch, layout=layout, check_consistency=check)

        t_off, t_on, t_bare = paired_median_times(
            [lambda: ours(False), lambda: ours(True), bare],
            repeat=repeat,
            sync=lambda: torch.distributed.barrier(group=cp_mesh.get_group()),
        )
        # CPU time of this process (no collective with the check off): the work itself, which
        # the shared machine's load does not inflate
        cpu_off, cpu_bare = [], []
        for _ in range(repeat):
            t0 = time.process_time()
            ours(False)
            cpu_off.append(time.process_time() - t0)
            t0 = time.process_time()
            bare()
            cpu_bare.append(time.process_time() - t0)
        rows.append({
            "batch": name, "off": t_off * 1e3, "on": t_on * 1e3, "bare": t_bare * 1e3,
            "cpu_off": statistics.median(cpu_off) * 1e3,
            "cpu_bare": statistics.median(cpu_bare) * 1e3,
        })  # fmt: skip
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=32768)
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--repeat", type=int, default=30)
    a = p.parse_args()
    print(f"machine: {platform.machine()}, torch {torch.__version__}; B={a.batch}, S={a.seq}, "
          f"cp={a.ranks}, gloo, 1 thread per rank")  # fmt: skip
    print("| batch | make_cp_batch_and_ctx CPU ms (check off) | bare index_select CPU ms "
          "| wall ms: check off / on / bare |")  # fmt: skip
    print("|---|---|---|---|")
    for r in run_local_ranks(a.ranks, _bench, a.batch, a.seq, a.repeat)[0]:
        print(f"| {r['batch']} | {r['cpu_off']:.2f} | {r['cpu_bare']:.2f} | "
              f"{r['off']:.2f} / {r['on']:.2f} / {r['bare']:.2f} |")  # fmt: skip


if __name__ == "__main__":
    main()
