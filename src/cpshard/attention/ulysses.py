"""Ulysses CP attention: all-to-all from sequence shards to head shards and back.

Forward: one all-to-all turns the local ``[B, H, L, D]`` q/k/v (all three in one message) into
``[B, H/C, C*L, D]``: a ``1/C`` slice of the heads over the whole rank-major stream. Each rank
attends its heads over the stream with the mask from the token meta, and a second all-to-all
returns ``[B, Hq, L, D]``. Backward mirrors it. Needs ``Hq % C == 0`` and ``Hkv % C == 0``; query
head group ``j`` then uses exactly key head group ``j`` (the ``repeat_kv`` convention).

:class:`UlyssesMethod` is the method's strategy object (its plans, the head-count check and the
differentiable forward whose backward is above), registered in :mod:`cpshard.attention.methods`.

Import rules: the rows of ``RULES`` in tests/unit/test_architecture.py that cover this module.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed import ProcessGroup

from cpshard._comm import all_to_all_stacked, group_rank_and_size
from cpshard.attention.autocast import backward_without_autocast
from cpshard.attention.blockwise import attend, attend_backward
from cpshard.attention.kernels import KernelBackend
from cpshard.attention.merge import add_sinks, sink_grad
from cpshard.attention.plan import AttentionPlan, PairPlan

__all__ = ["UlyssesMethod", "head_slice", "heads_to_seq", "seq_to_heads", "ulysses_attention"]


def seq_to_heads(
    xs: list[torch.Tensor], group: ProcessGroup | None, world: int
) -> list[torch.Tensor]:
    """``[B, H_i, L, D]`` each -> ``[B, H_i/C, C*L, D]`` each, one all-to-all for all of them."""
    if group is None:
        return xs
    parts = [torch.unflatten(x, 1, (world, x.shape[1] // world)).transpose(0, 1) for x in xs]
    sizes = [p.shape[2] for p in parts]
    recv = all_to_all_stacked(torch.cat(parts, dim=2), group)  # [C(src), B, sum H_i/C, L, D]
    c, b, _, n, d = recv.shape
    return [
        r.permute(1, 2, 0, 3, 4).reshape(b, r.shape[2], c * n, d)
        for r in torch.split(recv, sizes, dim=2)
    ]


def heads_to_seq(
    ys: list[torch.Tensor], group: ProcessGroup | None, world: int
) -> list[torch.Tensor]:
    """Inverse of :func:`seq_to_heads`: ``[B, h_i, C*L, D]`` -> ``[B, h_i*C, L, D]``."""
    if group is None:
        return ys
    parts = [torch.unflatten(y, 2, (world, y.shape[2] // world)).permute(2, 0, 1, 3, 4) for y in ys]
    sizes = [p.shape[2] for p in parts]
    recv = all_to_all_stacked(torch.cat(parts, dim=2), group)  # [C(head group), B, h, L, D]
    c, b, _, n, d = recv.shape
    return [
        r.transpose(0, 1).reshape(b, c * r.shape[2], n, d) for r in torch.split(recv, sizes, dim=2)
    ]


def head_slice(t: torch.Tensor, group: ProcessGroup | None, world: int) -> torch.Tensor:
    """The ``[H / C]`` slice of a per-head ``[H]`` tensor that this rank attends (heads chunk r
    of the ``C`` ranks of ``group``; 2-D CP slices the sinks over ``cp_inner`` the same way)."""
    if group is None:
        return t
    n = t.shape[0] // world
    r = group_rank_and_size(group)[0]
    return t[r * n : (r + 1) * n]


class _UlyssesAttention(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        plan: PairPlan,
        group: ProcessGroup | None,
        world: int,
        scale: float,
        backend: KernelBackend,
        softcap: float | None,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        qh, kh, vh = seq_to_heads([q, k, v], group, world)
        out, lse = attend(qh, kh, vh, plan, scale=scale, backend=backend, softcap=softcap)
        mine = None
        if sinks is not None:  # this rank's slice of the heads
            mine = head_slice(sinks, group, world)
            add_sinks(out, lse, mine)
        ctx.save_for_backward(qh, kh, vh, out, lse, sinks, mine)
        ctx.args = (plan, group, world, scale, backend, softcap)
        (local,) = heads_to_seq([out.to(q.dtype)], group, world)
        return local

    @staticmethod
    @backward_without_autocast
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        qh, kh, vh, out, lse, sinks, mine = ctx.saved_tensors
        plan, group, world, scale, backend, softcap = ctx.args
        (gh,) = seq_to_heads([grad_out.contiguous()], group, world)
        res = attend_backward(
            gh, qh, kh, vh, out, lse, plan, scale=scale, backend=backend, softcap=softcap
        )
        dq, dk, dv = heads_to_seq(list(res), group, world)
        ds = None
        if sinks is not None:  # this rank's heads over the whole stream; zero elsewhere
            ds = torch.zeros_like(sinks)
            n = mine.shape[0]
            r = 0 if group is None else group_rank_and_size(group)[0]
            ds[r * n : (r + 1) * n] = sink_grad(gh, out, lse, mine)
        return dq.to(qh.dtype), dk.to(kh.dtype), dv.to(vh.dtype), *([None] * 6), ds


def ulysses_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    plan: PairPlan,
    group: ProcessGroup | None,
    world: int,
    *,
    scale: float,
    backend: KernelBackend = "auto",
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Differentiable Ulysses CP attention (inputs already validated, heads divisible by C).

    Args:
        q: ``[B, Hq, L, D]`` local queries.
        k: ``[B, Hkv, L, D]`` local keys.
        v: ``[B, Hkv, L, D]`` local values.
        plan: The whole rank-major stream ``[C * L]`` against itself.
        group: CP process group, or ``None`` for world size 1.
        world: CP size ``C``.
        scale: Score scale.
        backend: Kernel backend.
        softcap: Soft-cap of the scores, or ``None``.
        sinks: ``[Hq]`` attention-sink logits (:func:`~cpshard.attention.merge.add_sinks`), or
            ``None``.

    Returns:
        ``[B, Hq, L, D]`` in q's dtype.
    """
    out: torch.Tensor = _UlyssesAttention.apply(  # type: ignore[no-untyped-call]
        q, k, v, plan, group, world, scale, backend, softcap, sinks
    )
    return out


class UlyssesMethod:
    """The ``"ulysses"`` strategy: plans, head-count check, forward (backward by autograd)."""

    name = "ulysses"

    def check(self, q_heads: int, kv_heads: int, world: int) -> None:
        """Raise ``ValueError`` unless both head counts are divisible by the CP size."""
        for what, h in (("query", q_heads), ("key/value", kv_heads)):
            if h % world != 0:
                raise ValueError(
                    f"ulysses needs the number of {what} heads divisible by the CP size: got "
                    f"{h} {what} heads at cp_size={world}; use method='ring' or 'all_gather', "
                    f"or a CP size dividing {h}"
                )

    def plans(
        self, plan: AttentionPlan, causal: bool, window: int | None, device: torch.device
    ) -> PairPlan:
        """The whole stream against itself (:meth:`~AttentionPlan.ulysses`)."""
        return plan.ulysses(causal, window, device)

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
        """:func:`ulysses_attention` with the plan of :meth:`plans`."""
        world = 1 if group is None else group_rank_and_size(group)[1]
        return ulysses_attention(
            q, k, v, plans, group, world, scale=scale, backend=backend, softcap=softcap,
            sinks=sinks,
        )  # fmt: skip
