"""Rank functions of the selective-exchange and ``auto`` tests (top-level so ranks import them)."""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.device_mesh import DeviceMesh

import cpshard
import cpshard.attention.selective as selective_mod
from cpshard.attention import cp_sdpa


def exchanged_bytes(
    cp_mesh: DeviceMesh, seq_lens: list[list[int]], row_len: int, layout: str, window: int | None
) -> dict[str, Any]:
    """Selective attention forward + backward on a packed batch, recording every all-to-all.

    The exchange is wrapped test-side (the library is untouched): each call's payload bytes.
    """
    ids = torch.arange(1, len(seq_lens) * row_len + 1).reshape(len(seq_lens), row_len)
    _, _, sharder = cpshard.make_cp_batch_and_ctx(
        cp_mesh, {"input_ids": ids, "seq_lens": seq_lens}, layout=layout, attention="selective"
    )
    meta = sharder.token_meta
    assert meta is not None
    calls: list[int] = []
    real = selective_mod.all_to_all_split_start

    def recording(x: torch.Tensor, *args: Any) -> Any:
        calls.append(x.numel() * x.element_size())
        return real(x, *args)

    g = torch.Generator().manual_seed(7)
    n = meta.local_len
    q = torch.randn(1, 4, n, 8, generator=g, dtype=torch.float64, requires_grad=True)
    k = torch.randn(1, 2, n, 8, generator=g, dtype=torch.float64, requires_grad=True)
    v = torch.randn(1, 2, n, 8, generator=g, dtype=torch.float64, requires_grad=True)
    selective_mod.all_to_all_split_start = recording  # type: ignore[assignment]
    try:
        o = cp_sdpa(q, k, v, group=cp_mesh.get_group(), meta=meta, method="selective",
                    window=window)  # fmt: skip
        o.sum().backward()
    finally:
        selective_mod.all_to_all_split_start = real
    return {
        "calls": calls,
        "positions": meta.positions,
        "document_ids": meta.document_ids,
        "slot_bytes": 2 * 1 * 2 * 8 * 8,  # k and v, B=1, Hkv=2, D=8, fp64
    }


def auto_choice(cp_mesh: DeviceMesh, seq_lens: list[list[int]], row_len: int) -> Any:
    """``attention="auto"`` through the dispatcher: the recorded choice and costs of this rank."""
    ids = torch.arange(1, len(seq_lens) * row_len + 1).reshape(len(seq_lens), row_len)
    ctx, _, sharder = cpshard.make_cp_batch_and_ctx(
        cp_mesh, {"input_ids": ids, "seq_lens": seq_lens}
    )
    meta = sharder.token_meta
    assert meta is not None
    return ctx.facts.attention_method, meta.plan_cache["attention_costs"]
