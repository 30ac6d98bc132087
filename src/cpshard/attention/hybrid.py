"""2-D CP attention: Ulysses inside ``cp_inner`` x an outer method across ``cp_outer`` (USP).

The CP group of ``C = R * U`` ranks is a 2-D ``(cp_outer, cp_inner)`` grid (a 2-D ``DeviceMesh``
with those dim names, :data:`cpshard._comm.CP_GRID_DIMS`). CP rank ``r = o * U + i`` sits at
``(o, i)``; the batch is sharded once over all ``C`` ranks (the flattened CP group), exactly as
in 1-D CP. Per attention call:

1. *Inner all-to-all* (Ulysses) over the ``U`` ranks of inner group ``o`` (CP ranks ``o*U ..
   o*U+U-1``): rank ``(o, i)`` gives away all but head slice ``i`` and receives slice ``i`` of
   the other inner ranks' tokens: ``[B, H/U, U*L, D]``. Those ``U*L`` tokens are the stream slots
   ``[o*U*L, (o+1)*U*L)``, so they form one shard of an ``R``-way sharding of the *same* stream:
   :func:`merged_meta` is the batch's token meta read with ``world_size = R`` (rank ``o``,
   ``local_len = U*L``), and every position and document id is known as before.
2. *Outer method* (``ring``, ``selective`` or ``all_gather``: the registry's own strategy
   objects, unchanged) over the ``R`` ranks of outer group ``i`` (CP ranks ``i, i+U, ...``), on
   the merged meta's plan, for its ``H/U`` heads.
3. The inverse all-to-all returns ``[B, Hq, L, D]``; the backward mirrors both all-to-alls
   (autograd Functions here) around the outer method's own backward.

Head counts (decided from the shapes, equal on every rank, so every rank takes the same path):

* ``Hq % U == 0``: query head slice ``i`` is ``[i*Hq/U, (i+1)*Hq/U)``. Its key/value heads
  under the ``repeat_kv`` convention (query head ``h`` reads kv head ``h // (Hq/Hkv)``) are a
  slice of the kv heads repeated ``rep = U / gcd(Hkv, U)`` times (``repeat_interleave``, so
  ``Hkv * rep = lcm(Hkv, U)`` divides by ``U`` and divides ``Hq``): nothing is repeated when
  ``U`` divides ``Hkv``; GQA with ``Hkv < U`` and MQA repeat the fewest heads that make the split
  exact (their gradients are summed back by autograd);
* ``Hq % U != 0`` (e.g. 3 heads at ``U = 2``): no head split exists, so the call runs the outer
  method over the whole flattened CP group on the batch's own meta, i.e. plain 1-D CP with that
  method (exact; it costs the outer method's 1-D communication). Documented, not an error: a
  model whose layers differ in head counts still runs every layer exactly.

Sinks (``[Hq]``) are sliced like the heads; each rank's gradient covers its heads over its merged
tokens, zero elsewhere, so the sum over the CP ranks is the full gradient (as with every method).

Usage: pass the 2-D mesh as ``cp_mesh`` to ``prepare_cp_forward`` / ``make_cp_batch_and_ctx``
(which shard over its flattening: the returned sharder's ``cp_mesh``, for the losses;
``sync_grads`` takes either) or to ``cp_attention_context``; ``attention`` names the outer method
(``"auto"`` chooses it on the merged meta; ``"ulysses"`` is refused). A grid whose ``cp_inner``
is 1 wide (``R x 1``: Ulysses inside it is the identity) is 1-D CP over the whole group: every
method is accepted there, and ``"auto"`` weighs them all, Ulysses included. ``cp_sdpa`` takes the
groups as ``grid=cp_grid(mesh)`` beside the flattened ``group``::

    mesh = init_device_mesh("cuda", (R, U), mesh_dim_names=("cp_outer", "cp_inner"))
    ctx, batch, sharder = cpshard.prepare_cp_forward(model, mesh, batch, attention="ring")

Bytes sent per rank and layer (forward, ``L`` local tokens, ``Hkv' = Hkv * rep``): the two
all-to-alls ``(U-1)/U * L * (2*Hq + 2*Hkv') * D``, plus the outer method on ``H/U`` heads of
``U*L`` tokens, e.g. the ring's ``(R-1) * L * 2*Hkv' * D`` (itemsize omitted). Against the 1-D
ring's ``(C-1) * L * 2*Hkv * D`` this wins when the kv heads are many (8 MHA heads at ``C = 4`` as
``2 x 2``, 32 against 48 units of ``L*D``) and loses for MQA, whose kv heads are repeated.
``attention="auto"`` chooses only the outer method; whether 2-D CP pays is the caller's choice
of mesh.

Import rules: the rows of ``RULES`` in tests/unit/test_architecture.py that cover this module.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed import ProcessGroup
from torch.distributed.device_mesh import DeviceMesh

from cpshard._comm import grid_groups, group_ranks
from cpshard.attention.kernels import KernelBackend
from cpshard.attention.methods import CPMethod
from cpshard.attention.ulysses import head_slice, heads_to_seq, seq_to_heads
from cpshard.sharding.meta import TokenMeta

__all__ = ["CPGrid", "check_grid", "cp_grid", "hybrid_attention", "kv_repeat", "merged_meta"]


@dataclass(frozen=True)
class CPGrid:
    """The two groups of a 2-D CP mesh.

    Attributes:
        inner: The ``cp_inner`` group of this rank (Ulysses), ``None`` when ``inner_size == 1``.
        outer: The ``cp_outer`` group of this rank (the outer method), ``None`` when
            ``outer_size == 1``.
        inner_size: ``U``.
        outer_size: ``R``.
    """

    inner: ProcessGroup | None
    outer: ProcessGroup | None
    inner_size: int
    outer_size: int

    @property
    def splits_heads(self) -> bool:
        """Whether the grid has an inner (Ulysses) dim at all (``U > 1``)."""
        return self.inner_size > 1


def cp_grid(mesh: DeviceMesh) -> CPGrid:
    """The :class:`CPGrid` of a validated 2-D ``("cp_outer", "cp_inner")`` mesh."""
    inner, outer = grid_groups(mesh)
    return CPGrid(inner, outer, mesh.size(1), mesh.size(0))


def check_grid(grid: CPGrid, group: ProcessGroup | None, rank: int, world: int) -> None:
    """Raise ``ValueError`` unless ``grid`` factors the CP group as ``(cp_outer, cp_inner)``.

    Local facts only (sizes and group memberships, no collective): ``R * U == C``, the inner
    group of CP rank ``r = o*U + i`` is CP ranks ``o*U .. o*U+U-1`` and its outer group CP ranks
    ``i, i+U, ...``, in that order.
    """
    u, r_size = grid.inner_size, grid.outer_size
    if u * r_size != world:
        raise ValueError(
            f"the 2-D CP mesh is {r_size} (cp_outer) x {u} (cp_inner) = {u * r_size} ranks but "
            f"the CP group (and the batch's token meta) has {world}; shard the batch over the "
            "flattened 2-D mesh (prepare_cp_forward / make_cp_batch_and_ctx do this for a 2-D "
            "cp_mesh)"
        )
    if group is None:
        return
    flat = group_ranks(group)
    o, i = divmod(rank, u)
    for what, sub, want in (
        ("cp_inner", grid.inner, flat[o * u : (o + 1) * u]),
        ("cp_outer", grid.outer, flat[i::u]),
    ):
        got = [flat[rank]] if sub is None else group_ranks(sub)
        if got != want:
            raise ValueError(
                f"the 2-D CP mesh's {what} group of CP rank {rank} holds global ranks {got}, "
                f"but the row-major factoring of the CP group {flat} as {r_size} x {u} needs "
                f"{want}; pass the 2-D mesh whose flattening is the CP group the batch was "
                "sharded over (init_device_mesh(device, (R, U), mesh_dim_names=('cp_outer', "
                "'cp_inner')))"
            )


def merged_meta(meta: TokenMeta, inner_size: int) -> TokenMeta:
    """``meta`` read as an ``R``-way sharding: rank ``rank // U``, ``local_len = U * L``.

    The inner all-to-all gives each rank of inner group ``o`` the stream slots
    ``[o*U*L, (o+1)*U*L)``, in order: the local tokens of merged rank ``o``. Cached on ``meta``
    (its plans are built once per batch), sharing its host copy of positions and documents.
    """
    key = f"ulysses_merged|{inner_size}"
    hit = meta.plan_cache.get(key)
    if isinstance(hit, TokenMeta):
        return hit
    merged = TokenMeta(
        meta.rank // inner_size, meta.world_size // inner_size, meta.positions, meta.document_ids
    )
    host = meta.plan_cache.get("host_rows")  # rank-independent: the whole stream's rows
    if host is not None:
        merged.plan_cache["host_rows"] = host
    meta.plan_cache[key] = merged
    return merged


def kv_repeat(kv_heads: int, inner_size: int) -> int:
    """How often each key/value head is repeated so that ``U`` divides the kv heads:
    ``U / gcd(Hkv, U)`` (``1`` when it already does)."""
    return inner_size // math.gcd(kv_heads, inner_size)


class _ToHeads(torch.autograd.Function):
    """Sequence shards -> head shards over the inner group (backward: the inverse)."""

    @staticmethod
    def forward(
        ctx: Any, group: ProcessGroup | None, world: int, *xs: torch.Tensor
    ) -> tuple[torch.Tensor, ...]:
        ctx.args = (group, world)
        outs = tuple(seq_to_heads(list(xs), group, world))
        ctx.like = [(o.shape, o.dtype, o.device) for o in outs]
        return outs

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
        group, world = ctx.args
        full = [
            torch.zeros(shape, dtype=dtype, device=device) if g is None else g.contiguous()
            for g, (shape, dtype, device) in zip(grads, ctx.like, strict=True)
        ]
        return None, None, *heads_to_seq(full, group, world)


class _ToSeq(torch.autograd.Function):
    """Head shards -> sequence shards over the inner group (backward: the inverse)."""

    @staticmethod
    def forward(ctx: Any, group: ProcessGroup | None, world: int, y: torch.Tensor) -> torch.Tensor:
        ctx.args = (group, world)
        return heads_to_seq([y], group, world)[0]

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        group, world = ctx.args
        return None, None, seq_to_heads([grad.contiguous()], group, world)[0]


def hybrid_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    method: CPMethod,
    plans: Any,
    grid: CPGrid,
    *,
    scale: float,
    backend: KernelBackend,
    softcap: float | None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Differentiable 2-D CP attention (inputs validated, ``Hq % U == 0``).

    Args:
        q: ``[B, Hq, L, D]`` local queries.
        k: ``[B, Hkv, L, D]`` local keys (any ``Hkv`` dividing ``Hq``).
        v: ``[B, Hkv, L, D]`` local values.
        method: The outer method's strategy object.
        plans: ``method.plans`` of the plan of :func:`merged_meta`.
        grid: The 2-D CP groups.
        scale: Score scale.
        backend: Kernel backend.
        softcap: Soft-cap of the scores, or ``None``.
        sinks: ``[Hq]`` attention-sink logits, or ``None``.

    Returns:
        ``[B, Hq, L, D]`` in q's dtype.
    """
    u = grid.inner_size
    rep = kv_repeat(k.shape[1], u)
    if rep > 1:  # GQA / MQA with U not dividing Hkv: each inner rank needs its q heads' kv heads
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    qh, kh, vh = _ToHeads.apply(grid.inner, u, q, k, v)  # type: ignore[no-untyped-call]
    mine = None if sinks is None else head_slice(sinks, grid.inner, u)
    out = method.apply(
        qh, kh, vh, plans, grid.outer, scale=scale, backend=backend, softcap=softcap, sinks=mine
    )
    result: torch.Tensor = _ToSeq.apply(grid.inner, u, out)  # type: ignore[no-untyped-call]
    return result
