"""Shared builders for the CP attention tests: layouts, token meta, inputs and the reference."""

from __future__ import annotations

import math
from typing import Any

import torch

from cpshard.layouts.closed_form import ContiguousLayout, RoundRobinLayout
from cpshard.layouts.index import padded_length
from cpshard.names import DENSE_LAYOUTS
from cpshard.sharding.meta import TokenMeta, pad_document_ids

# The dense layouts plus "random": a test-only rank map that stands in for the data-dependent
# packed / balanced layouts (any permutation of the padded stream must work).
LAYOUTS = (*DENSE_LAYOUTS, "random")
# The layouts the sliding-window tests run: round_robin cuts windows at rank boundaries like
# contiguous and more, random cuts them anywhere, so contiguous would only add run time.
WINDOW_LAYOUTS = tuple(lay for lay in LAYOUTS if lay != "contiguous")
DTYPES = {"fp64": torch.float64, "fp32": torch.float32, "bf16": torch.bfloat16}


def visible(
    q_pos: Any, q_doc: Any, k_pos: Any, k_doc: Any, causal: bool, window: int | None
) -> Any:
    """The mask rule itself, ``[..., Nq, Nk]`` bool (numpy or torch, leading dims broadcast): query
    sees key iff same document and, causal, ``0 <= q_pos - k_pos`` (``< window``)."""
    vis = q_doc[..., :, None] == k_doc[..., None, :]
    diff = q_pos[..., :, None] - k_pos[..., None, :]
    if causal:
        vis &= diff >= 0
    if window is not None:
        vis &= diff < window
    return vis


def rank_map(layout: str, world: int, padded: int, seed: int = 0) -> torch.Tensor:
    """LongTensor ``[C, L]``: global positions of each rank's local tokens."""
    if layout == "contiguous":
        return ContiguousLayout().rank_map(world, padded)
    if layout == "round_robin":
        return RoundRobinLayout().rank_map(world, padded)
    if layout == "random":  # stands in for the data-dependent packed/balanced layouts
        g = torch.Generator().manual_seed(seed)
        return torch.randperm(padded, generator=g).view(world, padded // world)
    raise ValueError(layout)


def document_ids(batch: int, seq_len: int, padded: int, n_docs: int, seed: int) -> torch.Tensor:
    """``[B, P]`` doc ids: ``n_docs`` random-length documents per row, unique negative pads."""
    g = torch.Generator().manual_seed(seed + 1)
    rows = []
    for _ in range(batch):
        cuts = torch.randperm(seq_len - 1, generator=g)[: n_docs - 1] + 1
        doc = torch.zeros(padded, dtype=torch.long)
        for c in cuts.tolist():
            doc[c:] += 1
        rows.append(doc)
    docs = torch.stack(rows)
    pad = torch.arange(padded) >= seq_len
    return pad_document_ids(docs, pad.expand(batch, padded))


def make_case(
    layout: str, world: int, seq_len: int, batch: int, n_docs: int, seed: int, meta_batch: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(rank_map [C, L], doc [B or 1, P])`` for a test case (global order)."""
    padded = padded_length(seq_len, 2 * world)
    docs = document_ids(meta_batch, seq_len, padded, n_docs, seed)
    return rank_map(layout, world, padded, seed), docs


def make_meta(rmap: torch.Tensor, docs: torch.Tensor, rank: int) -> TokenMeta:
    """TokenMeta for ``rank`` from a ``[C, L]`` rank map and global ``[B, P]`` doc ids."""
    stream = rmap.reshape(-1)
    positions = stream.unsqueeze(0).expand(docs.shape[0], -1).contiguous()
    return TokenMeta(rank, rmap.shape[0], positions, docs[:, stream].contiguous())


def inputs(
    batch: int, hq: int, hkv: int, padded: int, dim: int, seed: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Global fp64 ``q [B,Hq,P,D]``, ``k``, ``v [B,Hkv,P,D]`` and an upstream grad like ``q``."""
    g = torch.Generator().manual_seed(seed + 2)
    q = torch.randn(batch, hq, padded, dim, generator=g, dtype=torch.float64)
    k = torch.randn(batch, hkv, padded, dim, generator=g, dtype=torch.float64)
    v = torch.randn(batch, hkv, padded, dim, generator=g, dtype=torch.float64)
    go = torch.randn(batch, hq, padded, dim, generator=g, dtype=torch.float64)
    return q, k, v, go


def local_shards(
    tensors: tuple[torch.Tensor, ...], idx: torch.Tensor, dtype: torch.dtype
) -> tuple[torch.Tensor, ...]:
    """Each global ``[B, H, P, D]`` tensor's rank slots ``idx`` in ``dtype``, as leaves that
    require grad, laid out ``[B, L, H, D]`` in memory (non-contiguous, like the transposed views
    HF passes)."""
    return tuple(
        t.index_select(2, idx).transpose(1, 2).contiguous().transpose(1, 2).to(dtype)
        .requires_grad_()
        for t in tensors
    )  # fmt: skip


def reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    docs: torch.Tensor,
    causal: bool,
    scale: float | None = None,
    window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Plain masked softmax attention in fp64 on the global sequence (positions = arange)."""
    p = q.shape[-2]
    groups = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(groups, dim=1).double()
    v = v.repeat_interleave(groups, dim=1).double()
    vis = docs[:, :, None] == docs[:, None, :]
    if causal:
        vis = vis & torch.ones(p, p, dtype=torch.bool).tril()
    if window is not None:
        pos = torch.arange(p)
        vis = vis & (pos[:, None] - pos[None, :] < window)
    sc = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    s = (q.double() @ k.transpose(-1, -2)) * sc
    if softcap is not None:
        s = softcap * torch.tanh(s / softcap)
    s = s.masked_fill(~vis[:, None], float("-inf"))
    return torch.softmax(s, dim=-1) @ v


def reference_with_grads(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    go: torch.Tensor,
    docs: torch.Tensor,
    causal: bool,
    window: int | None = None,
    softcap: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Reference output and ``(dq, dk, dv)`` for the upstream gradient ``go`` (global order)."""
    q, k, v = (t.detach().double().requires_grad_() for t in (q, k, v))
    out = reference(q, k, v, docs, causal, window=window, softcap=softcap)
    out.backward(go.double())
    assert q.grad is not None
    assert k.grad is not None
    assert v.grad is not None
    return out.detach(), q.grad, k.grad, v.grad


def same_plan(got: Any, want: Any) -> None:
    """Assert two :class:`~cpshard.attention.plan.PairPlan` are equal: counts, row groups and
    every kernel call (its slots, kind, mask and whether it writes its rows first)."""
    assert (got.computed, got.needed, got.empty) == (want.computed, want.needed, want.empty)
    assert len(got.groups) == len(want.groups)
    for (rows_g, tasks_g), (rows_w, tasks_w) in zip(got.groups, want.groups, strict=True):
        assert (rows_g is None) == (rows_w is None)
        if rows_g is not None and rows_w is not None:
            assert torch.equal(rows_g, rows_w)
        assert len(tasks_g) == len(tasks_w)
        for tg, tw in zip(tasks_g, tasks_w, strict=True):
            assert tg[:5] == tw[:5] and tg.first == tw.first
            assert (tg.mask is None) == (tw.mask is None)
            if tg.mask is not None and tw.mask is not None:
                assert torch.equal(tg.mask, tw.mask)


def te_packed_case(lens: list[int], world: int) -> tuple[torch.Tensor, torch.Tensor]:
    """TE's ``packed`` layout of one row of documents ``lens``: ``(rank map [C, L], document ids
    [1, P])`` in stream order, each pad with its own id (every document cut into ``2C`` chunks)."""
    from cpshard.layouts.documents import PackSpec
    from cpshard.layouts.packed import plan_packed

    plan = plan_packed(PackSpec.from_seq_lens([lens], sum(lens)), world)
    ids = plan.stream_document_ids[None]
    return plan.rank_map, pad_document_ids(ids, ids < 0)
