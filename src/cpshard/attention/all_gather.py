"""All-gather CP attention (Llama-3 style): gather K/V over the group, attend locally.

Forward: one all-gather of the local ``(k, v)`` stacked sequence-major (``[L, 2, B, H, D]``), so
the gathered buffer is the rank-major stream and its k/v are strided views (no reordering copy);
the local queries attend to the whole stream with the mask from the token meta. The plan comes
cut in two (:meth:`~cpshard.attention.plan.AttentionPlan.all_gather_split`): while the gather is
in flight the queries attend to this rank's own keys, then to the gathered remote keys; the two
partial results are merged in fp32 by their LSE.

Backward: the remote keys' dK/dV first, into one fp32 buffer of the gathered layout (this rank's
own chunk stays zero); its reduce-scatter (sum) back to the owning ranks then runs while the own
keys' gradients are computed, which are added to the received sum.
Bytes sent per rank and layer: ``(C-1)/C * S * 2 * Hkv * D * itemsize`` forward.

Under ``torch.compile`` (dynamo cannot trace async work handles) the same two plans run with
synchronous collectives: same results, no overlap.

:class:`AllGatherMethod` is the method's strategy object (its plans, input check and the
differentiable forward whose backward is above), registered in :mod:`cpshard.attention.methods`.

Import rules: the rows of ``RULES`` in tests/unit/test_architecture.py that cover this module.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed import ProcessGroup

from cpshard._comm import Transfer, all_gather_stacked_start, reduce_scatter_stacked_start
from cpshard.attention.autocast import backward_without_autocast
from cpshard.attention.blockwise import BadQueries, attend, attend_backward_into
from cpshard.attention.kernels import KernelBackend, pick_backend
from cpshard.attention.merge import accumulation_dtype, add_sinks, merge_into, sink_grad
from cpshard.attention.plan import AttentionPlan, PairPlan

__all__ = ["AllGatherMethod", "all_gather_attention", "seq_major", "stream_views"]


def seq_major(k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """``k, v [B, H, L, D]`` -> one contiguous ``[L, 2, B, H, D]`` (sequence-major)."""
    return torch.stack([k.permute(2, 0, 1, 3), v.permute(2, 0, 1, 3)], dim=1)


def stream_views(buf: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``[N, 2, B, H, D]`` -> strided views ``(k, v)`` ``[B, H, N, D]`` of it, no copy."""
    return buf[:, 0].permute(1, 2, 0, 3), buf[:, 1].permute(1, 2, 0, 3)


class _AllGatherAttention(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        local: PairPlan,
        remote: PairPlan,
        group: ProcessGroup | None,
        scale: float,
        backend: KernelBackend,
        softcap: float | None,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        full: torch.Tensor | None = None
        pending: Transfer | None = None
        if group is not None:
            # Sequence-major, the gathered buffer [C*L, 2, B, H, D] is the rank-major stream and
            # its k/v are plain strided views: no reordering copy of the full K/V.
            pending = all_gather_stacked_start(seq_major(k, v), group)
        bad_q = BadQueries.forward(q)  # the NaN guard's query rows, for both key sets
        # This rank's own keys need no communication: attend to them while the gather runs.
        out, lse = attend(
            q, k, v, local, scale=scale, backend=backend, softcap=softcap, bad_q=bad_q
        )
        if pending is not None:
            full = pending.wait()[0].flatten(0, 1)
        if full is not None and not remote.empty:
            k_all, v_all = stream_views(full)
            o, l_ = attend(
                q, k_all, v_all, remote, scale=scale, backend=backend, softcap=softcap, bad_q=bad_q
            )
            merge_into(out, lse, o, l_)
            del o, l_
        if sinks is not None:
            add_sinks(out, lse, sinks)
        result = out.to(q.dtype)
        # As in the ring: keep the returned tensor, not an fp32 copy, for the flash backward.
        keep = result if pick_backend(q, backend) == "cpu_flash" else out
        ctx.save_for_backward(q, k, v, full, keep, lse, sinks)
        ctx.args = (local, remote, group, scale, backend, softcap)
        return result

    @staticmethod
    @backward_without_autocast
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        q, k, v, full, out, lse, sinks = ctx.saved_tensors
        local, remote, group, scale, backend, softcap = ctx.args
        acc = accumulation_dtype(q.dtype)
        grad_out = grad_out.contiguous()
        out_q = out.to(q.dtype)  # as the kernels read it: converted once, not once per key set
        bad_q = BadQueries.backward(grad_out, q, out_q, lse)  # one for the remote and local keys
        dq = torch.zeros(q.shape, dtype=acc, device=q.device)
        pending: Transfer | None = None
        if full is not None:
            k_all, v_all = stream_views(full)
            # The remote keys' gradients, in one fp32 buffer of the gathered layout: its rank-major
            # chunks are what the reduce-scatter sends (this rank's own chunk stays zero here).
            dfull = torch.zeros(full.shape, dtype=acc, device=full.device)
            dk_all, dv_all = stream_views(dfull)
            attend_backward_into(
                grad_out, q, k_all, v_all, out_q, lse, remote, dq, dk_all, dv_all, scale=scale,
                backend=backend, softcap=softcap, bad_q=bad_q,
            )  # fmt: skip
            chunks = dfull.view(-1, q.shape[2], *dfull.shape[1:])  # [C, L, 2, B, H, D]
            pending = reduce_scatter_stacked_start(chunks, group)
            del dfull, dk_all, dv_all, chunks
        # The own keys' gradients while the reduce-scatter runs.
        dk = torch.zeros(k.shape, dtype=acc, device=k.device)
        dv = torch.zeros(v.shape, dtype=acc, device=v.device)
        attend_backward_into(
            grad_out, q, k, v, out_q, lse, local, dq, dk, dv, scale=scale, backend=backend,
            softcap=softcap, bad_q=bad_q,
        )  # fmt: skip
        if pending is not None:
            mk, mv = stream_views(pending.wait()[0])
            dk += mk
            dv += mv
        ds = None if sinks is None else sink_grad(grad_out, out, lse, sinks)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), *([None] * 6), ds


def all_gather_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    local: PairPlan,
    remote: PairPlan,
    group: ProcessGroup | None,
    *,
    scale: float,
    backend: KernelBackend = "auto",
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Differentiable all-gather CP attention (inputs already validated).

    Args:
        q: ``[B, Hq, L, D]`` local queries.
        k: ``[B, Hkv, L, D]`` local keys.
        v: ``[B, Hkv, L, D]`` local values.
        local: Local queries against this rank's own block ``[L]``.
        remote: Local queries against the whole rank-major stream ``[C * L]``, this rank's
            block skipped (see :meth:`~cpshard.attention.plan.AttentionPlan.all_gather_split`).
        group: CP process group, or ``None`` for world size 1.
        scale: Score scale.
        backend: Kernel backend.
        softcap: Soft-cap of the scores, or ``None``.
        sinks: ``[Hq]`` attention-sink logits (:func:`~cpshard.attention.merge.add_sinks`), or
            ``None``.

    Returns:
        ``[B, Hq, L, D]`` in q's dtype.
    """
    out: torch.Tensor = _AllGatherAttention.apply(  # type: ignore[no-untyped-call]
        q, k, v, local, remote, group, scale, backend, softcap, sinks
    )
    return out


class AllGatherMethod:
    """The ``"all_gather"`` strategy: plans, input check, forward (backward by autograd)."""

    name = "all_gather"

    def check(self, q_heads: int, kv_heads: int, world: int) -> None:
        """Every head count and CP size is served: nothing to refuse."""

    def plans(
        self, plan: AttentionPlan, causal: bool, window: int | None, device: torch.device
    ) -> tuple[PairPlan, PairPlan]:
        """``(local, remote)`` of :meth:`~cpshard.attention.plan.AttentionPlan.all_gather_split`."""
        return plan.all_gather_split(causal, window, device)

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
        """:func:`all_gather_attention` with the plans of :meth:`plans`."""
        local, remote = plans
        return all_gather_attention(
            q, k, v, local, remote, group, scale=scale, backend=backend, softcap=softcap,
            sinks=sinks,
        )  # fmt: skip
