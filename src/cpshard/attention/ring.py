"""Ring CP attention: K/V blocks travel around the group, overlapped with compute.

Forward, step ``s`` of ``C``: rank ``r`` holds the K/V block of rank ``src = (r - s) % C``. It
starts sending that block to ``r + 1`` (and receiving the next from ``r - 1``), attends its local
queries to the block it holds (only the tiles the mask needs; a block no query sees is skipped),
merges the partial result in fp32 with the online-softmax rule, then waits for the transfer.

Backward: the same rotation; with every K/V block travels an fp32 accumulator of its ``(dk, dv)``.
Each rank adds its contribution for the block it holds and passes the accumulator on; after ``C``
hops each accumulator is back at its owner. ``dq`` stays local.
Bytes sent per rank and layer (forward): ``(C-1)/C * S * 2 * Hkv * D * itemsize``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch.distributed import ProcessGroup

from cpshard._comm import RingTransfer, group_rank_and_size, ring_shift_start
from cpshard.attention.blockwise import Span, attend, attend_backward, plan
from cpshard.attention.kernels import KernelBackend
from cpshard.attention.merge import accumulation_dtype, empty_partial, merge_into

__all__ = ["ring_attention"]

_KV_TAG = 0
_GRAD_TAG = 1


def _rank_and_size(group: ProcessGroup | None) -> tuple[int, int]:
    return (0, 1) if group is None else group_rank_and_size(group)


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        q_span: Span,
        k_spans: Sequence[Span],
        group: ProcessGroup | None,
        causal: bool,
        scale: float,
        backend: KernelBackend,
    ) -> torch.Tensor:
        rank, world = _rank_and_size(group)
        kv = torch.stack([k, v])
        out: torch.Tensor | None = None
        lse: torch.Tensor | None = None
        for step in range(world):
            src = (rank - step) % world
            xfer = (
                ring_shift_start(kv, group, _KV_TAG)
                if group is not None and step < world - 1
                else None
            )
            if plan(q_span, k_spans[src], causal):
                o, l_ = attend(
                    q, kv[0], kv[1], q_span, k_spans[src], causal=causal, scale=scale,
                    backend=backend,
                )  # fmt: skip
                if out is None or lse is None:
                    out, lse = o, l_
                else:
                    merge_into(out, lse, o, l_)
            if xfer is not None:
                kv = xfer.wait()
        if out is None or lse is None:  # no query sees any key (cannot happen for a real meta)
            out, lse = empty_partial(tuple(q.shape), accumulation_dtype(q.dtype), q.device)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.args = (q_span, k_spans, group, causal, scale, backend)
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        q, k, v, out, lse = ctx.saved_tensors
        q_span, k_spans, group, causal, scale, backend = ctx.args
        rank, world = _rank_and_size(group)
        grad_out = grad_out.contiguous()
        kv = torch.stack([k, v])
        dq = torch.zeros(q.shape, dtype=out.dtype, device=q.device)
        grad_xfer: RingTransfer | None = None
        dkv = torch.zeros(kv.shape, dtype=out.dtype, device=kv.device)
        for step in range(world):
            src = (rank - step) % world
            xfer = (
                ring_shift_start(kv, group, _KV_TAG)
                if group is not None and step < world - 1
                else None
            )
            res = attend_backward(
                grad_out, q, kv[0], kv[1], out, lse, q_span, k_spans[src], causal=causal,
                scale=scale, backend=backend,
            )  # fmt: skip
            # The accumulator for block `src` arrives from the rank that held it last step.
            dkv = grad_xfer.wait() if grad_xfer is not None else torch.zeros_like(dkv)
            if res is not None:
                dq += res[0]
                dkv[0] += res[1]
                dkv[1] += res[2]
            if group is not None and world > 1:
                grad_xfer = ring_shift_start(dkv, group, _GRAD_TAG)
            if xfer is not None:
                kv = xfer.wait()
        if grad_xfer is not None:
            dkv = grad_xfer.wait()  # our own block's accumulator, back after C hops
        return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype), *([None] * 6)


def ring_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_span: Span,
    k_spans: Sequence[Span],
    group: ProcessGroup | None,
    *,
    causal: bool,
    scale: float,
    backend: KernelBackend = "auto",
) -> torch.Tensor:
    """Differentiable ring CP attention (inputs already validated).

    Args:
        q: ``[B, Hq, L, D]`` local queries.
        k: ``[B, Hkv, L, D]`` local keys.
        v: ``[B, Hkv, L, D]`` local values.
        q_span: Span of the local tokens.
        k_spans: Span of every rank's tokens, index ``r`` for rank ``r``.
        group: CP process group, or ``None`` for world size 1.
        causal: Causal masking by global position.
        scale: Score scale.
        backend: Kernel backend.

    Returns:
        ``[B, Hq, L, D]`` in q's dtype.
    """
    out: torch.Tensor = _RingAttention.apply(  # type: ignore[no-untyped-call]
        q, k, v, q_span, tuple(k_spans), group, causal, scale, backend
    )
    return out
