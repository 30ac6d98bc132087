"""``cpshard layouts``: shard a dense and a packed batch in every layout on local ranks, and back.

Dense rows ``[2, --seq-len]`` go through ``round_robin`` and ``contiguous``: each rank's line shows
the global positions it owns, as ranges. One packed row of documents (``--doc-lens``, plus two
trailing pad slots) goes through ``packed`` (every document cut into 2 x ranks chunks, rank r
keeping chunks r and 2 x ranks - 1 - r, documents padded to a multiple of 2 x ranks) and
``balanced`` (cpshard's solver: equal token counts, causal work balanced, at most ranks - 1 pad
slots): each rank's line shows the document pieces it owns, ``d1[0,3)`` meaning tokens 0..2 of
document 1, and its pad slots.

On every rank it checks that ``gather_token_tensor(shard_token_tensor(x), trim=True)`` gives
``x`` back in the caller's coordinates (for packed rows: every real token; the caller's trailing
pad slots, which the packed layouts drop, come back as the ``fill`` value).

Owns the arguments and the printout; the sharding is the public
:func:`cpshard.make_cp_batch_and_ctx` on the rank pool, the names come from :mod:`cpshard.names`.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

import torch
from torch.distributed.device_mesh import DeviceMesh

from cpshard.dispatch import make_cp_batch_and_ctx
from cpshard.layouts.index import consecutive_runs
from cpshard.names import DENSE_LAYOUTS, PACKED_LAYOUTS
from cpshard.tools.launch import run_local_ranks

__all__ = ["DESCRIPTION", "add_arguments", "run"]

DESCRIPTION = __doc__
_TRAILING_PADS = 2


def _lengths(text: str) -> list[int]:
    try:
        lens = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"--doc-lens takes comma-separated document lengths like 5,9,3,7, got {text!r}"
        ) from None
    if not lens or min(lens) < 1:
        raise argparse.ArgumentTypeError(f"--doc-lens needs lengths >= 1, got {text!r}")
    return lens


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Arguments of ``cpshard layouts``."""
    p.add_argument("--ranks", type=int, default=4, help="number of local CP ranks")
    p.add_argument("--seq-len", type=int, default=30, help="tokens per dense row")
    p.add_argument(
        "--doc-lens", type=_lengths, default=[5, 9, 3, 7], help="document lengths of the packed row"
    )


def _ranges(idx: torch.Tensor) -> str:
    return " ".join(f"[{v},{v + n})" for v, n in consecutive_runs(idx))


def _doc_pieces(inputs: torch.Tensor, doc_lens: list[int]) -> str:
    """``d1[0,3) d2[5,7) +2 pad`` for a rank's input positions (``-1`` = pad slot)."""
    starts = torch.tensor([0, *doc_lens]).cumsum(0)
    real = inputs[inputs >= 0]
    pieces = []
    for v, n in consecutive_runs(real):
        doc = int(torch.searchsorted(starts, torch.tensor(v), right=True)) - 1
        end_doc = int(starts[doc + 1])
        while n > 0:  # a run may cross into the next document
            take = min(n, end_doc - v)
            pieces.append(f"d{doc}[{v - int(starts[doc])},{v - int(starts[doc]) + take})")
            v, n, doc = v + take, n - take, doc + 1
            end_doc = int(starts[min(doc + 1, len(doc_lens))])
    pads = int((inputs < 0).sum())
    return " ".join(pieces) + (f" +{pads} pad" if pads else "")


def _one_rank(cp_mesh: DeviceMesh, seq_len: int, doc_lens: list[int]) -> list[dict[str, Any]]:
    rank = cp_mesh.get_local_rank()
    gen = torch.Generator().manual_seed(0)
    rows = []
    ids = torch.randint(3, 256, (2, seq_len), generator=gen)
    adv = torch.randn(2, seq_len, generator=gen)
    for layout in DENSE_LAYOUTS:
        _, batch, sharder = make_cp_batch_and_ctx(cp_mesh, {"input_ids": ids}, layout=layout)
        back = sharder.gather_token_tensor(sharder.shard_token_tensor(adv, fill=0.0), trim=True)
        ids_back = sharder.gather_token_tensor(batch["input_ids"], trim=True)
        assert sharder.rank_map is not None
        rows.append(
            {
                "layout": sharder.layout,
                "padded": sharder.padded_seq_len,
                "owned": _ranges(sharder.rank_map[rank]),
                "ok": bool(torch.equal(back, adv) and torch.equal(ids_back, ids)),
            }
        )
    total = sum(doc_lens) + _TRAILING_PADS
    pids = torch.randint(3, 256, (1, total), generator=gen)
    padv = torch.randn(1, total, generator=gen)
    for layout in PACKED_LAYOUTS:
        batch_in = {"input_ids": pids, "seq_lens": [doc_lens]}
        _, batch, sharder = make_cp_batch_and_ctx(cp_mesh, batch_in, layout=layout)
        assert sharder.rank_map is not None
        assert sharder.input_token_stream_positions is not None
        to_stream = sharder.input_token_stream_positions.reshape(-1)
        kept = to_stream >= 0
        from_stream = torch.full((int(sharder.rank_map.numel()),), -1, dtype=torch.long)
        from_stream[to_stream[kept]] = torch.arange(total)[kept]
        back = sharder.gather_token_tensor(
            sharder.shard_token_tensor(padv, fill=0.0), trim=True, fill=0.0
        )
        ids_back = sharder.gather_token_tensor(batch["input_ids"], trim=True, fill=-1)
        rows.append(
            {
                "layout": sharder.layout,
                "padded": sharder.padded_seq_len,
                "owned": _doc_pieces(from_stream[sharder.rank_map[rank]], doc_lens),
                "ok": bool(
                    torch.equal(back, torch.where(kept[None], padv, 0.0))
                    and torch.equal(ids_back, torch.where(kept[None], pids, -1))
                ),
            }
        )
    return rows


def run(args: argparse.Namespace) -> int:
    """Run the demo; exit status 0 iff every round trip held on every rank, 2 on bad input."""
    if args.ranks < 1 or 2 * args.ranks > args.seq_len:
        print(
            f"cpshard layouts: error: --ranks {args.ranks} with --seq-len {args.seq_len}: need "
            f"1 <= ranks <= seq-len / 2; use --ranks <= {args.seq_len // 2} or a longer --seq-len",
            file=sys.stderr,
        )
        return 2
    results = run_local_ranks(args.ranks, _one_rank, args.seq_len, args.doc_lens)
    ok = True
    total = sum(args.doc_lens) + _TRAILING_PADS
    print(f"cpshard layouts: {args.ranks} gloo ranks")
    for i, layout in enumerate(DENSE_LAYOUTS + PACKED_LAYOUTS):
        padded = results[0][i]["padded"]
        if layout in DENSE_LAYOUTS:
            what = f"dense batch [2, {args.seq_len}]"
        else:
            what = f"packed row [1, {total}], documents {args.doc_lens} + {_TRAILING_PADS} pads"
        print(f"\n{layout}: {what}, stream padded to {padded}")
        for rank, rows in enumerate(results):
            row = rows[i]
            ok &= row["ok"]
            status = "round trip ok" if row["ok"] else "ROUND TRIP FAILED"
            print(f"  rank {rank}: owns {row['owned']:<36} {status}")
    print("\nall round trips exact" if ok else "\nSOME ROUND TRIPS FAILED")
    return 0 if ok else 1
