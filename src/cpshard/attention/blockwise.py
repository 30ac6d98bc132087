"""Run a precomputed :class:`~cpshard.attention.plan.PairPlan`: kernel calls merged in fp32.

Every task of the plan is one call of :func:`~cpshard.attention.kernels.block_attention` on static
slices of ``q`` and ``k``/``v`` (no mask, the kernel's ``is_causal``, or a prepared bounded tile
mask); partial results are merged with the online-softmax rule. Nothing here reads tensor values
on the host, so the per-layer work has no host-device sync and no data-dependent branching.

Import rules: the rows of ``RULES`` in tests/unit/test_architecture.py that cover this module.
"""

from __future__ import annotations

import torch

from cpshard.attention.kernels import KernelBackend, block_attention, block_attention_backward
from cpshard.attention.merge import accumulation_dtype, merge_into
from cpshard.attention.plan import PairPlan, Task
from cpshard.attention.softcap import softcap_attention, softcap_attention_backward

__all__ = ["attend", "attend_backward", "attend_backward_into"]


def _rows(t: torch.Tensor, rows: torch.Tensor | None) -> torch.Tensor:
    return t if rows is None else t.index_select(0, rows)


def _ordered(t: torch.Tensor, order: torch.Tensor | None) -> torch.Tensor:
    """Slots (dim 2) of ``t`` in the plan's slot order (see ``PairPlan.slot_order``)."""
    return t if order is None else t.index_select(2, order)


def _forward_tasks(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    tasks: tuple[Task, ...],
    out: torch.Tensor,
    lse: torch.Tensor,
    scale: float,
    backend: KernelBackend,
    softcap: float | None,
) -> None:
    for t in tasks:
        qs, ks, vs = q[:, :, t.q0 : t.q1], k[:, :, t.k0 : t.k1], v[:, :, t.k0 : t.k1]
        if softcap is None:
            o, l_ = block_attention(
                qs, ks, vs, mask=t.mask, is_causal=t.causal, scale=scale, backend=backend
            )
        else:
            o, l_ = softcap_attention(
                qs, ks, vs, mask=t.mask, is_causal=t.causal, scale=scale, softcap=softcap
            )
        if t.first:
            out[:, :, t.q0 : t.q1] = o
            lse[:, :, t.q0 : t.q1] = l_
        else:
            merge_into(out[:, :, t.q0 : t.q1], lse[:, :, t.q0 : t.q1], o, l_)


def attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    plan: PairPlan,
    *,
    scale: float,
    backend: KernelBackend = "auto",
    softcap: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of ``q`` against ``k``/``v`` as planned, merged in fp32.

    Args:
        q: ``[B, Hq, Nq, D]`` queries (the plan's query slots).
        k: ``[B, Hkv, Nk, D]`` keys (the plan's key slots).
        v: ``[B, Hkv, Nk, D]`` values.
        plan: The pair's plan.
        scale: Score scale.
        backend: Kernel backend.
        softcap: Soft-cap of the scores (:mod:`cpshard.attention.softcap`), or ``None``.

    Returns:
        ``(out [B, Hq, Nq, D], lse [B, Hq, Nq])`` in the accumulation dtype; queries that see
        no key have ``out = 0`` and ``lse = -inf``.
    """
    acc = accumulation_dtype(q.dtype)
    b, h, n, d = q.shape
    out = torch.zeros((b, h, n, d), dtype=acc, device=q.device)
    lse = torch.full((b, h, n), float("-inf"), dtype=acc, device=q.device)
    for g, (rows, tasks) in enumerate(plan.groups):
        order = plan.order_of(g)
        if rows is None and order is None:
            _forward_tasks(q, k, v, tasks, out, lse, scale, backend, softcap)
            continue
        nb = b if rows is None else rows.shape[0]
        og = torch.zeros((nb, h, n, d), dtype=acc, device=q.device)
        lg = torch.full((nb, h, n), float("-inf"), dtype=acc, device=q.device)
        qg, kg, vg = (_ordered(_rows(t, rows), order) for t in (q, k, v))
        _forward_tasks(qg, kg, vg, tasks, og, lg, scale, backend, softcap)
        if order is not None:  # back to the tensors' own slot order
            og = torch.empty_like(og).index_copy_(2, order, og)
            lg = torch.empty_like(lg).index_copy_(2, order, lg)
        if rows is None:
            out, lse = og, lg
        else:
            out.index_copy_(0, rows, og)
            lse.index_copy_(0, rows, lg)
    return out, lse


def _backward_tasks(
    grad_out: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    tasks: tuple[Task, ...],
    dq: torch.Tensor,
    dk: torch.Tensor,
    dv: torch.Tensor,
    scale: float,
    backend: KernelBackend,
    softcap: float | None,
) -> None:
    for t in tasks:
        args = (
            grad_out[:, :, t.q0 : t.q1],
            q[:, :, t.q0 : t.q1],
            k[:, :, t.k0 : t.k1],
            v[:, :, t.k0 : t.k1],
            out[:, :, t.q0 : t.q1],
            lse[:, :, t.q0 : t.q1],
        )
        if softcap is None:
            gq, gk, gv = block_attention_backward(
                *args, mask=t.mask, is_causal=t.causal, scale=scale, backend=backend
            )
        else:
            gq, gk, gv = softcap_attention_backward(
                *args, mask=t.mask, is_causal=t.causal, scale=scale, softcap=softcap
            )
        dq[:, :, t.q0 : t.q1] += gq
        dk[:, :, t.k0 : t.k1] += gk
        dv[:, :, t.k0 : t.k1] += gv


def attend_backward_into(
    grad_out: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    plan: PairPlan,
    dq: torch.Tensor,
    dk: torch.Tensor,
    dv: torch.Tensor,
    *,
    scale: float,
    backend: KernelBackend = "auto",
    softcap: float | None = None,
) -> bool:
    """Add the gradients of :func:`attend` for one key set into caller-owned accumulators.

    Only task-sized temporaries are allocated (plus one row-group copy for per-row plans).

    Args:
        grad_out: ``[B, Hq, Nq, D]`` upstream gradient.
        q: ``[B, Hq, Nq, D]`` queries.
        k: ``[B, Hkv, Nk, D]`` keys.
        v: ``[B, Hkv, Nk, D]`` values.
        out: ``[B, Hq, Nq, D]`` global output (merged over every key set).
        lse: ``[B, Hq, Nq]`` global LSE.
        plan: The pair's plan.
        dq: ``[B, Hq, Nq, D]`` accumulator (accumulation dtype, any strides), added to in place.
        dk: ``[B, Hkv, Nk, D]`` accumulator, added to in place.
        dv: ``[B, Hkv, Nk, D]`` accumulator, added to in place.
        scale: Score scale.
        backend: Kernel backend.
        softcap: As in :func:`attend`.

    Returns:
        Whether anything was added (``False`` when no query sees any key).
    """
    out_q = out.to(q.dtype)
    for g, (rows, tasks) in enumerate(plan.groups):
        if not tasks:
            continue
        order = plan.order_of(g)
        if rows is None and order is None:
            _backward_tasks(
                grad_out, q, k, v, out_q, lse, tasks, dq, dk, dv, scale, backend, softcap
            )
            continue
        gq, gk, gv = (torch.zeros_like(_rows(t, rows)) for t in (dq, dk, dv))
        go_, q_, k_, v_, o_, l_ = (
            _ordered(_rows(t, rows), order) for t in (grad_out, q, k, v, out_q, lse)
        )
        _backward_tasks(go_, q_, k_, v_, o_, l_, tasks, gq, gk, gv, scale, backend, softcap)
        if order is not None:  # back to the tensors' own slot order
            gq, gk, gv = (torch.zeros_like(t).index_add_(2, order, t) for t in (gq, gk, gv))
        if rows is None:
            dq += gq
            dk += gk
            dv += gv
        else:
            dq.index_add_(0, rows, gq)
            dk.index_add_(0, rows, gk)
            dv.index_add_(0, rows, gv)
    return not plan.empty


def attend_backward(
    grad_out: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    plan: PairPlan,
    *,
    scale: float,
    backend: KernelBackend = "auto",
    softcap: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of :func:`attend` for one key set, given the global ``out``/``lse``.

    Args:
        grad_out: ``[B, Hq, Nq, D]`` upstream gradient.
        q: ``[B, Hq, Nq, D]`` queries.
        k: ``[B, Hkv, Nk, D]`` keys.
        v: ``[B, Hkv, Nk, D]`` values.
        out: ``[B, Hq, Nq, D]`` global output.
        lse: ``[B, Hq, Nq]`` global LSE.
        plan: The pair's plan.
        scale: Score scale.
        backend: Kernel backend.
        softcap: As in :func:`attend`.

    Returns:
        ``(dq, dk, dv)`` in the accumulation dtype, shaped like ``q``, ``k``, ``v`` (zeros where
        no query sees a key).
    """
    acc = accumulation_dtype(q.dtype)
    dq = torch.zeros(q.shape, dtype=acc, device=q.device)
    dk = torch.zeros(k.shape, dtype=acc, device=k.device)
    dv = torch.zeros(v.shape, dtype=acc, device=v.device)
    attend_backward_into(
        grad_out, q, k, v, out, lse, plan, dq, dk, dv, scale=scale, backend=backend,
        softcap=softcap,
    )  # fmt: skip
    return dq, dk, dv
