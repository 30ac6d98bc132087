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
on the rows the mask connects them to (:func:`_zero_rows`, :func:`_poison`): the affected
document gets NaN as it would alone, the others are untouched. Unmasked tasks (``FULL``,
``CAUSAL``) pair one document with itself (``IDENT``: a pad with itself), so nothing crosses there.
The bad rows are found once per attention call on the query side (:class:`BadQueries`, shared by
every key block of the call: the ring's hops, the local and remote keys) and once per key block
on the key side; only the masked tiles' slices are zeroed, never a copy of the whole (gathered)
K/V.

Import rules: the rows of ``RULES`` in tests/unit/test_architecture.py that cover this module.
"""

from __future__ import annotations

import torch

from cpshard.attention.kernels import KernelBackend, block_attention, block_attention_backward
from cpshard.attention.merge import accumulation_dtype, merge_into
from cpshard.attention.plan import PairPlan, Task
from cpshard.attention.softcap import softcap_attention, softcap_attention_backward

__all__ = ["BadQueries", "attend", "attend_backward", "attend_backward_into"]


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


class BadQueries:
    """The non-finite query rows ``[B, Hq, Nq]`` of one attention call, found on first use.

    One object serves every key block the call attends (the ring's hops, the local and the
    remote keys of all-gather / selective), so the query side of the NaN guard is computed once
    per call; a call whose plans have no masked tile never computes it. Build it with
    :meth:`forward` or :meth:`backward`.
    """

    def __init__(
        self,
        rows: tuple[torch.Tensor, ...],
        out: torch.Tensor | None = None,
        lse: torch.Tensor | None = None,
    ) -> None:
        self._rows = rows
        self._out = out
        self._lse = lse
        self._bad: torch.Tensor | None = None

    @classmethod
    def forward(cls, q: torch.Tensor) -> BadQueries:
        """A query is bad when its ``q [B, Hq, Nq, D]`` row is not finite."""
        return cls((q,))

    @classmethod
    def backward(
        cls, grad_out: torch.Tensor, q: torch.Tensor, out: torch.Tensor, lse: torch.Tensor
    ) -> BadQueries:
        """A query is bad when its ``q``, ``grad_out`` or ``out`` (in q's dtype, as the kernel
        reads it) row ``[B, Hq, Nq, D]`` is not finite, or its ``lse [B, Hq, Nq]`` is NaN or
        ``+inf`` (``lse = -inf`` is a query that sees nothing)."""
        return cls((q, grad_out), out, lse)

    def get(self) -> torch.Tensor:
        """``[B, Hq, Nq]`` bool, ``True`` = a bad query row (computed on the first call only)."""
        if self._bad is None:
            rows = (
                self._rows
                if self._out is None
                else (*self._rows, self._out.to(self._rows[0].dtype))
            )
            bad = _bad_rows(*rows)
            if self._lse is not None:
                bad = bad | torch.isnan(self._lse) | torch.isposinf(self._lse)
            self._bad = bad
            self._rows, self._out, self._lse = (), None, None  # not held any longer
        return self._bad


def _masked(plan: PairPlan) -> bool:
    """Whether any task of ``plan`` runs on a tile mask (several documents in one tile)."""
    return any(t.mask is not None for _, tasks in plan.groups for t in tasks)


def _guard(
    plan: PairPlan, bad_q: BadQueries, k: torch.Tensor, v: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``(bad queries [B, Hq, Nq], bad keys [B, Hkv, Nk])`` of a plan with masked tiles (a key
    is bad when its k or v row is not finite), else ``None``: once per key block."""
    return (bad_q.get(), _bad_rows(k, v)) if _masked(plan) else None


def _guard_rows(
    guard: tuple[torch.Tensor, torch.Tensor] | None,
    rows: torch.Tensor | None,
    order: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``guard`` for one row group, rows and slots selected as the group's tensors are."""
    if guard is None:
        return None
    bad_q, bad_k = (_ordered(_rows(t, rows), order) for t in guard)
    return bad_q, bad_k


def _forward_tasks(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    tasks: tuple[Task, ...],
    guard: tuple[torch.Tensor, torch.Tensor] | None,
    out: torch.Tensor,
    lse: torch.Tensor,
    scale: float,
    backend: KernelBackend,
    softcap: float | None,
) -> None:
    for t in tasks:
        qs, ks, vs = q[:, :, t.q0 : t.q1], k[:, :, t.k0 : t.k1], v[:, :, t.k0 : t.k1]
        poisoned = None
        if t.mask is not None and guard is not None:
            # several documents in the tile: their non-finite rows are kept apart
            bq, bk = guard[0][:, :, t.q0 : t.q1], guard[1][:, :, t.k0 : t.k1]
            qs, ks, vs = _zero_rows(qs, bq), _zero_rows(ks, bk), _zero_rows(vs, bk)
            poisoned = bq | _reached(t.mask, bk, to_keys=False)
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
    bad_q: BadQueries | None = None,
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
        bad_q: ``BadQueries.forward(q)`` shared by every key block of the attention call (the
            query side of the NaN guard, computed once); ``None``: this call's own.

    Returns:
        ``(out [B, Hq, Nq, D], lse [B, Hq, Nq])`` in the accumulation dtype; queries that see
        no key have ``out = 0`` and ``lse = -inf``.
    """
    acc = accumulation_dtype(q.dtype)
    b, h, n, d = q.shape
    out = torch.zeros((b, h, n, d), dtype=acc, device=q.device)
    lse = torch.full((b, h, n), float("-inf"), dtype=acc, device=q.device)
    guard = _guard(plan, BadQueries.forward(q) if bad_q is None else bad_q, k, v)
    for g, (rows, tasks) in enumerate(plan.groups):
        order = plan.order_of(g)
        if rows is None and order is None:
            _forward_tasks(q, k, v, tasks, guard, out, lse, scale, backend, softcap)
            continue
        nb = b if rows is None else rows.shape[0]
        og = torch.zeros((nb, h, n, d), dtype=acc, device=q.device)
        lg = torch.full((nb, h, n), float("-inf"), dtype=acc, device=q.device)
        qg, kg, vg = (_ordered(_rows(t, rows), order) for t in (q, k, v))
        gg = _guard_rows(guard, rows, order)
        _forward_tasks(qg, kg, vg, tasks, gg, og, lg, scale, backend, softcap)
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
    guard: tuple[torch.Tensor, torch.Tensor] | None,
    dq: torch.Tensor,
    dk: torch.Tensor,
    dv: torch.Tensor,
    scale: float,
    backend: KernelBackend,
    softcap: float | None,
) -> None:
    for t in tasks:
        bad: tuple[torch.Tensor, torch.Tensor] | None = None
        go_, q_, o_, l_ = (x[:, :, t.q0 : t.q1] for x in (grad_out, q, out, lse))
        k_, v_ = k[:, :, t.k0 : t.k1], v[:, :, t.k0 : t.k1]
        if t.mask is not None and guard is not None:
            # several documents in the tile: their non-finite rows are kept apart (a bad
            # query's lse is read as 0)
            bq, bk = guard[0][:, :, t.q0 : t.q1], guard[1][:, :, t.k0 : t.k1]
            go_, q_, o_ = _zero_rows(go_, bq), _zero_rows(q_, bq), _zero_rows(o_, bq)
            k_, v_ = _zero_rows(k_, bk), _zero_rows(v_, bk)
            l_ = torch.where(bq, torch.zeros((), dtype=l_.dtype, device=l_.device), l_)
            # a bad query row and every query that sees a bad key; a bad key row and every key
            # that a bad query sees
            bad = (
                bq | _reached(t.mask, bk, to_keys=False),
                bk | _reached(t.mask, bq, to_keys=True),
            )
        args = (go_, q_, k_, v_, o_, l_)
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
    bad_q: BadQueries | None = None,
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
        bad_q: ``BadQueries.backward(grad_out, q, out, lse)`` shared by every key set of the
            backward call (computed once); ``None``: this call's own.

    Returns:
        Whether anything was added (``False`` when no query sees any key).
    """
    out_q = out.to(q.dtype)
    if bad_q is None:
        bad_q = BadQueries.backward(grad_out, q, out_q, lse)
    guard = _guard(plan, bad_q, k, v)
    for g, (rows, tasks) in enumerate(plan.groups):
        if not tasks:
            continue
        order = plan.order_of(g)
        if rows is None and order is None:
            _backward_tasks(
                grad_out, q, k, v, out_q, lse, tasks, guard, dq, dk, dv, scale, backend, softcap
            )
            continue
        gq, gk, gv = (torch.zeros_like(_rows(t, rows)) for t in (dq, dk, dv))
        go_, q_, k_, v_, o_, l_ = (
            _ordered(_rows(t, rows), order) for t in (grad_out, q, k, v, out_q, lse)
        )
        gg = _guard_rows(guard, rows, order)
        _backward_tasks(go_, q_, k_, v_, o_, l_, tasks, gg, gq, gk, gv, scale, backend, softcap)
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
