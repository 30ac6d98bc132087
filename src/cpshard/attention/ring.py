"""Ring CP attention: K/V blocks travel around the group, overlapped with compute.

Forward, step ``s`` of ``C``: rank ``r`` holds the K/V block of rank ``src = (r - s) % C``. It
starts sending that block to ``r + 1`` (and receiving the next from ``r - 1``), attends its local
queries to the block it holds (only the tiles the mask needs; a block no query sees is skipped),
merges the partial result in fp32 with the online-softmax rule, then waits for the transfer.

Backward: the same rotation; with every K/V block travels an fp32 accumulator of its ``(dk, dv)``.
Each rank adds its contribution for the block it holds and passes the accumulator on; after ``C``
hops each accumulator is back at its owner. ``dq`` stays local.
Bytes sent per rank and layer (forward): ``(C-1)/C * S * 2 * Hkv * D * itemsize``.

:class:`RingMethod` is the method's strategy object (its plans, input check and the
differentiable forward whose backward is above), registered in :mod:`cpshard.attention.methods`.

Import rules: the rows of ``RULES`` in tests/unit/test_architecture.py that cover this module.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch.distributed import ProcessGroup

from cpshard._comm import Transfer, group_rank_and_size, ring_shift_start
from cpshard.attention.autocast import backward_without_autocast
from cpshard.attention.blockwise import BadQueries, attend, attend_backward_into
from cpshard.attention.kernels import KernelBackend, pick_backend
from cpshard.attention.merge import (
    accumulation_dtype,
    add_sinks,
    empty_partial,
    merge_into,
    sink_grad,
)
from cpshard.attention.plan import AttentionPlan, PairPlan

__all__ = ["RingMethod", "ring_attention"]

_KV_TAGS = (0, 1)  # one message each for k and v (no stacked copy)
_GRAD_TAGS = (2, 3)  # their fp32 gradient accumulators, in flight together with K/V


def _rank_and_size(group: ProcessGroup | None) -> tuple[int, int]:
    return (0, 1) if group is None else group_rank_and_size(group)


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        plans: Sequence[PairPlan],
        group: ProcessGroup | None,
        scale: float,
        backend: KernelBackend,
        softcap: float | None,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        rank, world = _rank_and_size(group)
        kv: list[torch.Tensor] = [k, v]  # step 0 attends to the inputs themselves, no copy
        out: torch.Tensor | None = None
        lse: torch.Tensor | None = None
        bad_q = BadQueries.forward(q)  # the NaN guard's query rows: once, not once per hop
        for step in range(world):
            src = (rank - step) % world
            xfer = (
                ring_shift_start(kv, group, _KV_TAGS)
                if group is not None and step < world - 1
                else None
            )
            if not plans[src].empty:
                o, l_ = attend(
                    q, kv[0], kv[1], plans[src], scale=scale, backend=backend, softcap=softcap,
                    bad_q=bad_q,
                )  # fmt: skip
                if out is None or lse is None:
                    out, lse = o, l_
                else:
                    merge_into(out, lse, o, l_)
                del o, l_
            if xfer is not None:
                kv = xfer.wait()  # the block just used is released (unless it is the input)
        del kv
        if out is None or lse is None:  # no query sees any key (cannot happen for a real meta)
            out, lse = empty_partial(tuple(q.shape), accumulation_dtype(q.dtype), q.device)
        if sinks is not None:
            add_sinks(out, lse, sinks)
        result = out.to(q.dtype)
        # The flash backward reads the output in q's dtype: for bf16/fp16 keep the returned
        # tensor, not a second, fp32 copy of it (for fp32 they are the same tensor).
        keep = result if pick_backend(q, backend) == "cpu_flash" else out
        ctx.save_for_backward(q, k, v, keep, lse, sinks)
        ctx.args = (plans, group, scale, backend, softcap)
        return result

    @staticmethod
    @backward_without_autocast
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        q, k, v, out, lse, sinks = ctx.saved_tensors
        plans, group, scale, backend, softcap = ctx.args
        rank, world = _rank_and_size(group)
        acc = accumulation_dtype(q.dtype)
        grad_out = grad_out.contiguous()
        out_q = out.to(q.dtype)  # as the kernels read it: converted once, not once per hop
        bad_q = BadQueries.backward(grad_out, q, out_q, lse)  # once, not once per hop
        kv: list[torch.Tensor] = [k, v]
        dq = torch.zeros(q.shape, dtype=acc, device=q.device)
        grad_xfer: Transfer | None = None
        dkv: list[torch.Tensor] = []
        for step in range(world):
            src = (rank - step) % world
            xfer = (
                ring_shift_start(kv, group, _KV_TAGS)
                if group is not None and step < world - 1
                else None
            )
            # This step's contribution to block `src`, in a fresh fp32 buffer so that the
            # accumulator of that block can still be in flight while we compute.
            dkv = [torch.zeros(t.shape, dtype=acc, device=t.device) for t in kv]
            attend_backward_into(
                grad_out, q, kv[0], kv[1], out_q, lse, plans[src], dq, dkv[0], dkv[1], scale=scale,
                backend=backend, softcap=softcap, bad_q=bad_q,
            )  # fmt: skip
            # The accumulator for block `src` arrives from the rank that held it last step; waiting
            # also completes (and frees) our previous accumulator's send.
            if grad_xfer is not None:
                for mine, theirs in zip(dkv, grad_xfer.wait(), strict=True):
                    mine += theirs
            if group is not None and world > 1:
                grad_xfer = ring_shift_start(dkv, group, _GRAD_TAGS)
            if xfer is not None:
                kv = xfer.wait()
        del kv
        if grad_xfer is not None:
            dkv = grad_xfer.wait()  # our own block's accumulator, back after C hops
        dk, dv = dkv
        ds = None if sinks is None else sink_grad(grad_out, out, lse, sinks)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), *([None] * 5), ds


def ring_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    plans: Sequence[PairPlan],
    group: ProcessGroup | None,
    *,
    scale: float,
    backend: KernelBackend = "auto",
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Differentiable ring CP attention (inputs already validated).

    Args:
        q: ``[B, Hq, L, D]`` local queries.
        k: ``[B, Hkv, L, D]`` local keys.
        v: ``[B, Hkv, L, D]`` local values.
        plans: Local queries against every rank's block, index ``r`` for rank ``r``.
        group: CP process group, or ``None`` for world size 1.
        scale: Score scale.
        backend: Kernel backend.
        softcap: Soft-cap of the scores, or ``None``.
        sinks: ``[Hq]`` attention-sink logits (:func:`~cpshard.attention.merge.add_sinks`), or
            ``None``.

    Returns:
        ``[B, Hq, L, D]`` in q's dtype.
    """
    out: torch.Tensor = _RingAttention.apply(  # type: ignore[no-untyped-call]
        q, k, v, tuple(plans), group, scale, backend, softcap, sinks
    )
    return out


class RingMethod:
    """The ``"ring"`` strategy: plans, input check, forward (backward by autograd)."""

    name = "ring"

    def check(self, q_heads: int, kv_heads: int, world: int) -> None:
        """Every head count and CP size is served: nothing to refuse."""

    def plans(
        self, plan: AttentionPlan, causal: bool, window: int | None, device: torch.device
    ) -> tuple[PairPlan, ...]:
        """Local queries against each rank's block (:meth:`~AttentionPlan.ring`)."""
        return plan.ring(causal, window, device)

    def planned(
        self, plan: AttentionPlan, causal: bool, window: int | None, device: torch.device
    ) -> bool:
        """Whether :meth:`plans` would only read cached plans (no host work)."""
        return plan.planned(self.name, causal, window, device)

    def apply(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        plans: Any,
        group: ProcessGroup | None,
        *,
        scale: float,
        backend: KernelBackend,
        softcap: float | None,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """:func:`ring_attention` with the plans of :meth:`plans`."""
        return ring_attention(
            q, k, v, plans, group, scale=scale, backend=backend, softcap=softcap, sinks=sinks
        )
