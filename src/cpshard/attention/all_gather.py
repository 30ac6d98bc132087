"""All-gather CP attention (Llama-3 style): gather K/V over the group, attend locally.

Forward: one all-gather of the stacked local ``(k, v)``; the local queries attend to the whole
stream with the mask from the token meta. Backward: local gradients against the whole stream,
then one reduce-scatter (sum) of the stacked ``(dk, dv)`` in fp32 back to the owning ranks.
Bytes sent per rank and layer: ``(C-1)/C * S * 2 * Hkv * D * itemsize`` forward.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed import ProcessGroup

from cpshard._comm import all_gather_stacked, reduce_scatter_stacked
from cpshard.attention.blockwise import Span, attend, attend_backward
from cpshard.attention.kernels import KernelBackend

__all__ = ["all_gather_attention"]


def _to_stream(kv: torch.Tensor) -> torch.Tensor:
    """``[C, 2, B, H, L, D]`` -> ``[2, B, H, C*L, D]`` (rank-major stream order)."""
    c, two, b, h, n, d = kv.shape
    return kv.permute(1, 2, 3, 0, 4, 5).reshape(two, b, h, c * n, d)


def _from_stream(kv: torch.Tensor, world: int) -> torch.Tensor:
    """``[2, B, H, C*L, D]`` -> ``[C, 2, B, H, L, D]``, the inverse of :func:`_to_stream`."""
    two, b, h, cn, d = kv.shape
    return kv.reshape(two, b, h, world, cn // world, d).permute(3, 0, 1, 2, 4, 5)


class _AllGatherAttention(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        q_span: Span,
        stream_span: Span,
        group: ProcessGroup | None,
        causal: bool,
        scale: float,
        backend: KernelBackend,
    ) -> torch.Tensor:
        kv = torch.stack([k, v])
        full = kv if group is None else _to_stream(all_gather_stacked(kv, group))
        out, lse = attend(
            q, full[0], full[1], q_span, stream_span, causal=causal, scale=scale, backend=backend
        )
        ctx.save_for_backward(q, full, out, lse)
        ctx.args = (q_span, stream_span, group, causal, scale, backend)
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        q, full, out, lse = ctx.saved_tensors
        q_span, stream_span, group, causal, scale, backend = ctx.args
        res = attend_backward(
            grad_out.contiguous(),
            q,
            full[0],
            full[1],
            out,
            lse,
            q_span,
            stream_span,
            causal=causal,
            scale=scale,
            backend=backend,
        )
        if res is None:
            dq = torch.zeros_like(q)
            dfull = torch.zeros(full.shape, dtype=out.dtype, device=full.device)
        else:
            dq, dk_full, dv_full = res
            dfull = torch.stack([dk_full, dv_full])
        if group is None:
            dkv = dfull
        else:
            world = full.shape[3] // q.shape[2]
            dkv = reduce_scatter_stacked(_from_stream(dfull, world), group)
        return dq.to(q.dtype), dkv[0].to(full.dtype), dkv[1].to(full.dtype), *([None] * 6)


def all_gather_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_span: Span,
    stream_span: Span,
    group: ProcessGroup | None,
    *,
    causal: bool,
    scale: float,
    backend: KernelBackend = "auto",
) -> torch.Tensor:
    """Differentiable all-gather CP attention (inputs already validated).

    Args:
        q: ``[B, Hq, L, D]`` local queries.
        k: ``[B, Hkv, L, D]`` local keys.
        v: ``[B, Hkv, L, D]`` local values.
        q_span: Span of the local tokens.
        stream_span: Span of the whole rank-major stream ``[C * L]``.
        group: CP process group, or ``None`` for world size 1.
        causal: Causal masking by global position.
        scale: Score scale.
        backend: Kernel backend.

    Returns:
        ``[B, Hq, L, D]`` in q's dtype.
    """
    out: torch.Tensor = _AllGatherAttention.apply(  # type: ignore[no-untyped-call]
        q, k, v, q_span, stream_span, group, causal, scale, backend
    )
    return out
