"""Selective CP attention: each rank receives exactly the key/value slots its queries can see.

Forward: from the batch's :class:`~cpshard.attention.selective_plan.SelectivePlan` (derived on
every rank from the global token meta, so split sizes agree without a handshake) each rank packs
the local K/V slots every peer needs, sequence-major (``[N, 2, B, Hkv, D]``), and one uneven
all-to-all delivers them. While it is in flight the queries attend to this rank's own keys; then to
the received keys; the two partial results are merged in fp32 by their LSE. Memory holds only the
received slots, never the whole stream.

Where the received keys arrive as many short runs that stream order joins (a layout of small
chunks at a large CP size), they are put in stream order once after the exchange (the plan's
``recv_order``), and their gradients back in arrival order before the reverse exchange.

Backward: the received keys' dK/dV (fp32, same sequence-major layout) go back to their owners by
the reverse all-to-all, which runs while the own keys' gradients are computed; each owner adds
what it receives at the slots it sent (``index_add``: a slot several peers needed sums their
contributions).

Bytes per rank and layer (forward): ``sum(recv_splits) * 2 * B * Hkv * D * itemsize``, no header
(the split sizes come from the plan). With ``balanced`` packed batches most documents sit on one
rank, so this is a small fraction of the all-gather's ``(C-1) * L`` slots.

:class:`SelectiveMethod` is the method's strategy object, registered in
:mod:`cpshard.attention.methods`.

Import rules: the rows of ``RULES`` in tests/unit/test_architecture.py that cover this module.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed import ProcessGroup

from cpshard._comm import Transfer, all_to_all_split_start
from cpshard.attention.all_gather import seq_major, stream_views
from cpshard.attention.autocast import backward_without_autocast
from cpshard.attention.blockwise import BadQueries, attend, attend_backward_into
from cpshard.attention.kernels import KernelBackend, pick_backend
from cpshard.attention.merge import accumulation_dtype, add_sinks, merge_into, sink_grad
from cpshard.attention.plan import AttentionPlan
from cpshard.attention.selective_plan import SelectivePlan, selective_plan, selective_planned

__all__ = ["SelectiveMethod", "selective_attention"]


class _SelectiveAttention(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        plan: SelectivePlan,
        group: ProcessGroup | None,
        scale: float,
        backend: KernelBackend,
        softcap: float | None,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        pending: Transfer | None = None
        if group is not None:
            send = seq_major(k, v).index_select(0, plan.send_index)  # [N_send, 2, B, H, D]
            pending = all_to_all_split_start(send, plan.send_splits, plan.recv_splits, group)
            del send  # the Transfer keeps it alive until the exchange completes
        bad_q = BadQueries.forward(q)  # the NaN guard's query rows, for both key sets
        out, lse = attend(
            q, k, v, plan.local, scale=scale, backend=backend, softcap=softcap, bad_q=bad_q
        )
        recv: torch.Tensor | None = None
        if pending is not None:
            recv = pending.wait()[0]  # [N_recv, 2, B, H, D]
            if plan.recv_order is not None:  # the keys in stream order, as plan.remote reads them
                pending = None  # it holds the received buffer: freed once reordered
                recv = recv.index_select(0, plan.recv_order)
            if not plan.remote.empty:
                k_r, v_r = stream_views(recv)
                o, l_ = attend(q, k_r, v_r, plan.remote, scale=scale, backend=backend,
                               softcap=softcap, bad_q=bad_q)  # fmt: skip
                merge_into(out, lse, o, l_)
                del o, l_
        if sinks is not None:
            add_sinks(out, lse, sinks)
        result = out.to(q.dtype)
        keep = result if pick_backend(q, backend) == "cpu_flash" else out
        ctx.save_for_backward(q, k, v, recv, keep, lse, sinks)
        ctx.args = (plan, group, scale, backend, softcap)
        return result

    @staticmethod
    @backward_without_autocast
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        q, k, v, recv, out, lse, sinks = ctx.saved_tensors
        plan, group, scale, backend, softcap = ctx.args
        acc = accumulation_dtype(q.dtype)
        grad_out = grad_out.contiguous()
        out_q = out.to(q.dtype)  # as the kernels read it: converted once, not once per key set
        bad_q = BadQueries.backward(grad_out, q, out_q, lse)  # one for the remote and local keys
        dq = torch.zeros(q.shape, dtype=acc, device=q.device)
        pending: Transfer | None = None
        if recv is not None:
            # The received keys' gradients, sequence-major like the received buffer: the reverse
            # exchange sends them back as they are.
            drecv = torch.zeros(recv.shape, dtype=acc, device=recv.device)
            dk_r, dv_r = stream_views(drecv)
            k_r, v_r = stream_views(recv)
            attend_backward_into(
                grad_out, q, k_r, v_r, out_q, lse, plan.remote, dq, dk_r, dv_r, scale=scale,
                backend=backend, softcap=softcap, bad_q=bad_q,
            )  # fmt: skip
            del dk_r, dv_r
            if plan.recv_order is not None:  # back in arrival order, for the reverse exchange
                drecv = torch.empty_like(drecv).index_copy_(0, plan.recv_order, drecv)
            pending = all_to_all_split_start(drecv, plan.recv_splits, plan.send_splits, group)
            del drecv
        dk = torch.zeros(k.shape, dtype=acc, device=k.device)
        dv = torch.zeros(v.shape, dtype=acc, device=v.device)
        attend_backward_into(
            grad_out, q, k, v, out_q, lse, plan.local, dq, dk, dv, scale=scale, backend=backend,
            softcap=softcap, bad_q=bad_q,
        )  # fmt: skip
        if pending is not None:
            back = pending.wait()[0]  # [N_send, 2, B, H, D]: the peers' gradients of our slots
            dkv = torch.zeros((k.shape[2], *back.shape[1:]), dtype=acc, device=k.device)
            dkv.index_add_(0, plan.send_index, back)
            mk, mv = stream_views(dkv)
            dk += mk
            dv += mv
        ds = None if sinks is None else sink_grad(grad_out, out, lse, sinks)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), *([None] * 5), ds


def selective_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    plan: SelectivePlan,
    group: ProcessGroup | None,
    *,
    scale: float,
    backend: KernelBackend = "auto",
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Differentiable selective CP attention (inputs already validated).

    Args:
        q: ``[B, Hq, L, D]`` local queries.
        k: ``[B, Hkv, L, D]`` local keys.
        v: ``[B, Hkv, L, D]`` local values.
        plan: This rank's exchange and kernel plans (:func:`selective_plan`).
        group: CP process group, or ``None`` for world size 1.
        scale: Score scale.
        backend: Kernel backend.
        softcap: Soft-cap of the scores, or ``None``.
        sinks: ``[Hq]`` attention-sink logits (:func:`~cpshard.attention.merge.add_sinks`), or
            ``None``.

    Returns:
        ``[B, Hq, L, D]`` in q's dtype.
    """
    out: torch.Tensor = _SelectiveAttention.apply(  # type: ignore[no-untyped-call]
        q, k, v, plan, group, scale, backend, softcap, sinks
    )
    return out


class SelectiveMethod:
    """The ``"selective"`` strategy: plans, input check, forward (backward by autograd)."""

    name = "selective"

    def check(self, q_heads: int, kv_heads: int, world: int) -> None:
        """Every head count and CP size is served: nothing to refuse."""

    def plans(
        self, plan: AttentionPlan, causal: bool, window: int | None, device: torch.device
    ) -> SelectivePlan:
        """This rank's :class:`SelectivePlan` (cached on the batch's token meta)."""
        return selective_plan(plan.meta, causal, window, device)

    def planned(
        self, plan: AttentionPlan, causal: bool, window: int | None, device: torch.device
    ) -> bool:
        """Whether :meth:`plans` would only read the plan cached on the token meta."""
        return selective_planned(plan.meta, causal, window, device)

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
        """:func:`selective_attention` with the plan of :meth:`plans`."""
        return selective_attention(
            q, k, v, plans, group, scale=scale, backend=backend, softcap=softcap, sinks=sinks
        )
