"""The one dispatch: pick a sharder, shard the batch on the CP mesh, compose the context.

Resolution order: **model-owned > balanced > packed > round_robin > none**. The caller's code is
the same at every CP size: at ``cp_size == 1`` the sharder is the identity (``layout == "none"``)
and its verbs still work.

Owns the composition of the sharding layer with attention: a shard that brings no context of its
own (every built-in layout; :mod:`cpshard.sharding` knows nothing of attention) gets
cpshard's CP attention context over its token meta, with the caller's ``attention`` method; a
model-owned or custom ``shard_batch`` that returns its own context keeps it. An HF model's
attention switch wraps the result (:func:`cpshard.attention.hf.cp_attention_scope`).

Both public entry points keep their own signatures and share one pipeline
(:func:`run_prepare`): their keywords become one frozen :class:`cpshard.options.PrepareOptions`,
then the steps run in a fixed order: validate (the mesh, the model guard, the mixer verdict:
before any collective) -> fingerprint (the step header with the batch fingerprint, the one
collective, which carries the options too; then the options', the batch's and the pad id's
checks, alike on every rank) -> model hook -> resolve -> shard -> compose. Every check runs once
per call (:class:`PrepareChecks`).

Import rules: the rows of ``RULES`` in tests/unit/test_architecture.py that cover this module.
"""

from __future__ import annotations

import functools
import inspect
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, cast

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.nn.parallel import DataParallel, DistributedDataParallel

from cpshard import _comm
from cpshard.attention.auto import CHOICE_KEY, choose_for_batch
from cpshard.attention.context import cp_attention_context
from cpshard.attention.cost import CostModel
from cpshard.attention.hf import cp_attention_scope
from cpshard.attention.hybrid import merged_meta
from cpshard.attention.methods import method_named
from cpshard.attention.plan import attention_plan
from cpshard.guards.model import install_model_guard, remember_shard
from cpshard.guards.step import (
    ForwardTracker,
    StepState,
    begin_prepare,
    step_state,
    tracked_forward,
    watch_model,
)
from cpshard.layouts.closed_form import (
    ClosedFormLayout,
    ContiguousLayout,
    NoneLayout,
    RoundRobinLayout,
)
from cpshard.layouts.index import check_rank_map
from cpshard.mixers import MixerPlan, check_token_mixers, with_token_mixers
from cpshard.module_tree import ModuleTree
from cpshard.names import PACKED_LAYOUTS, AttentionChoice, LayoutName
from cpshard.options import PrepareOptions
from cpshard.sharding.batch import TokenKey, check_batch_mapping, shard_batch_dense
from cpshard.sharding.consistency import dispatch_fingerprint, raise_on_mismatch
from cpshard.sharding.facts import CPContext, ShardBatchFn
from cpshard.sharding.packed import packed_sharder
from cpshard.sharding.pad_id import check_padding_token_id, model_vocab_size
from cpshard.sharding.sharder import CPSharder, gather_rank_map

__all__ = [
    "CHECKS",
    "LayoutName",
    "PrepareChecks",
    "apply_model_hook",
    "check_model_sharder",
    "closed_form_sharder",
    "make_cp_batch_and_ctx",
    "prepare_cp_forward",
    "run_prepare",
    "unwrap_model",
]

_PACK_KEYS = ("seq_lens", "cu_seqlens")


def closed_form_sharder(
    layout: ClosedFormLayout,
    *,
    extra_token_keys: Mapping[str, TokenKey] | None = None,
) -> CPSharder:
    """A sharder for a closed-form layout and dense ``[B, S]`` batches.

    Args:
        layout: ``NoneLayout()``, ``ContiguousLayout(pad_multiple)`` or ``RoundRobinLayout()``.
        extra_token_keys: Caller-declared per-token keys (seq dim and pad value).

    Returns:
        A :class:`CPSharder` with no shard yet (the dispatcher shards on the CP mesh and supplies
        the attention method).
    """

    def indices(cp_mesh: DeviceMesh | None, padded_seq_len: int, device: torch.device) -> Any:
        rank, world = _comm.cp_rank_and_size(cp_mesh)
        return layout.local_indices(rank, world, padded_seq_len, device)

    shard: ShardBatchFn = functools.partial(
        shard_batch_dense, layout=layout, extra_token_keys=extra_token_keys
    )
    return CPSharder(
        shard_batch=shard,
        local_token_global_indices=indices,
        layout=layout.name,
        rank_map_fn=layout.rank_map,
    )


def _is_packed(batch: Mapping[str, Any]) -> bool:
    return any(batch.get(k) is not None for k in _PACK_KEYS) or _restarting_positions(batch)


def _restarting_positions(batch: Mapping[str, Any]) -> bool:
    """Whether a batch without ``seq_lens`` / ``cu_seqlens`` declares documents the way HF does:
    ``[B, S]`` ``position_ids`` that do not step by +1 inside a row, and no mask.

    transformers' eager / sdpa / flex masks (``find_packed_sequence_indices``) then start a new
    document at every such step: a restart at 0 (padding-free packing as TRL's collator emits
    it), a gap or a repeat, and attention stays inside documents, so a dense layout would let
    them attend to each other: silently unlike one process. With an ``attention_mask`` (or
    ``padding_mask``) HF keeps the rows dense (``position_ids`` are then RoPE positions only),
    and so does cpshard. The documents: :meth:`~cpshard.layouts.documents.PackSpec.
    from_position_ids`.
    """
    pos = batch.get("position_ids")
    if batch.get("attention_mask") is not None or batch.get("padding_mask") is not None:
        return False
    if not isinstance(pos, torch.Tensor) or pos.dim() != 2 or pos.is_floating_point():
        return False
    return bool((pos.detach().diff(dim=1) != 1).any())


def _warn_if_a_cache_reads_one_row(model: nn.Module | None, by_positions: bool) -> None:
    """Warn when the documents come from ``position_ids`` (``by_positions``: no ``seq_lens`` /
    ``cu_seqlens``, :func:`_restarting_positions`) but the model's config builds a cache.

    transformers reads non-+1 steps of ``position_ids`` as document starts only when its forward
    builds no KV cache (``use_cache=False``, as trainers run); with one (``config.use_cache``,
    the default of most configs) its masks stay causal over the whole row. cpshard reads the
    documents (the training reading), so a forward that builds a cache without CP would differ.
    """
    cfg = getattr(model, "config", None)
    if not by_positions or getattr(cfg, "use_cache", None) is not True:
        return
    warnings.warn(
        "cpshard reads this batch's position_ids (steps other than +1, no attention_mask) as "
        "packed documents, as transformers does without a KV cache (use_cache=False, as in "
        f"training); {type(model).__name__}.config.use_cache=True, and a forward that builds a "
        "cache reads each row as one causal sequence instead. Fix: set "
        "model.config.use_cache=False (documents), or pass an attention_mask of ones (one causal "
        "row per batch row, position_ids as RoPE positions only), or seq_lens / cu_seqlens",
        RuntimeWarning,
        stacklevel=5,
    )


def _resolve(
    cp_size: int,
    batch: Mapping[str, Any],
    layout: str,
    pad_multiple: int,
    extra_token_keys: Mapping[str, TokenKey] | None,
) -> CPSharder:
    packed = _is_packed(batch)
    if layout == "auto":
        layout = "balanced" if packed else ("round_robin" if cp_size > 1 else "none")
    if layout in PACKED_LAYOUTS:
        return packed_sharder(layout, extra_token_keys=extra_token_keys)
    if packed:
        keys = [k for k in _PACK_KEYS if batch.get(k) is not None] or [
            "position_ids that do not step by +1 inside a row, without a mask"
        ]
        raise ValueError(
            f"the batch describes packed documents ({keys}), which layout={layout!r} cannot "
            "express (its documents would attend to each other); use layout='balanced' or "
            "'packed'; or, for one causal sequence per row whose position_ids are RoPE positions "
            "only (as transformers reads them with a mask), pass an attention_mask (all ones)"
        )
    closed: ClosedFormLayout
    if layout == "contiguous":
        closed = ContiguousLayout(pad_multiple)
    elif layout == "round_robin" and cp_size > 1:
        closed = RoundRobinLayout()
    else:  # "none", or round_robin at cp=1 (identical maps)
        if layout == "none" and cp_size > 1:
            raise ValueError(
                f"layout='none' means no CP, but the CP mesh has {cp_size} ranks; use "
                "layout='auto' or 'round_robin'"
            )
        closed = NoneLayout()
    return closed_form_sharder(closed, extra_token_keys=extra_token_keys)


def _with_cp_attention(
    ctx: CPContext,
    cp_mesh: DeviceMesh | None,
    attention: AttentionChoice,
    state: StepState | None = None,
    cost: CostModel | None = None,
    grid_mesh: DeviceMesh | None = None,
) -> CPContext:
    """The shard's own context, or CP attention over its token meta when it brings none.

    The attention plan is built here, once per batch at shard time (host work), so the layers
    and the backward only run kernels and collectives. ``"auto"`` is resolved here, per batch
    (:func:`cpshard.attention.auto.choose_for_batch`, identical on every rank). With a 2-D CP
    ``grid_mesh`` the method runs across ``cp_outer`` on the shards merged by the Ulysses
    all-to-all inside ``cp_inner``: the choice and the plan are those of the merged meta
    (:func:`cpshard.attention.hybrid.merged_meta`).

    Raises:
        ValueError: the shard brings neither a context nor a token meta; ``attention="ulysses"``
            with a 2-D CP mesh (the attention names the outer method there).
    """
    meta = ctx.facts.token_meta
    if ctx.factory is not None:
        return ctx
    if meta is None:
        raise ValueError(
            "the shard_batch of this sharder returned CPContext(None, facts): a shard that brings "
            "no context of its own and no token meta, so there is nothing to run CP attention "
            "over (attention under ctx() would be silently shard-local). Put the token meta in "
            "its facts (ShardFacts(..., token_meta=...)) or return a context factory of its own"
        )
    run_meta, outer = meta, False
    if grid_mesh is not None and grid_mesh.size(1) > 1:  # ulysses refused at the fingerprint
        run_meta, outer = merged_meta(meta, grid_mesh.size(1)), True
    method = (
        choose_for_batch(run_meta, cp_mesh, cost, outer=outer) if attention == "auto" else attention
    )
    meta.plan_cache[CHOICE_KEY] = method  # ctx.facts.attention_method
    method_named(method).plans(attention_plan(run_meta), True, None, meta.positions.device)
    tracker = None if state is None or cp_mesh is None else ForwardTracker(state, cp_mesh)
    on = cp_mesh if grid_mesh is None else grid_mesh
    factory = functools.partial(cp_attention_context, on, meta, method, tracker=tracker)
    return CPContext(factory, ctx.facts)


def _grid_problem(grid_mesh: DeviceMesh | None, attention: str) -> ValueError | None:
    """The error of ``attention`` on a 2-D CP mesh (there it names the outer method), or
    ``None``."""
    if grid_mesh is None or grid_mesh.size(1) <= 1 or attention != "ulysses":
        return None
    return ValueError(
        f"attention='ulysses' with a 2-D cp_mesh ({grid_mesh.size(0)} cp_outer x "
        f"{grid_mesh.size(1)} cp_inner): there the attention names the outer method, run "
        "across cp_outer while Ulysses runs inside cp_inner; pass attention='ring', "
        "'selective', 'all_gather' or 'auto' (or a 1-D cp_mesh for Ulysses over the "
        "whole CP group)"
    )


def _forward_accepts(model: nn.Module, *names: str) -> bool:
    try:
        params = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return False
    return all(n in params for n in names)


def apply_model_hook(
    model: nn.Module, batch: Mapping[str, Any], num_chunks: int
) -> tuple[CPSharder | None, dict[str, Any]]:
    """Call the model's ``prepare_model_inputs_for_cp`` hook and merge its updates.

    The hook is called through ``model(_pre_embed_only=True, _cp_batch=..., num_chunks=...)``
    when the forward accepts those names (so FSDP2 pre-forward hooks unshard what it touches),
    else as a method. It gets a copy of the batch.

    Args:
        model: A model defining ``prepare_model_inputs_for_cp``.
        batch: The caller's batch (never mutated).
        num_chunks: Passed to the hook.

    Returns:
        ``(sharder, batch)``: the model-owned sharder (``None`` if the hook returned none) and a
        new batch with the updates applied (a ``None`` value removes that key).

    Raises:
        TypeError: the hook returned a non-dict or a ``cp_sharder`` that is not a CPSharder.
    """
    if _forward_accepts(model, "_pre_embed_only", "_cp_batch"):
        # Through __call__, so FSDP2 pre-forward hooks unshard what the hook touches.
        prepared = model(_pre_embed_only=True, _cp_batch=dict(batch), num_chunks=num_chunks)
    else:
        hook: Callable[..., Any] = getattr(model, "prepare_model_inputs_for_cp")  # noqa: B009
        prepared = hook(dict(batch), num_chunks=num_chunks)
    if not isinstance(prepared, Mapping):
        raise TypeError(
            f"{type(model).__name__}.prepare_model_inputs_for_cp must return a dict "
            "{'cp_sharder': CPSharder, **updates} (updates with value None remove that key), "
            f"got {type(prepared).__name__}; return a dict"
        )
    updates = dict(prepared)
    sharder = updates.pop("cp_sharder", None)
    if sharder is not None and not isinstance(sharder, CPSharder):
        raise TypeError(
            f"the model hook's 'cp_sharder' must be a CPSharder, got {type(sharder).__name__}; "
            "build one with cpshard.CPSharder(shard_batch=..., local_token_global_indices=...) "
            "or return no 'cp_sharder' to let cpshard pick the layout"
        )
    work = dict(batch)
    for key, value in updates.items():
        if value is None:
            work.pop(key, None)
        else:
            work[key] = value
    return sharder, work


def check_model_sharder(sharder: CPSharder) -> None:
    """Check the index map a model-owned sharder installed (the same verdict on every rank).

    The local maps of all ranks must form a bijection onto the padded stream, and the input
    positions (if any) must be distinct slots of it (``-1`` = dropped).

    Raises:
        ValueError: the map is not a bijection, or input positions are out of range/repeated.
    """
    padded = sharder.padded_seq_len
    name = f"the model-owned sharder (layout={sharder.layout!r})"
    world = _comm.cp_rank_and_size(sharder.cp_mesh)[1]
    if padded is None or padded % world:
        raise ValueError(
            f"{name} captured padded_seq_len={padded}, which must be a multiple of the CP size "
            f"{world}; its shard_batch must return ctx.facts with the padded stream length"
        )
    indices = sharder.local_token_global_indices
    if sharder.rank_map is None and sharder.rank_map_fn is None and indices is None:
        raise ValueError(
            f"{name} has a data-dependent layout (local_token_global_indices=None) but captured "
            "no rank map; its shard_batch must return ctx.facts with rank_map [C, P / C]"
        )
    try:
        cpu = torch.device("cpu")
        if sharder.rank_map is not None:
            rank_map = sharder.rank_map
        elif sharder.rank_map_fn is not None:
            rank_map = sharder.rank_map_fn(world, padded, cpu)
        else:
            assert indices is not None
            rank_map = gather_rank_map(
                indices(sharder.cp_mesh, padded, cpu), sharder.cp_mesh, padded
            )
        check_rank_map(rank_map.cpu(), padded)
        positions = sharder.input_token_stream_positions
        if positions is not None:
            flat = positions.reshape(-1).cpu()
            kept = flat[flat >= 0]
            if bool((flat < -1).any() | (flat >= padded).any()):
                raise ValueError(f"input positions must lie in [-1, {padded})")
            if torch.unique(kept).numel() != kept.numel():
                raise ValueError("two input tokens map to the same stream slot")
    except ValueError as e:
        raise ValueError(
            f"{name} installed an index map that is not a bijection onto its padded stream of "
            f"{padded} tokens over {world} ranks: {e}. Fix the model's shard_batch."
        ) from None


def _ddp_spans_cp(model: nn.Module, cp_mesh: DeviceMesh | None) -> bool:
    """Whether ``model`` is a ``DistributedDataParallel`` whose group holds every CP rank.

    Its all-reduce then sums the gradients over the CP group itself (the HF Trainer integration
    scales the loss so its mean is the CP sum): ``sync_grads`` is not the only legal sync.
    """
    if not isinstance(model, DistributedDataParallel) or _comm.cp_group(cp_mesh) is None:
        return False
    assert cp_mesh is not None
    ranks = _comm.group_global_ranks(getattr(model, "process_group", None))
    return bool(ranks) and set(cp_mesh.mesh.flatten().tolist()) <= ranks


def unwrap_model(model: nn.Module) -> nn.Module:
    """The model inside ``DistributedDataParallel`` / ``DataParallel`` wrappers (else ``model``).

    Such a wrapper hides the model's attributes (``prepare_model_inputs_for_cp``,
    ``set_attn_implementation``, ``config``), so without unwrapping a wrapped HF model would keep
    its own attention under ``ctx()`` and a model-owned hook would be skipped.
    """
    while isinstance(model, DistributedDataParallel | DataParallel):
        model = model.module
    return model


# --- the prepare pipeline ----------------------------------------------------------------------
def _valid_cp_mesh(cp_mesh: object) -> DeviceMesh | None:
    """``cp_mesh`` if it is ``None`` or a 1-D mesh (or a 2-D ``("cp_outer", "cp_inner")`` CP
    mesh: Ulysses x the attention method) that contains this rank (else raise)."""
    mesh = _comm.validate_cp_mesh(cp_mesh, grid=True)
    if mesh is not None and not _comm.mesh_contains_this_rank(mesh):
        raise ValueError(
            f"cp_mesh is the mesh of ranks {mesh.mesh.tolist()} (dims "
            f"{mesh.mesh_dim_names}), which does not contain this rank: pass the CP sub-mesh "
            "this rank belongs to (e.g. mesh['cp'] of its own 2-D mesh)"
        )
    return mesh


@dataclass(frozen=True)
class PrepareChecks:
    """The checks the prepare pipeline runs, each at most once per call.

    The pipeline calls them only through this object (the tests hand it counting wrappers of
    the same functions to prove each runs once); :data:`CHECKS` holds the real ones.

    Attributes:
        cp_mesh: ``cp_mesh`` is ``None`` or a 1-D (or 2-D CP) mesh holding this rank (before any
            collective).
        token_mixers: The verdict on the model's token mixers outside attention (before any
            collective; only with a model that does not own its CP).
        batch_mapping: The batch is a dict cpshard can read (after the fingerprint, so a batch
            that is bad on one rank only is reported on every rank by the fingerprint instead).
        padding_token_id: The pad id against the batch and the model's vocabulary (after the
            fingerprint, for the same reason).
        model_sharder: The index map a model-owned sharder installed (after the shard).
    """

    cp_mesh: Callable[[object], DeviceMesh | None] = _valid_cp_mesh
    token_mixers: Callable[..., MixerPlan] = check_token_mixers
    batch_mapping: Callable[[object], None] = check_batch_mapping
    padding_token_id: Callable[..., None] = check_padding_token_id
    model_sharder: Callable[[CPSharder], None] = check_model_sharder


CHECKS = PrepareChecks()
"""The checks every public prepare runs."""


@dataclass(frozen=True)
class _Validated:
    """One call after its validate step: what the later steps read.

    Attributes:
        options: The call's validated keywords.
        cp_mesh: The validated 1-D CP mesh (``None``: no CP); for a 2-D CP mesh its flattening,
            which the batch is sharded over.
        batch: The caller's batch (never mutated).
        model: ``prepare_cp_forward``'s model, unwrapped from DDP / DataParallel; ``None`` for
            ``make_cp_batch_and_ctx`` (whose ``model`` only feeds the mixer verdict).
        synced_by_ddp: The model's DDP wrapper sums its gradients over the CP group.
        mixers: How ``ctx`` runs the model's token mixers; its ``layout`` is the one to resolve.
        grid_mesh: The caller's 2-D ``("cp_outer", "cp_inner")`` CP mesh, which CP attention
            runs on (Ulysses x the method: :mod:`cpshard.attention.hybrid`), or ``None`` (1-D).
        tree: ``model``'s module tree, kept by its guard between prepares (``None`` without a
            model): the model checks of this call read it.
    """

    options: PrepareOptions
    cp_mesh: DeviceMesh | None
    batch: dict[str, Any]
    model: nn.Module | None
    synced_by_ddp: bool
    mixers: MixerPlan
    grid_mesh: DeviceMesh | None = None
    tree: ModuleTree | None = None


def _validate(
    model: nn.Module | None,
    cp_mesh: object,
    batch: dict[str, Any],
    options: PrepareOptions,
    checks: PrepareChecks,
) -> _Validated:
    """Step 1, on this rank alone, before any collective: the mesh, the model's guard, the mixer
    verdict (the options' problems are raised after the fingerprint, which compares them)."""
    if options.runs_model_hook and not isinstance(model, nn.Module):
        raise TypeError(
            f"prepare_cp_forward needs the model (a torch nn.Module), got "
            f"{type(model).__name__}; pass the model, or call make_cp_batch_and_ctx for a batch "
            "without one"
        )
    mesh, grid_mesh = _comm.split_cp_mesh(checks.cp_mesh(cp_mesh))
    cp_size = _comm.cp_rank_and_size(mesh)[1]
    synced_by_ddp, prepared, tree = False, None, None
    if options.runs_model_hook and model is not None:
        # DDP / DataParallel: the hook, the HF attention switch and the guard act on the model
        # inside (the wrapper forwards the call to it, so the guard still sees every forward).
        synced_by_ddp = _ddp_spans_cp(model, mesh)
        prepared = unwrap_model(model)
        tree = install_model_guard(prepared, cp_size)  # sharded batches run inside ctx()
    mixers = MixerPlan(layout=options.layout)
    inner = None if model is None else unwrap_model(model)
    # documents declared by keys, or read from position_ids (one pass over them, a host sync on
    # a GPU: made once here for the warning and the mixer verdict)
    declared = isinstance(batch, Mapping) and any(batch.get(k) is not None for k in _PACK_KEYS)
    by_positions = (
        inner is not None
        and isinstance(batch, Mapping)
        and not declared
        and _restarting_positions(batch)
    )
    _warn_if_a_cache_reads_one_row(inner, by_positions)
    if inner is not None and not hasattr(inner, "prepare_model_inputs_for_cp"):
        # A model that owns its CP owns its mixers too. Else the verdict (or the error) on every
        # rank, before any collective; ctx then runs them exactly (cpshard.mixers).
        packed = declared or by_positions
        mixers = checks.token_mixers(
            inner, cp_size, strict=options.strict, packed=packed, layout=options.layout,
            tree=tree,
        )  # fmt: skip
    return _Validated(options, mesh, batch, prepared, synced_by_ddp, mixers, grid_mesh, tree)


def _fingerprint(call: _Validated, checks: PrepareChecks) -> StepState | None:
    """Step 2: the step header, always, with the batch fingerprint riding in it (the one
    collective of a prepare); then the options' and the batch's checks, which raise alike on
    every rank.

    ``check_consistency=False`` only skips the hashing: ranks that disagree on the flag raise
    alike instead of mismatching collectives. A rank that left its last step midway stops here,
    before the collective; ranks in different phases, or with different parameters, raise
    together (:mod:`cpshard.guards.step`).
    """
    o, mesh = call.options, call.cp_mesh
    state = step_state(mesh)
    if call.model is not None:
        watch_model(call.model, state, mesh)
    # the 2-D grid too: a rank given the grid runs Ulysses x the outer method, one given its
    # flattening the method over the whole group (mismatched collectives)
    grid = None if call.grid_mesh is None else tuple(call.grid_mesh.shape)
    fingerprint = dispatch_fingerprint(
        mesh, call.batch, o.layout, o.attention, o.padding_token_id,
        {**o.fingerprinted(), "cp_grid": grid}, o.check_consistency is not False,
    )  # fmt: skip
    begin_prepare(
        state,
        mesh,
        check_consistency=o.check_consistency,
        model=call.model,
        payload=fingerprint,
        check_payload=raise_on_mismatch,
        synced_elsewhere=call.synced_by_ddp,
        model_tree=call.tree,
    )
    problem = o.problem()  # the same on every rank now: the fingerprint compared the options
    if problem is None:
        problem = _grid_problem(call.grid_mesh, o.attention)
    if problem is not None:
        raise problem
    checks.batch_mapping(call.batch)
    vocab = None if call.model is None else model_vocab_size(call.model)
    checks.padding_token_id(o.padding_token_id, call.batch, vocab)
    return state


def _model_hook(call: _Validated) -> tuple[CPSharder | None, dict[str, Any]]:
    """Step 3: the model's ``prepare_model_inputs_for_cp`` (``prepare_cp_forward`` only; at
    every CP size, cp=1 included, so the cp=1 reference runs the same model path).

    Returns:
        ``(sharder, batch)``: the model-owned sharder (else ``None``) and the batch to shard.
    """
    model = call.model
    if not call.options.runs_model_hook:
        return None, call.batch
    work = dict(call.batch)
    if model is None or not hasattr(model, "prepare_model_inputs_for_cp"):
        return None, work
    assert call.options.num_chunks is not None
    return apply_model_hook(model, work, call.options.num_chunks)


def _resolve_sharder(call: _Validated, owned: CPSharder | None, work: dict[str, Any]) -> CPSharder:
    """Step 4: model-owned > a given ``cp_sharder`` > the layout (balanced > packed >
    round_robin > none, or the one named)."""
    given = owned if owned is not None else call.options.cp_sharder
    if given is not None:
        if call.options.extra_token_keys:
            whose = "the model's own sharder" if owned is not None else "the cp_sharder given"
            raise ValueError(
                f"extra_token_keys={sorted(call.options.extra_token_keys)} would be ignored: "
                f"{whose} shards the batch with its own shard_batch, which decides which keys "
                "are per-token (the keys would stay unsharded, misaligned with the local "
                "tokens). Declare them where that sharder is built (e.g. cpshard."
                "closed_form_sharder(layout, extra_token_keys=...)), or shard such tensors with "
                "sharder.shard_token_tensor after the prepare"
            )
        return given
    cp_size = _comm.cp_rank_and_size(call.cp_mesh)[1]
    o = call.options
    return _resolve(cp_size, work, call.mixers.layout, o.pad_multiple, o.extra_token_keys)


def _shard(
    call: _Validated, sharder: CPSharder, work: dict[str, Any]
) -> tuple[CPContext, dict[str, Any], CPSharder]:
    """Step 5: shard ``work`` on the CP mesh: the context, the local batch, and the sharder
    bound to this batch (never stale)."""
    o = call.options
    pad_id = 0 if o.padding_token_id is None else o.padding_token_id  # None: no input_ids
    return sharder.shard(
        call.cp_mesh,
        work,
        tp_mesh=o.tp_mesh,
        loss_mask=o.loss_mask,
        padding_token_id=pad_id,
        check_consistency=o.check_consistency,
    )


def _compose(
    call: _Validated,
    ctx: CPContext,
    sharder: CPSharder,
    owned: bool,
    state: StepState | None,
    checks: PrepareChecks,
) -> CPContext:
    """Step 6: CP attention (unless the shard brings its own context), the model guard's record
    of this shard, the model-owned map's check, the HF attention switch, the token mixers and
    the step tracking, in that order."""
    mesh, model = call.cp_mesh, call.model
    o = call.options
    ctx = _with_cp_attention(ctx, mesh, o.attention, state, o.attention_cost, call.grid_mesh)
    if model is not None:
        remember_shard(model, ctx.facts.token_meta)  # the guard knows copies of this batch
        if owned:
            checks.model_sharder(sharder)
        elif hasattr(model, "set_attn_implementation"):
            # Inside ctx() (at every CP size, so cp=1 and cp=N run the same attention semantics)
            # an HF model uses cpshard's attention; outside it keeps its own attn_implementation.
            ctx = CPContext(functools.partial(cp_attention_scope, model, ctx), ctx.facts)
    ctx = with_token_mixers(ctx, call.mixers, mesh)
    if state is None:
        return ctx
    # ctx records how this rank leaves it (cpshard.guards.step.tracked_forward).
    return CPContext(functools.partial(tracked_forward, state, mesh, ctx), ctx.facts)


def run_prepare(
    model: nn.Module | None,
    cp_mesh: object,
    batch: dict[str, Any],
    options: PrepareOptions,
    checks: PrepareChecks = CHECKS,
) -> tuple[CPContext, dict[str, Any], CPSharder]:
    """The one prepare pipeline behind both public entry points, in a fixed order:
    validate -> fingerprint -> model hook -> resolve -> shard -> compose; every check once.

    Args:
        model: ``prepare_cp_forward``'s model (with ``options.num_chunks`` set), or
            ``make_cp_batch_and_ctx``'s optional model (only its token mixers are read).
        cp_mesh: The caller's CP mesh (validated in the first step).
        batch: The caller's batch (never mutated).
        options: The call's keywords, validated when built.
        checks: The checks to run (:data:`CHECKS`; tests pass counting wrappers).

    Returns:
        ``(ctx, batch, sharder)`` as the public entry points return them.
    """
    call = _validate(model, cp_mesh, batch, options, checks)
    state = _fingerprint(call, checks)
    owned, work = _model_hook(call)
    sharder = _resolve_sharder(call, owned, work)
    ctx, out, bound = _shard(call, sharder, work)
    # the model-owned map is checked on the sharder bound to this batch: a hook may hand back a
    # sharder bound to an earlier batch, whose own facts stay that batch's
    return _compose(call, ctx, bound, owned is not None, state, checks), out, bound


# --- the public entry points ------------------------------------------------------------------


def make_cp_batch_and_ctx(
    cp_mesh: DeviceMesh | None,
    batch: dict[str, Any],
    *,
    layout: LayoutName = "auto",
    padding_token_id: int | None = 0,
    pad_multiple: int = 1,
    cp_sharder: CPSharder | None = None,
    loss_mask: torch.Tensor | None = None,
    extra_token_keys: Mapping[str, TokenKey] | None = None,
    attention: str = "auto",
    tp_mesh: DeviceMesh | None = None,
    check_consistency: bool = True,
    model: nn.Module | None = None,
    strict: bool = False,
    attention_cost: CostModel | None = None,
) -> tuple[CPContext, dict[str, Any], CPSharder]:
    """Resolve a sharder and shard ``batch`` on the CP mesh (the dispatch without a model hook).

    Args:
        cp_mesh: 1-D CP ``DeviceMesh`` or ``None``; or a 2-D CP mesh with dims
            ``("cp_outer", "cp_inner")`` (``R x U``): the batch is sharded over its flattening
            (the returned sharder's ``cp_mesh``), and CP attention runs Ulysses inside
            ``cp_inner`` and ``attention`` (not ``"ulysses"``) across ``cp_outer``
            (:mod:`cpshard.attention.hybrid`).
        batch: Caller's batch (never mutated). Dense: ``input_ids``/``inputs_embeds``, ...;
            packed: also ``seq_lens`` or ``cu_seqlens``.
        layout: ``"auto"`` (packed batch: balanced; dense: round_robin at cp > 1, none at
            cp = 1), or a layout name.
        padding_token_id: Pad id for ``input_ids``: a non-negative int (inside the model's
            vocabulary in :func:`prepare_cp_forward`); ``None`` only without ``input_ids``. See
            :func:`check_padding_token_id`.
        pad_multiple: Per-rank length multiple of the ``contiguous`` layout.
        cp_sharder: A sharder to use as is (model-owned CP); wins over ``layout``.
        loss_mask: Optional ``[B, S]`` loss mask, sharded into ``batch["loss_mask"]``.
        extra_token_keys: Caller-declared per-token keys (:class:`cpshard.TokenKey`).
        attention: ``"auto"`` (per batch, the method with the lowest modelled cost:
            :mod:`cpshard.attention.auto`; recorded in ``ctx.facts.attention_method``),
            ``"all_gather"``, ``"ring"``, ``"ulysses"`` or ``"selective"``: the CP attention of
            ``ctx`` for a shard that brings no context of its own (every built-in layout, a
            given ``cp_sharder``'s too); a shard with its own context keeps it.
        tp_mesh: Optional TP mesh handed to ``shard_batch``.
        check_consistency: Compare a fingerprint of the batch and arguments across the CP ranks
            (one all-gather of a few int64 values; what it covers:
            :mod:`cpshard.sharding.consistency`) and raise on every rank if they differ; also
            makes ``gather_token_tensor`` check dtype and shape across ranks. ``False`` skips
            the hashing of the values (not the all-gather: names, shapes, arguments and the flag
            itself are still compared); pass it only if the loop guarantees identical batches
            on every CP rank.
        model: The model the batch is for (optional): its token mixers outside attention
            (Mamba / Mamba2 mixers, Gated DeltaNet, short convolutions, ...) are then checked
            and run exactly under ``ctx`` (:mod:`cpshard.mixers`); without it they are not seen.
        attention_cost: Link bandwidth, compute rate and assumed layer shape of the cost model
            behind ``attention="auto"`` (:class:`cpshard.attention.cost.CostModel`); ``None`` ->
            its GPU defaults. Must be equal on every rank (part of the fingerprint).
        strict: With ``model``: refuse a model whose token mixers need the generic exact path
            (each mixer over the whole sequence on every rank, ``C`` times its compute) instead
            of warning once.

    Returns:
        ``(ctx, batch, sharder)``: ``with ctx(): model(**batch)``; the sharder's token verbs move
        per-token tensors between caller coordinates and this rank's shard.

    Raises:
        TypeError, ValueError: a mesh that is neither 1-D nor a 2-D CP mesh, unknown names,
            malformed batches, a pad id that is not a non-negative int, ranks given different
            batches, a model whose token mixers cannot run exactly (or need the generic path
            under ``strict``). The mesh and the mixers are checked on each rank before any
            collective; the keywords (:class:`cpshard.options.PrepareOptions`), the batch and
            the pad id right after the cross-rank fingerprint (the one small collective, which
            carries them), so one bad on one rank only raises on every rank too.
    """
    options = PrepareOptions(
        layout=layout,
        attention=cast("AttentionChoice", attention),  # the options check the name
        padding_token_id=padding_token_id,
        pad_multiple=pad_multiple,
        loss_mask=loss_mask,
        extra_token_keys=extra_token_keys,
        tp_mesh=tp_mesh,
        check_consistency=check_consistency,
        strict=strict,
        attention_cost=attention_cost,
        cp_sharder=cp_sharder,
    )
    return run_prepare(model, cp_mesh, batch, options)


def prepare_cp_forward(
    model: nn.Module,
    cp_mesh: DeviceMesh | None,
    batch: dict[str, Any],
    *,
    padding_token_id: int | None = 0,
    num_chunks: int = 1,
    layout: LayoutName = "auto",
    pad_multiple: int = 1,
    loss_mask: torch.Tensor | None = None,
    extra_token_keys: Mapping[str, TokenKey] | None = None,
    attention: str = "auto",
    tp_mesh: DeviceMesh | None = None,
    check_consistency: bool = True,
    strict: bool = False,
    attention_cost: CostModel | None = None,
) -> tuple[CPContext, dict[str, Any], CPSharder]:
    """Prepare one forward under CP: model hook, sharder resolution, batch shard.

    A model may own its CP by defining ``prepare_model_inputs_for_cp(batch, *, num_chunks=1)``
    returning ``{"cp_sharder": CPSharder, **updates}``; an update whose value is ``None`` removes
    that key (a raw input the hook consumed); the hook runs at every CP size, ``cp=1`` included.
    Inside ``ctx()`` an HF transformers model uses cpshard's registered attention (at every CP
    size), so it sees the global sequence; outside ``ctx()`` it keeps its own
    ``attn_implementation`` (``sdpa``, ``eager``, ``flash_attention_2``, ``flex_attention``), so
    evaluation and ``generate`` are not downgraded.

    Args:
        model: The model (``nn.Module``).
        cp_mesh: 1-D CP mesh or ``None``, or a 2-D ``("cp_outer", "cp_inner")`` CP mesh (see
            :func:`make_cp_batch_and_ctx`).
        batch: Caller's batch; never mutated.
        padding_token_id: Pad id for ``input_ids``: a non-negative int (inside the model's
            vocabulary in :func:`prepare_cp_forward`); ``None`` only without ``input_ids``. See
            :func:`check_padding_token_id`.
        num_chunks: Passed to the model hook.
        layout, pad_multiple, loss_mask, extra_token_keys, attention, tp_mesh,
            check_consistency, attention_cost: As in :func:`make_cp_batch_and_ctx` (the
            fingerprint is taken of the caller's batch, before the model hook runs).
        strict: Refuse a model whose token mixers outside attention (Mamba / Mamba2 mixers,
            Gated DeltaNet, short convolutions, ...) would need the generic exact path (each
            such mixer gathers the sequence and runs over all of it on every rank: ``C`` times
            its compute) instead of warning once (:mod:`cpshard.mixers`). A mixer cpshard
            cannot run exactly is refused either way.

    A ``DistributedDataParallel`` / ``DataParallel`` wrapper is looked through
    (:func:`unwrap_model`): call the wrapper as usual inside ``ctx()``.

    The model gets a forward guard (see :mod:`cpshard.guards.model`): a sharded batch must run
    inside its own ``ctx()``, and under ``ctx()`` the model takes no ``labels`` and no
    ``attention_mask``.

    Returns:
        ``(ctx, batch, sharder)``.

    Raises:
        TypeError, ValueError: as :func:`make_cp_batch_and_ctx`, plus a pad id outside the
            model's vocabulary.
        RuntimeError: this rank left its last step midway (locally, before any collective), or
            the CP ranks are in different phases of their step (on every rank; see
            :mod:`cpshard.guards.step`).
    """
    options = PrepareOptions(
        layout=layout,
        attention=cast("AttentionChoice", attention),  # the options check the name
        padding_token_id=padding_token_id,
        pad_multiple=pad_multiple,
        loss_mask=loss_mask,
        extra_token_keys=extra_token_keys,
        tp_mesh=tp_mesh,
        check_consistency=check_consistency,
        strict=strict,
        attention_cost=attention_cost,
        num_chunks=num_chunks,
    )
    return run_prepare(model, cp_mesh, batch, options)
