"""Rank functions: attention sinks and Llama 4 chunks under CP against an fp64 reference."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch.distributed.device_mesh import DeviceMesh

from _attention_common import inputs, make_case, make_meta
from cpshard._comm import cp_group
from cpshard.attention import cp_sdpa
from cpshard.attention.hf_options import chunked_meta


def sink_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    sinks: torch.Tensor,
    docs: torch.Tensor,
    positions: torch.Tensor,
    chunk: int | None = None,
) -> torch.Tensor:
    """gpt-oss eager attention in fp64: the sink as an extra logit column, dropped after softmax.

    Visibility: same document, causal by position, and (``chunk``) the same chunk of the
    document (positions relative to the document's first token).
    """
    p = q.shape[-2]
    groups = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(groups, dim=1)
    v = v.repeat_interleave(groups, dim=1)
    pos = positions[0]
    vis = (docs[:, :, None] == docs[:, None, :]) & (pos[None, None, :] <= pos[None, :, None])
    if chunk is not None:
        start = torch.stack([pos[docs[0] == d].min() for d in docs[0].tolist()])
        rel = pos - start
        vis = vis & ((rel[:, None] // chunk) == (rel[None, :] // chunk))[None]
    s = (q @ k.transpose(-1, -2)) / math.sqrt(q.shape[-1])
    s = s.masked_fill(~vis[:, None], float("-inf"))
    col = sinks.view(1, -1, 1, 1).expand(q.shape[0], -1, p, 1)
    probs = torch.softmax(torch.cat([s, col], dim=-1), dim=-1)[..., :-1]
    return probs @ v


def sinks_case(cp_mesh: DeviceMesh, method: str, layout: str, chunk: int | None) -> dict[str, Any]:
    """cp_sdpa with sinks (and optionally a chunk-split meta) vs the reference; grads too."""
    rank, world = cp_mesh.get_local_rank(), cp_mesh.size()
    rmap, docs = make_case(layout, world, 21, 2, 2, 3, 1)
    q, k, v, go = inputs(2, 4, 2, rmap.numel(), 8, 3)
    g = torch.Generator().manual_seed(9)
    sinks = torch.randn(4, generator=g, dtype=torch.float64)
    positions = torch.arange(rmap.numel()).unsqueeze(0)
    ref_in = [t.clone().requires_grad_() for t in (q, k, v, sinks)]
    want = sink_reference(*ref_in, docs, positions, chunk)
    want.backward(go)
    idx = rmap[rank]
    local = [t.index_select(2, idx).clone().requires_grad_() for t in (q, k, v)]
    mine = sinks.clone().requires_grad_()
    meta = make_meta(rmap, docs, rank)
    if chunk is not None:
        meta = chunked_meta(meta, chunk)
    out = cp_sdpa(*local, group=cp_group(cp_mesh), meta=meta, method=method, sinks=mine)
    (out * go.index_select(2, idx)).sum().backward()
    assert mine.grad is not None
    total = mine.grad.clone()
    torch.distributed.all_reduce(total, group=cp_group(cp_mesh))  # the CP parameter sum
    tol = {"rtol": 1e-10, "atol": 1e-10}
    torch.testing.assert_close(out, want.index_select(2, idx), **tol)
    for got, ref in zip(local, ref_in[:3], strict=True):
        assert got.grad is not None and ref.grad is not None
        torch.testing.assert_close(got.grad, ref.grad.index_select(2, idx), **tol)
    assert ref_in[3].grad is not None
    torch.testing.assert_close(total, ref_in[3].grad, **tol)
    return {"sink_grad_norm": float(total.norm())}


def chunk_without_rule_differs(cp_mesh: DeviceMesh) -> float:
    """The chunk rule matters in the test case: without it the output differs by >= 1e-2."""
    rank, world = cp_mesh.get_local_rank(), cp_mesh.size()
    rmap, docs = make_case("round_robin", world, 21, 2, 2, 3, 1)
    q, k, v, _ = inputs(2, 4, 2, rmap.numel(), 8, 3)
    meta = make_meta(rmap, docs, rank)
    idx = rmap[rank]
    loc = [t.index_select(2, idx) for t in (q, k, v)]
    a = cp_sdpa(*loc, group=cp_group(cp_mesh), meta=meta, method="ring")
    b = cp_sdpa(*loc, group=cp_group(cp_mesh), meta=chunked_meta(meta, 4), method="ring")
    diff = (a - b).abs().max().clone()
    torch.distributed.all_reduce(diff, op=torch.distributed.ReduceOp.MAX, group=cp_group(cp_mesh))
    return float(diff)
