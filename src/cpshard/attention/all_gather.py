"""All-gather CP attention (Llama-3 style): gather K/V over the group, attend locally.

Forward: one all-gather of the local ``(k, v)`` stacked sequence-major (``[L, 2, B, H, D]``), so
the gathered buffer is the rank-major stream and its k/v are strided views (no reordering copy);
the local queries attend to the whole stream with the mask from the token meta. Backward: local
gradients against the whole stream, accumulated in place into one fp32 buffer of the gathered
layout, then one reduce-scatter (sum) of it back to the owning ranks.
Bytes sent per rank and layer: ``(C-1)/C * S * 2 * Hkv * D * itemsize`` forward.

Imports the plan and the kernels of this package and :mod:`cpshard._comm` (its collectives);
nothing else of cpshard.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed import ProcessGroup

from cpshard._comm import all_gather_stacked, reduce_scatter_stacked
from cpshard.attention.blockwise import attend, attend_backward_into
from cpshard.attention.kernels import KernelBackend, pick_backend
from cpshard.attention.merge import accumulation_dtype
from cpshard.attention.plan import PairPlan

__all__ = ["all_gather_attention"]


def _seq_major(k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """``k, v [B, H, L, D]`` -> one contiguous ``[L, 2, B, H, D]`` (sequence-major)."""
    return torch.stack([k.permute(2, 0, 1, 3), v.permute(2, 0, 1, 3)], dim=1)


def _stream_views(buf: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``[N, 2, B, H, D]`` -> strided views ``(k, v)`` ``[B, H, N, D]`` of it, no copy."""
    return buf[:, 0].permute(1, 2, 0, 3), buf[:, 1].permute(1, 2, 0, 3)


class _AllGatherAttention(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        plan: PairPlan,
        group: ProcessGroup | None,
        scale: float,
        backend: KernelBackend,
        softcap: float | None,
    ) -> torch.Tensor:
        if group is None:
            full = None
            k_all, v_all = k, v
        else:
            # Sequence-major, the gathered buffer [C*L, 2, B, H, D] is the rank-major stream and
            # its k/v are plain strided views: no reordering copy of the full K/V.
            full = all_gather_stacked(_seq_major(k, v), group).flatten(0, 1)
            k_all, v_all = _stream_views(full)
        out, lse = attend(q, k_all, v_all, plan, scale=scale, backend=backend, softcap=softcap)
        result = out.to(q.dtype)
        # As in the ring: keep the returned tensor, not an fp32 copy, for the flash backward.
        keep = result if pick_backend(q, backend) == "cpu_flash" else out
        ctx.save_for_backward(q, k, v, full, keep, lse)
        ctx.args = (plan, group, scale, backend, softcap)
        return result

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        q, k, v, full, out, lse = ctx.saved_tensors
        plan, group, scale, backend, softcap = ctx.args
        acc = accumulation_dtype(q.dtype)
        dq = torch.zeros(q.shape, dtype=acc, device=q.device)
        if full is None:
            k_all, v_all = k, v
            dk = torch.zeros(k.shape, dtype=acc, device=k.device)
            dv = torch.zeros(v.shape, dtype=acc, device=v.device)
        else:
            k_all, v_all = _stream_views(full)
            # One fp32 buffer in the gathered layout: its rank-major chunks are what the
            # reduce-scatter sends, so dK/dV of the stream are accumulated in place, no stacking.
            dfull = torch.zeros(full.shape, dtype=acc, device=full.device)
            dk, dv = _stream_views(dfull)
        attend_backward_into(
            grad_out.contiguous(), q, k_all, v_all, out, lse, plan, dq, dk, dv, scale=scale,
            backend=backend, softcap=softcap,
        )  # fmt: skip
        if full is not None:
            world = full.shape[0] // q.shape[2]
            mine = reduce_scatter_stacked(dfull.view(world, -1, *dfull.shape[1:]), group)
            del dfull, dk, dv
            dk, dv = (t.contiguous() for t in _stream_views(mine))
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), *([None] * 5)


def all_gather_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    plan: PairPlan,
    group: ProcessGroup | None,
    *,
    scale: float,
    backend: KernelBackend = "auto",
    softcap: float | None = None,
) -> torch.Tensor:
    """Differentiable all-gather CP attention (inputs already validated).

    Args:
        q: ``[B, Hq, L, D]`` local queries.
        k: ``[B, Hkv, L, D]`` local keys.
        v: ``[B, Hkv, L, D]`` local values.
        plan: Local queries against the whole rank-major stream ``[C * L]``.
        group: CP process group, or ``None`` for world size 1.
        scale: Score scale.
        backend: Kernel backend.
        softcap: Soft-cap of the scores, or ``None``.

    Returns:
        ``[B, Hq, L, D]`` in q's dtype.
    """
    out: torch.Tensor = _AllGatherAttention.apply(  # type: ignore[no-untyped-call]
        q, k, v, plan, group, scale, backend, softcap
    )
    return out
