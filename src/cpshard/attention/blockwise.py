"""Run a precomputed :class:`~cpshard.attention.plan.PairPlan`: kernel calls merged in fp32.

Every task of the plan is one call of :func:`~cpshard.attention.kernels.block_attention` on static
slices of ``q`` and ``k``/``v`` (no mask, the kernel's ``is_causal``, or a prepared bounded tile
mask); partial results are merged with the online-softmax rule. Nothing here reads tensor values
on the host, so the per-layer work has no host-device sync and no data-dependent branching.

Non-finite values stay inside their document. A masked tile holds tokens of several documents,
and its kernel multiplies masked probabilities (exact zeros) with the other documents' values
(``0 * nan = nan``), or masks a NaN score additively (``nan - inf = nan``): a NaN or inf in one
document's q/k/v (or in its output gradient) would reach every other document of the tile. So in
a masked tile the non-finite rows are zeroed for the kernel (a masked pair's product is then an
exact zero; the visible pairs of finite rows compute exactly what they did) and put back as NaN
on the rows the mask connects them to (:func:`_finite_rows`, :func:`_poison`): the affected
document gets NaN as it would alone, the others are untouched. Unmasked tasks (``FULL``,
``CAUSAL``) pair one document with itself (``IDENT``: a pad with itself), so nothing crosses there.

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


def _bad_rows(*ts: torch.Tensor) -> torch.Tensor:
    """``[B, H, L]``: rows (last dim) of any of ``ts`` (same ``[B, H, L, D]``) not all finite.

    ``t * 0`` is an exact 0 for a finite value and NaN for inf / NaN, so its row sum is NaN
    exactly for a non-finite row (no overflow; cheaper than ``isfinite(t).all(-1)``).
    """
    bad = torch.isnan((ts[0] * 0).sum(-1))
    for t in ts[1:]:
        bad = bad | torch.isnan((t * 0).sum(-1))
    return bad


def _zero_rows(t: torch.Tensor, bad: torch.Tensor) -> torch.Tensor:
    """``t [B, H, L, D]`` with the rows ``bad [B, H, L]`` set to zero."""
    return torch.where(bad.unsqueeze(-1), torch.zeros((), dtype=t.dtype, device=t.device), t)


def _reached(mask: torch.Tensor, bad: torch.Tensor, *, to_keys: bool) -> torch.Tensor:
    """Rows the tile mask connects to a bad row of the other side, in any head.

    Head-blind on purpose: a visible pair is one document, so a row this marks is in the bad
    row's document anyway (that document's other heads become NaN too; no other document is
    touched), and the mask product runs once, not per head.

    Args:
        mask: Bool ``[B or 1, Lq, Lk]`` tile mask (``True`` = visible).
        bad: ``[B, H, Lk]`` bad keys (``to_keys=False``) or ``[B, H, Lq]`` bad queries.
        to_keys: Return the keys that see a bad query instead of the queries that see a bad key.

    Returns:
        ``[B, 1, Lq]`` queries (or ``[B, 1, Lk]`` keys) with a visible pair to a bad row.
    """
    m = mask.to(torch.float32)
    b = bad.any(dim=1).to(torch.float32)
    hits = torch.einsum("bqk,bq->bk" if to_keys else "bqk,bk->bq", m, b)
    return (hits > 0).unsqueeze(1)


def _poison(t: torch.Tensor, bad: torch.Tensor) -> torch.Tensor:
    """``t`` (``[B, H, L, D]`` or ``[B, H, L]``) with the rows ``bad [B, H, L]`` set to NaN."""
    if t.dim() == bad.dim() + 1:
        bad = bad.unsqueeze(-1)
    return torch.where(bad, torch.full((), float("nan"), dtype=t.dtype, device=t.device), t)


def _finite_rows(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The inputs of a pair's masked tiles: non-finite rows zeroed, once per call (not per tile).

    Returns:
        ``(q, k, v, bad_q [B, Hq, Lq], bad_k [B, Hkv, Lk])``: the bad rows are a non-finite
        query, a key whose k or v is not finite.
    """
    bad_q = _bad_rows(q)
    bad_k = _bad_rows(k, v)
    return _zero_rows(q, bad_q), _zero_rows(k, bad_k), _zero_rows(v, bad_k), bad_q, bad_k


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
    # several documents in a masked tile: their non-finite rows are kept apart
    guard = _finite_rows(q, k, v) if any(t.mask is not None for t in tasks) else None
    for t in tasks:
        qs, ks, vs = q[:, :, t.q0 : t.q1], k[:, :, t.k0 : t.k1], v[:, :, t.k0 : t.k1]
        poisoned = None
        if t.mask is not None and guard is not None:
            qz, kz, vz, bad_q, bad_k = guard
            qs, ks, vs = qz[:, :, t.q0 : t.q1], kz[:, :, t.k0 : t.k1], vz[:, :, t.k0 : t.k1]
            poisoned = bad_q[:, :, t.q0 : t.q1] | _reached(
                t.mask, bad_k[:, :, t.k0 : t.k1], to_keys=False
            )
        if softcap is None:
            o, l_ = block_attention(
                qs, ks, vs, mask=t.mask, is_causal=t.causal, scale=scale, backend=backend
            )
        else:
            o, l_ = softcap_attention(
                qs, ks, vs, mask=t.mask, is_causal=t.causal, scale=scale, softcap=softcap
            )
        if poisoned is not None:
            o, l_ = _poison(o, poisoned), _poison(l_, poisoned)
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


_BackwardArgs = tuple[
    torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor
]


def _finite_backward_rows(
    args: _BackwardArgs,
) -> tuple[_BackwardArgs, torch.Tensor, torch.Tensor]:
    """The backward inputs ``(grad_out, q, k, v, out, lse)`` of a pair's masked tiles with
    non-finite rows zeroed (a NaN lse: 0), once per call.

    Returns:
        The cleaned inputs, the bad queries ``[B, Hq, Lq]`` (q, grad_out, out or lse not finite;
        ``lse = -inf`` is a query that sees nothing) and bad keys ``[B, Hkv, Lk]`` (k or v).
    """
    go, q, k, v, out, lse = args
    bad_q = _bad_rows(q, go, out) | torch.isnan(lse) | torch.isposinf(lse)
    bad_k = _bad_rows(k, v)
    lse = torch.where(bad_q, torch.zeros((), dtype=lse.dtype, device=lse.device), lse)
    cleaned = (
        _zero_rows(go, bad_q), _zero_rows(q, bad_q), _zero_rows(k, bad_k), _zero_rows(v, bad_k),
        _zero_rows(out, bad_q), lse,
    )  # fmt: skip
    return cleaned, bad_q, bad_k


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
    full = (grad_out, q, k, v, out, lse)
    # several documents in a masked tile: their non-finite rows are kept apart
    guard = _finite_backward_rows(full) if any(t.mask is not None for t in tasks) else None
    for t in tasks:
        bad: tuple[torch.Tensor, torch.Tensor] | None = None
        src = full
        if t.mask is not None and guard is not None:
            src, bad_q, bad_k = guard
            bq, bk = bad_q[:, :, t.q0 : t.q1], bad_k[:, :, t.k0 : t.k1]
            # a bad query row and every query that sees a bad key; a bad key row and every key
            # that a bad query sees
            bad = (
                bq | _reached(t.mask, bk, to_keys=False),
                bk | _reached(t.mask, bq, to_keys=True),
            )
        go_, q_, k_, v_, o_, l_ = src
        args = (
            go_[:, :, t.q0 : t.q1],
            q_[:, :, t.q0 : t.q1],
            k_[:, :, t.k0 : t.k1],
            v_[:, :, t.k0 : t.k1],
            o_[:, :, t.q0 : t.q1],
            l_[:, :, t.q0 : t.q1],
        )
        if softcap is None:
            gq, gk, gv = block_attention_backward(
                *args, mask=t.mask, is_causal=t.causal, scale=scale, backend=backend
            )
        else:
            gq, gk, gv = softcap_attention_backward(
                *args, mask=t.mask, is_causal=t.causal, scale=scale, softcap=softcap
            )
        if bad is not None:
            gq, gk, gv = _poison(gq, bad[0]), _poison(gk, bad[1]), _poison(gv, bad[1])
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
