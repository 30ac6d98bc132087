"""Public CP attention entry points: :func:`cp_sdpa` and :func:`cp_attention`.

Every check runs on facts all ranks share (shapes, dtypes, the token meta, the group size) before
any collective, so a bad call raises the same ``ValueError`` on every rank and none is left
waiting in a collective.

Owns the argument checks and the resolution of ``method="auto"`` (:mod:`.cost`); the methods
themselves are strategy objects looked up by name in :mod:`.methods` (names from
:mod:`cpshard.names`).

Import rules: the rows of ``RULES`` in tests/unit/test_architecture.py that cover this module.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch.distributed import ProcessGroup
from torch.distributed.device_mesh import DeviceMesh

from cpshard._comm import cp_group, group_rank_and_size
from cpshard.attention.agree import agree_once
from cpshard.attention.autocast import autocast_inputs, autocast_off
from cpshard.attention.cost import CallShape, CostModel, choose_method, plan_facts
from cpshard.attention.hybrid import CPGrid, check_grid, hybrid_attention, kv_repeat, merged_meta
from cpshard.attention.kernels import COMPILE_BEFORE_2_13, KernelBackend
from cpshard.attention.methods import METHODS, method_named, servable
from cpshard.attention.plan import AttentionPlan, attention_plan, check_window
from cpshard.attention.softcap import check_softcap
from cpshard.names import ATTENTION_CHOICES, COMPILED_FROM_2_13, AttentionMethod
from cpshard.sharding.meta import TokenMeta

__all__ = ["AttentionMethod", "CPAttentionSharder", "cp_attention", "cp_sdpa"]


class CPAttentionSharder(Protocol):
    """What :func:`cp_attention` reads from a sharder (e.g. ``cpshard.CPSharder``)."""

    @property
    def cp_mesh(self) -> DeviceMesh | None:
        """The 1-D CP mesh, or ``None`` without CP."""

    @property
    def token_meta(self) -> TokenMeta | None:
        """Token meta of the batch the sharder last sharded, or ``None`` before that."""


def check_method(method: str) -> None:
    """Raise ``ValueError`` unless ``method`` is ``"auto"`` or a method of the registry."""
    if method not in ATTENTION_CHOICES:
        raise ValueError(
            f"unknown CP attention method {method!r}; valid methods are {', '.join(METHODS)}, "
            "or 'auto' (the cheapest by the cost model of cpshard.attention.cost)"
        )


def _validate(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    meta: TokenMeta,
    method: str,
    group: ProcessGroup | None,
    rank: int,
    world: int,
    plan: AttentionPlan | None,
    causal: bool,
    window: int | None,
    softcap: float | None,
    grid: CPGrid | None = None,
    grid_checked: bool = False,
) -> None:
    check_method(method)
    check_window(window, causal)
    check_softcap(softcap)
    if plan is not None and plan.meta is not meta:
        raise ValueError(
            f"the attention plan belongs to another batch's token meta (plan for rank "
            f"{plan.rank} of {plan.world_size}, local_len={plan.local_len}; meta for rank "
            f"{meta.rank} of {meta.world_size}, local_len={meta.local_len}); pass the plan built "
            "from this batch's meta (cpshard.attention.plan.attention_plan(meta)) or plan=None"
        )
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dim() != 4:
            raise ValueError(
                f"cp_sdpa needs {name} as [B, H, L, D], got shape {tuple(t.shape)}; "
                "transpose [B, L, H, D] inputs with .transpose(1, 2)"
            )
        if not t.is_floating_point():
            raise ValueError(f"cp_sdpa needs floating-point inputs, got {name}.dtype={t.dtype}")
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(
            f"q, k, v must share a dtype (as scaled_dot_product_attention requires outside "
            f"autocast), got {q.dtype}, {k.dtype}, {v.dtype}; cast them to one dtype, or call "
            "under torch.autocast, which casts them to its dtype (as it does for SDPA)"
        )
    if k.shape[:-1] != v.shape[:-1]:
        raise ValueError(
            f"k and v must agree on batch, heads and length, got {tuple(k.shape)} and "
            f"{tuple(v.shape)}"
        )
    b, hq, lq, d = q.shape
    _, hkv, lk, dk = k.shape
    if k.shape[0] != b or dk != d:
        raise ValueError(
            f"q {tuple(q.shape)} and k {tuple(k.shape)} must agree on batch and head_dim"
        )
    if hkv == 0 or hq % hkv != 0:
        raise ValueError(
            f"query heads must be a multiple of key/value heads (GQA), got Hq={hq}, Hkv={hkv}"
        )
    if lq != meta.local_len or lk != meta.local_len:
        raise ValueError(
            f"local sequence length must equal meta.local_len={meta.local_len}, got "
            f"q L={lq}, k L={lk}; shard q/k/v with the same sharder that built the meta"
        )
    if meta.positions.shape[0] not in (1, b):
        raise ValueError(
            f"meta batch dim must be 1 or B={b}, got {meta.positions.shape[0]}; "
            "build the meta from the same batch"
        )
    if meta.world_size != world or meta.rank != rank:
        raise ValueError(
            f"meta is for rank {meta.rank} of {meta.world_size} but the process group gives rank "
            f"{rank} of {world}; pass the CP group the batch was sharded over"
        )
    if grid is not None:
        # group lookups: checked eagerly, once per ctx() entry (the context's own grid and
        # group) or on every direct call
        if not grid_checked and not torch.compiler.is_compiling():
            check_grid(grid, group, rank, world)
        if method == "ulysses" and grid.splits_heads:
            raise ValueError(
                f"with a 2-D CP mesh ({grid.outer_size} cp_outer x {grid.inner_size} cp_inner) "
                "the attention method names the outer method, run across cp_outer while Ulysses "
                "runs inside cp_inner: pass 'ring', 'selective', 'all_gather' or 'auto', not "
                "'ulysses' (for Ulysses over the whole CP group pass the 1-D CP mesh)"
            )
    if method != "auto":
        method_named(method).check(hq, hkv, world)


def resolve_method(
    method: str,
    plan: AttentionPlan,
    shape: CallShape,
    world: int,
    cost_model: CostModel | None = None,
    outer: bool = False,
) -> str:
    """``method`` itself, or for ``"auto"`` the cheapest method that serves this call.

    Decided from global facts only (the batch's token meta and the call's shapes, equal on every
    rank), so every rank picks the same method without a collective; a method whose check refuses
    the call (ulysses with head counts not divisible by ``world``) is never picked, nor ulysses
    as the ``outer`` method of a 2-D CP mesh (:mod:`.hybrid`).
    """
    if method != "auto":
        return method
    # the choice is host work (numpy over the token meta): made once per batch, call shape and
    # cost model, and read back from the meta's cache by later calls (and compiled regions)
    key = _auto_key(shape, world, cost_model, outer)
    hit = plan.meta.plan_cache.get(key)
    if isinstance(hit, str):
        return hit
    model = CostModel() if cost_model is None else cost_model
    facts = plan_facts(plan.meta, shape.causal, shape.window, blocks=model.needs_blocks())
    candidates = servable(shape.q_heads, shape.kv_heads, world, outer)
    best, _ = choose_method(facts, shape, model, candidates)
    plan.meta.plan_cache[key] = best
    return best


def _auto_key(
    shape: CallShape, world: int, cost_model: CostModel | None, outer: bool = False
) -> str:
    # the shape's fields, not the dataclass: torch 2.11's dynamo cannot format a dataclass into
    # a string, so a compiled region could not even read an eagerly cached choice
    return (
        f"auto|{shape.batch}|{shape.q_heads}|{shape.kv_heads}|{shape.head_dim}|"
        f"{shape.itemsize}|{shape.causal}|{shape.window}|{world}|{outer}|{cost_model!r}"
    )


def _host_planning(
    method: str,
    plan: AttentionPlan,
    shape: CallShape,
    world: int,
    device: torch.device,
    outer: bool = False,
) -> tuple[str, Any]:
    """The method's name (``"auto"`` resolved) and its plans: host work, cached per batch."""
    name = resolve_method(method, plan, shape, world, outer=outer)
    return name, method_named(name).plans(plan, shape.causal, shape.window, device)


_FIRST_MET_IN_COMPILE = (
    "CP attention with a method choice ('auto') or a mask (causal / window) first met inside a "
    "torch.compile'd region: choosing the method and building its plan is host work (once per "
    "batch) that dynamo cannot trace. Under torch.compile(fullgraph=False) cpshard runs it "
    "outside the graph (one graph break). For fullgraph=True pass an explicit method "
    "(attention='ring', 'all_gather', 'selective', or 'ulysses' on a 1-D cp_mesh, to "
    "prepare_cp_forward / make_cp_batch_and_ctx) and build its plan before the compiled call: "
    "for all_gather, ring or ulysses on a 1-D cp_mesh "
    "cpshard.attention.plan.attention_plan(meta).for_method(method, causal, window, device) "
    "with the sharder's token_meta; for selective or a 2-D cp_mesh run one eager step of this "
    "batch first"
)

# Outside the trace: under fullgraph=False a graph break runs it eagerly (same result as an
# eager call); under fullgraph=True dynamo refuses it, its message carrying the reason.
_host_planning_outside_graph: Callable[..., tuple[str, Any]] = torch.compiler.disable(  # type: ignore[no-untyped-call]
    _host_planning, reason=_FIRST_MET_IN_COMPILE
)


def _planned(
    method: str,
    plan: AttentionPlan,
    shape: CallShape,
    world: int,
    device: torch.device,
    outer: bool = False,
) -> bool:
    """Whether :func:`_host_planning` would only read caches (nothing for the host to do)."""
    name = method
    if method == "auto":
        hit = plan.meta.plan_cache.get(_auto_key(shape, world, None, outer))
        if not isinstance(hit, str):
            return False
        name = hit
    return method_named(name).planned(plan, shape.causal, shape.window, device)


def method_and_plans(
    method: str,
    plan: AttentionPlan,
    shape: CallShape,
    world: int,
    device: torch.device,
    *,
    outer: bool = False,
) -> tuple[str, Any]:
    """The method's name (``"auto"`` resolved, same on every rank) and the plans it runs.

    Both are host work, cached per batch. Inside a ``torch.compile``'d region that finds them
    not cached yet, the work runs outside the graph (``torch.compiler.disable``): under
    ``fullgraph=False`` one graph break with the eager result, under ``fullgraph=True`` dynamo's
    refusal carrying the fix (:data:`_FIRST_MET_IN_COMPILE`). ``outer``: the method runs across
    the outer group of a 2-D CP mesh (``auto`` never picks ulysses there).
    """
    if torch.compiler.is_compiling() and not _planned(method, plan, shape, world, device, outer):
        return _host_planning_outside_graph(method, plan, shape, world, device, outer)
    return _host_planning(method, plan, shape, world, device, outer)


def _check_sinks(sinks: torch.Tensor | None, heads: int) -> None:
    if sinks is None:
        return
    if not isinstance(sinks, torch.Tensor) or not sinks.is_floating_point():
        raise ValueError(
            f"sinks must be a floating-point tensor [Hq] (one logit per query head), got "
            f"{type(sinks).__name__}"
        )
    if tuple(sinks.shape) != (heads,):
        raise ValueError(
            f"sinks must have shape [Hq]=({heads},) (one logit per query head), got "
            f"{tuple(sinks.shape)}"
        )


def cp_sdpa(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    group: ProcessGroup | None,
    meta: TokenMeta,
    method: str = "auto",
    causal: bool = True,
    scale: float | None = None,
    backend: KernelBackend = "auto",
    window: int | None = None,
    softcap: float | None = None,
    plan: AttentionPlan | None = None,
    sinks: torch.Tensor | None = None,
    grid: CPGrid | None = None,
) -> torch.Tensor:
    """Scaled dot-product attention over the global sequence from local CP shards.

    Query ``i`` sees key ``j`` iff they share a document id and (``causal``) key position
    ``<=`` query position (and ``q_pos - k_pos < window`` with a sliding window), with ids and
    positions from ``meta``, whatever the layout. The kernel calls come from the batch's
    :class:`~cpshard.attention.plan.AttentionPlan` (built once per meta and cached on it), so
    repeated calls (every layer, the backward) only run kernels and collectives.

    Args:
        q: ``[B, Hq, L, D]`` local queries, ``L = meta.local_len`` (any strides).
        k: ``[B, Hkv, L, D]`` local keys, ``Hq % Hkv == 0`` (GQA, not repeated).
        v: ``[B, Hkv, L, Dv]`` local values (``Dv`` may differ from ``D``: MLA).
        group: The CP process group; ``None`` (or size 1) runs the same code without collectives.
        meta: Token meta of the sharded batch (``meta.world_size`` equals the group size).
        method: ``"auto"`` (the cheapest method by :mod:`cpshard.attention.cost`, same on every
            rank), ``"all_gather"``, ``"ring"``, ``"ulysses"`` or ``"selective"`` (see
            :data:`AttentionMethod` and :mod:`cpshard.attention.methods`).
        causal: Causal masking by global position.
        scale: Score scale; ``None`` -> ``1 / sqrt(D)``.
        backend: Local kernel: ``"auto"`` (CPU flash op on CPU, fp32 math elsewhere),
            ``"cpu_flash"`` or ``"math"``.
        window: Sliding window (``None`` = none), a positive int; needs ``causal``.
        softcap: Soft-cap of the scores, ``cap * tanh(s / cap)`` (Gemma 2), or ``None``; runs
            the chunked math kernel of :mod:`cpshard.attention.softcap`.
        plan: The batch's attention plan; ``None`` -> the one cached on ``meta``.
        sinks: ``[Hq]`` attention-sink logits (gpt-oss ``s_aux``): one extra logit per head in
            the softmax denominator with a zero value row, merged once through the LSE after
            every key block; differentiable. ``None`` = no sinks.
        grid: The groups of a 2-D ``(cp_outer, cp_inner)`` CP mesh whose flattening is
            ``group`` (:func:`cpshard.attention.hybrid.cp_grid`), or ``None`` (1-D CP). With a
            grid, Ulysses runs inside ``cp_inner`` and ``method`` (not ``"ulysses"``) across
            ``cp_outer``; a query head count not divisible by the inner size runs ``method``
            over the whole CP group instead (:mod:`cpshard.attention.hybrid`).

    Under an active ``torch.autocast`` for the tensors' device, ``q``, ``k`` and ``v`` are cast
    to its dtype first, as SDPA does (:mod:`cpshard.attention.autocast`); the merge and the
    gradient accumulation stay fp32 either way.

    Before the first data collective on a batch's ``meta``, the ranks exchange the call's dtypes,
    shapes and options once (:mod:`cpshard.attention.agree`): a rank whose call differs raises
    on every rank instead of crashing in the K/V exchange.

    Returns:
        ``[B, Hq, L, Dv]`` in the compute dtype: q's dtype, or the autocast dtype under autocast.

    Raises:
        ValueError: unknown method, inconsistent shapes/dtypes (mixed q/k/v dtypes outside
            autocast), ranks whose calls differ, a meta that does not match the inputs or the
            group, a plan of another meta, a window that is not a positive int (or a window
            without causal masking), (ulysses) heads not divisible by the CP size, or a grid that
            does not factor ``group`` (or names ``"ulysses"``).
    """
    return run_sdpa(
        q, k, v, group=group, meta=meta, method=method, causal=causal, scale=scale,
        backend=backend, window=window, softcap=softcap, plan=plan, sinks=sinks, grid=grid,
        agreed=False, where="cp_sdpa",
    )  # fmt: skip


def run_sdpa(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    group: ProcessGroup | None,
    meta: TokenMeta,
    agreed: bool,
    where: str,
    method: str = "auto",
    causal: bool = True,
    scale: float | None = None,
    backend: KernelBackend = "auto",
    window: int | None = None,
    softcap: float | None = None,
    plan: AttentionPlan | None = None,
    sinks: torch.Tensor | None = None,
    grid: CPGrid | None = None,
    grid_checked: bool = False,
) -> torch.Tensor:
    """:func:`cp_sdpa` for cpshard's own routes: its arguments, plus ``agreed`` (``True`` when
    the caller made the ranks agree on this call already: the step tracker of a ``ctx()``;
    otherwise :func:`~cpshard.attention.agree.agree_once` runs), ``where`` (the public entry
    point, for messages) and ``grid_checked`` (``True`` when ``grid`` was checked against
    ``group`` already: a ``ctx()``'s own grid, checked at its entry)."""
    q, k, v = autocast_inputs(q, k, v)
    rank, world = (0, 1) if group is None else group_rank_and_size(group)
    if group is not None and world > 1 and not agreed:
        agree_once(
            q, k, v, group, meta, method=method, causal=causal, window=window, softcap=softcap,
            sinks=sinks, where=where,
        )  # fmt: skip
    _validate(
        q, k, v, meta, method, group, rank, world, plan, causal, window, softcap, grid,
        grid_checked,
    )  # fmt: skip
    _check_sinks(sinks, q.shape[1])
    if group is not None and world == 1:
        group = None
    plan = attention_plan(meta) if plan is None else plan
    shape = CallShape(
        q.shape[0], q.shape[1], k.shape[1], q.shape[-1], q.element_size(), causal, window
    )
    dv = v.shape[-1]
    if scale is None:
        scale = 1.0 / math.sqrt(q.shape[-1])
    q, k, v = _same_head_dim(q, k, v)
    # 2-D CP: Ulysses inside cp_inner, the method across cp_outer on the merged shards; a query
    # head count the inner size does not divide runs the method over the whole CP group
    hybrid = grid is not None and grid.splits_heads and q.shape[1] % grid.inner_size == 0
    run_group, run_world = group, world
    if hybrid:
        assert grid is not None
        u = grid.inner_size
        plan = attention_plan(merged_meta(meta, u))
        run_group, run_world = grid.outer, grid.outer_size
        hkv = k.shape[1] * kv_repeat(k.shape[1], u)
        shape = CallShape(
            q.shape[0], q.shape[1] // u, hkv // u, q.shape[-1], q.element_size(), causal, window
        )
    # only a call that splits heads runs its method across cp_outer alone: a grid with a 1-wide
    # cp_inner (U = 1: Ulysses there is the identity) or the head-count fallback is 1-D CP over
    # the whole group, where auto weighs every method, Ulysses included, as explicit names allow
    name, plans = method_and_plans(method, plan, shape, run_world, q.device, outer=hybrid)
    chosen = method_named(name)
    # torch < 2.13 (seen on 2.11): torch.compile(fullgraph=True) of the gathering methods gives
    # the right output but wrong q/k/v gradients (root cause not isolated: not the attention
    # kernel, not the collectives' staging buffers); eager is exact. The ring's compiled path
    # (traced all-to-all hops) is checked on 2.13 only: refused there too (names.py)
    if (
        COMPILE_BEFORE_2_13
        and torch.compiler.is_compiling()
        and group is not None
        and name in COMPILED_FROM_2_13
    ):
        raise ValueError(
            f"CP attention ({name}) inside torch.compile on torch {torch.__version__}: its "
            "compiled backward is not exact on torch < 2.13 (seen on 2.11: the output is "
            "right, the q/k/v gradients are not; exact on torch 2.13). Under torch.compile on "
            "this torch use attention='ulysses' on a 1-D cp_mesh (prepare_cp_forward / "
            "make_cp_batch_and_ctx; a 2-D cp_mesh has no method compiled exactly there), run "
            "this model eagerly, or upgrade torch to 2.13"
        )
    cap = None if softcap is None else float(softcap)
    with autocast_off(q.device):  # the methods' fp32 accumulation stays fp32
        if hybrid:
            assert grid is not None
            out = hybrid_attention(
                q, k, v, chosen, plans, grid, scale=float(scale), backend=backend, softcap=cap,
                sinks=sinks,
            )  # fmt: skip
        else:
            out = chosen.apply(
                q, k, v, plans, run_group, scale=float(scale), backend=backend, softcap=cap,
                sinks=sinks,
            )  # fmt: skip
    return out if out.shape[-1] == dv else out[..., :dv]


def _same_head_dim(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, k, v with one head dim: the narrower side zero-padded (exact, differentiable).

    MLA models (DeepSeek-V2/V3, Kimi-K2, MiniCPM3, ...) have a value head dim ``Dv`` other than
    the query/key head dim ``D``. Zero columns of ``v`` give zero output columns (sliced off by
    the caller); zero columns of ``q`` and ``k`` leave every score unchanged (the scale is fixed
    from ``D`` before padding). transformers' own flash-attention path pads the same way.
    """
    d, dv = q.shape[-1], v.shape[-1]
    if dv < d:
        v = F.pad(v, (0, d - dv))
    elif dv > d:
        q, k = F.pad(q, (0, dv - d)), F.pad(k, (0, dv - d))
    return q, k, v


def cp_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    sharder: CPAttentionSharder,
    method: str = "auto",
    causal: bool = True,
    scale: float | None = None,
    window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """CP attention for models that call it explicitly, with the group and meta of a sharder.

    Args:
        q: ``[B, Hq, L, D]`` local queries.
        k: ``[B, Hkv, L, D]`` local keys.
        v: ``[B, Hkv, L, Dv]`` local values (``Dv`` may differ from ``D``: MLA).
        sharder: Anything with ``cp_mesh`` (1-D ``DeviceMesh`` or ``None``) and ``token_meta``.
        method: See :func:`cp_sdpa`.
        causal: Causal masking by global position.
        scale: Score scale; ``None`` -> ``1 / sqrt(D)``.
        window: Sliding window (``None`` = none).
        softcap: Soft-cap of the scores, or ``None``.

    Inside a tracked ``ctx()`` the call is one of the forward's CP attention calls (its step
    tracker compares the forward's first call across the ranks); elsewhere the ranks agree on the
    first call of each batch (:mod:`cpshard.attention.agree`).

    Returns:
        ``[B, Hq, L, Dv]`` in the compute dtype (q's, or the autocast dtype under autocast).

    Raises:
        ValueError: the sharder has no token meta yet; inside a ``ctx()`` made for another batch
            than the sharder's last one (a sharder that has since sharded another batch); ranks
            whose calls differ (on every rank); or any error of :func:`cp_sdpa`.
    """
    from cpshard.attention.context import (  # imports this module
        attend_in_active_context,
        check_meta_of_active_context,
    )

    meta = sharder.token_meta
    if meta is None:
        raise ValueError(
            "cp_attention needs sharder.token_meta, which is None: the sharder has not sharded a "
            "batch yet; call it through prepare_cp_forward / shard_batch first"
        )
    check_meta_of_active_context(meta, "cp_attention")
    group = cp_group(sharder.cp_mesh)
    # inside a tracked ctx() the call is one of its forward's CP attention calls (the step
    # tracker makes the ranks agree at the forward's first); elsewhere agree_once does
    routed = attend_in_active_context(
        q, k, v, group, meta, method=method, causal=causal, scale=scale, window=window,
        softcap=softcap,
    )  # fmt: skip
    if routed is not None:
        return routed
    return run_sdpa(
        q, k, v, group=group, meta=meta, agreed=False, where="cp_attention", method=method,
        causal=causal, scale=scale, window=window, softcap=softcap,
    )  # fmt: skip
