"""Cost of the cross-rank consistency checks (target: <= 1 ms per batch at [8, 32768] on CPU).

Usage: ``python benchmarks/bench_consistency.py [--seq 32768] [--batch 8] [--repeat 100]
[--hashes]``

``--hashes`` prints only the one-process table of the two content hashes: the batch fingerprint
with the CPU's hash (XXH3-64 of the canonical bytes) against the same fingerprint with the
accelerator's lane hash run on the CPU (what the CPU used before), interleaved, on the batches
below and an ``inputs_embeds [1, 8192, 1024]`` fp32 batch.

Per rank count (2 and 4 gloo ranks, 1 thread each), medians of interleaved runs:

* ``fingerprint``: hashing the whole batch on this rank (``input_ids``, ``labels``,
  ``attention_mask``, and with ``+positions`` also ``position_ids``), no collective;
* ``exchange``: the one all-gather of the fixed-size fingerprint;
* ``check``: both, as ``make_cp_batch_and_ctx`` runs them (``check_batch_consistency``);
* ``shard``: the whole ``make_cp_batch_and_ctx`` with the check vs ``check_consistency=False``;
* ``verb check``: the small all-gather ``gather_token_tensor`` runs before its data all-gather.
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
from cpshard import _comm
from cpshard.sharding.consistency import (
    batch_fingerprint,
    check_batch_consistency,
    check_verb_consistency,
)


def _batch(b: int, s: int, positions: bool) -> dict[str, torch.Tensor]:
    ids = torch.randint(0, 32000, (b, s), generator=torch.Generator().manual_seed(0))
    mask = torch.ones(b, s, dtype=torch.long)
    mask[:, -s // 8 :] = 0
    out = {
        "input_ids": ids,
        "labels": cpshard.shift_labels(ids, padding_mask=mask == 0),
        "attention_mask": mask,
    }
    if positions:
        out["position_ids"] = torch.arange(s).expand(b, s)
    return out


def _bench(cp_mesh: DeviceMesh, b: int, s: int, repeat: int) -> list[dict[str, Any]]:
    group = cp_mesh.get_group()
    rows = []
    for positions in (False, True):
        batch = _batch(b, s, positions)
        kw: dict[str, Any] = {"layout": "auto", "attention": "all_gather", "padding_token_id": 0}
        fp = batch_fingerprint(batch, **kw)

        def barrier() -> None:
            dist.barrier(group=group)

        t_fp, t_ex, t_check = paired_median_times(
            [
                lambda: batch_fingerprint(batch, **kw),  # noqa: B023
                lambda: _comm.all_gather_fixed(fp, group),  # noqa: B023
                lambda: check_batch_consistency(cp_mesh, batch, **kw),  # noqa: B023
            ],
            repeat=repeat,
            sync=barrier,
        )
        t_on, t_off = paired_median_times(
            [
                lambda: cpshard.make_cp_batch_and_ctx(cp_mesh, batch),  # noqa: B023
                lambda: cpshard.make_cp_batch_and_ctx(
                    cp_mesh,
                    batch,  # noqa: B023
                    check_consistency=False,
                ),
            ],
            repeat=max(repeat // 4, 10),
            sync=barrier,
        )
        with CommBytes() as counter:
            check_batch_consistency(cp_mesh, batch, **kw)
        rows.append(
            {
                "keys": "+positions" if positions else "ids, labels, mask",
                "fingerprint": t_fp * 1e3,
                "exchange": t_ex * 1e3,
                "check": t_check * 1e3,
                "shard_on": t_on * 1e3,
                "shard_off": t_off * 1e3,
                "bytes": counter.bytes_in,
                "calls": sum(counter.calls.values()),
            }
        )
    local = torch.randn(b, s // cp_mesh.size())
    (t_verb,) = paired_median_times(
        [
            lambda: check_verb_consistency(
                cp_mesh,
                group,
                "gather_token_tensor",
                local,
                seq_dim=1,
                trim=False,
                fill=None,
                grad="sum",
            )
        ],
        repeat=repeat,
        sync=lambda: dist.barrier(group=group),
    )
    rows[0]["verb"] = t_verb * 1e3
    return rows


def _hashes(a: Any) -> None:
    """The batch fingerprint with each content hash, one process, interleaved medians."""
    from cpshard.sharding import consistency

    torch.set_num_threads(1)
    host = consistency._content_hash
    kw: dict[str, Any] = {"layout": "auto", "attention": "ring", "padding_token_id": 0}
    g = torch.Generator().manual_seed(1)
    batches = {
        "ids, labels, mask": _batch(a.batch, a.seq, False),
        "+positions": _batch(a.batch, a.seq, True),
        "inputs_embeds [1, 8192, 1024] fp32 + labels": {
            "inputs_embeds": torch.randn(1, 8192, 1024, generator=g),
            "labels": torch.randint(0, 32000, (1, 8192), generator=g),
        },
    }
    print(f"machine: {platform.machine()}, torch {torch.__version__}; one process, 1 thread")
    print("| batch | XXH3 (CPU) ms | lane hash on the CPU ms | lane / XXH3 |")
    print("|---|---|---|---|")
    for name, batch in batches.items():

        def lane(b: dict[str, torch.Tensor] = batch) -> torch.Tensor:
            consistency._content_hash = consistency._lane_hash  # type: ignore[assignment]
            try:
                return batch_fingerprint(b, **kw)
            finally:
                consistency._content_hash = host  # type: ignore[assignment]

        t_host, t_lane = paired_median_times(
            [lambda b=batch: batch_fingerprint(b, **kw), lane], repeat=a.repeat
        )
        print(f"| {name} | {t_host * 1e3:.3f} | {t_lane * 1e3:.3f} | {t_lane / t_host:.1f}x |")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--seq", type=int, default=32768)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--repeat", type=int, default=100)
    p.add_argument("--hashes", action="store_true", help="only the two hashes, one process")
    a = p.parse_args()
    if a.hashes:
        _hashes(a)
        return
    print(
        f"machine: {platform.machine()}, torch {torch.__version__}; B={a.batch}, S={a.seq}, "
        "1 thread per rank, gloo; rank 0's medians"
    )
    print(
        "| ranks | batch keys | fingerprint ms | exchange ms | check ms (target <= 1) | "
        "make_cp_batch_and_ctx ms (check on / off) | collectives, bytes sent | verb check ms |"
    )
    print("|---|---|---|---|---|---|---|---|")
    torch.set_num_threads(1)
    for positions in (False, True):  # the hash alone, one process, no rank competing for a core
        batch = _batch(a.batch, a.seq, positions)
        (t,) = paired_median_times(
            [lambda: batch_fingerprint(batch, layout="auto", attention="ring", padding_token_id=0)],  # noqa: B023
            repeat=a.repeat,
        )
        keys = "+positions" if positions else "ids, labels, mask"
        print(f"| 1 process | {keys} | {t * 1e3:.3f} | | | | | |")
    for world in (2, 4):
        for r in run(world, a):
            verb = f"{r['verb']:.3f}" if "verb" in r else ""
            print(
                f"| {world} | {r['keys']} | {r['fingerprint']:.3f} | {r['exchange']:.3f} | "
                f"{r['check']:.3f} | {r['shard_on']:.2f} / {r['shard_off']:.2f} | "
                f"{r['calls']}, {r['bytes']} | {verb} |"
            )


def run(world: int, a: Any) -> list[dict[str, Any]]:
    from cpshard.launch import run_local_ranks

    out: list[dict[str, Any]] = run_local_ranks(world, _bench, a.batch, a.seq, a.repeat)[0]
    return out


if __name__ == "__main__":
    main()
