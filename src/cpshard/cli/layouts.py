"""``cpshard layouts``: shard one batch in every layout on local gloo ranks, gather it back.

Prints which global positions each rank owns (as ranges) and checks, on every rank, that
``gather_token_tensor(shard_token_tensor(x), trim=True) == x`` in the caller's coordinates.
"""

from __future__ import annotations

import argparse
from typing import Any

import torch
from torch.distributed.device_mesh import DeviceMesh

from cpshard.cli._spawn import run_local_ranks
from cpshard.dispatch import LayoutName, make_cp_batch_and_ctx
from cpshard.layouts import consecutive_runs

DENSE_LAYOUTS: tuple[LayoutName, ...] = ("round_robin", "contiguous")


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Arguments of ``cpshard layouts``."""
    p.add_argument("--ranks", type=int, default=4, help="number of local CP ranks (default 4)")
    p.add_argument("--seq-len", type=int, default=30, help="tokens per row (default 30)")


def _ranges(idx: torch.Tensor) -> str:
    return " ".join(f"[{v},{v + n})" for v, n in consecutive_runs(idx))


def _one_rank(cp_mesh: DeviceMesh, seq_len: int) -> list[dict[str, Any]]:
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 256, (2, seq_len), generator=gen)
    adv = torch.randn(2, seq_len, generator=gen)
    rows = []
    for layout in DENSE_LAYOUTS:
        _, batch, sharder = make_cp_batch_and_ctx(cp_mesh, {"input_ids": ids}, layout=layout)
        local_adv = sharder.shard_token_tensor(adv, fill=0.0)
        back = sharder.gather_token_tensor(local_adv, trim=True)
        ids_back = sharder.gather_token_tensor(batch["input_ids"], trim=True)
        assert sharder.rank_map is not None
        rows.append(
            {
                "layout": sharder.layout,
                "padded": sharder.padded_seq_len,
                "owned": _ranges(sharder.rank_map[cp_mesh.get_local_rank()]),
                "ok": bool(torch.equal(back, adv) and torch.equal(ids_back, ids)),
            }
        )
    return rows


def run(args: argparse.Namespace) -> int:
    """Run the demo; exit status 0 iff every round trip held on every rank."""
    results = run_local_ranks(args.ranks, _one_rank, args.seq_len)
    ok = True
    print(f"cpshard layouts: {args.ranks} gloo ranks, batch [2, {args.seq_len}]")
    for i, layout in enumerate(DENSE_LAYOUTS):
        padded = results[0][i]["padded"]
        print(f"\n{layout} (padded to {padded})")
        for rank, rows in enumerate(results):
            row = rows[i]
            ok &= row["ok"]
            status = "round trip ok" if row["ok"] else "ROUND TRIP FAILED"
            print(f"  rank {rank}: owns {row['owned']:<28} {status}")
    print("\nall round trips exact" if ok else "\nSOME ROUND TRIPS FAILED")
    return 0 if ok else 1
