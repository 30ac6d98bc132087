"""Route ``F.scaled_dot_product_attention`` calls of plain PyTorch models to CP attention.

:func:`cp_attention_context` is a scoped ``TorchFunctionMode``. While it is active:

* a *causal* SDPA call (``is_causal=True``) whose query and key lengths (dim ``-2``) both equal
  ``meta.local_len`` is a decoder's self-attention over the sharded sequence and is served by
  :func:`cpshard.attention.cp_sdpa`;
* a *non-causal* call of that length without a mask is never routed by accident (a vision
  tower or an encoder whose length happens to equal ``L``): it runs as local attention, with a
  warning once per context. Bidirectional CP attention is explicit:
  :func:`cpshard.attention.cp_attention` with ``causal=False``, or the HF ``"cpshard"``
  attention of a prepared model (through :func:`active_cp_attention`);
* a call of that length with an explicit ``attn_mask`` raises (a mask built from local positions
  is wrong under CP);
* every other SDPA call (another length) passes through untouched;
* :func:`suspend` exempts a region (nothing is routed there, and HF models see no CP context);
* activation checkpointing (``torch.utils.checkpoint`` / HF gradient checkpointing) recomputes
  the forward during ``backward()``, where no context is active: pass
  ``context_fn=cpshard.attention.checkpoint_context_fn`` (non-reentrant checkpointing) so the
  recomputation routes like the forward did; a routed call inside a checkpoint without it raises
  (the recomputation would otherwise silently run local attention);
* an op on a local tensor of another batch (a stale ``ctx`` used with a newer batch, or the
  reverse) raises, and entering a context inside another one raises;
* every routed call (and :func:`cpshard.attention.cp_attention` called inside the context) runs
  in the dtype SDPA would use (autocast's, under ``torch.autocast``:
  :mod:`cpshard.attention.autocast`) and through the step tracker, whose header makes the ranks
  compare the forward's first call before its K/V exchange.

Nothing global is patched, and the autograd Functions capture the group and meta, so
``backward()`` may run outside the context.

Owns the routing mode and the activation-checkpointing hook.

Import rules: the rows of ``RULES`` in tests/unit/test_architecture.py that cover this module.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Iterator, Mapping
from types import MappingProxyType
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch.distributed import ProcessGroup
from torch.distributed.device_mesh import DeviceMesh
from torch.overrides import TorchFunctionMode

from cpshard import _compat
from cpshard._comm import cp_group, split_cp_mesh, validate_cp_mesh
from cpshard.attention.autocast import autocast_inputs
from cpshard.attention.core import check_method, run_sdpa
from cpshard.attention.hybrid import CPGrid, check_grid, cp_grid
from cpshard.sharding.facts import batch_tag, same_shard
from cpshard.sharding.meta import TokenMeta

__all__ = [
    "StepTracker",
    "active_cp_attention",
    "active_mode",
    "attend_in_active_context",
    "check_meta_of_active_context",
    "checkpoint_context_fn",
    "cp_attention_context",
    "cp_context_active",
    "suspend",
]

_SDPA_PARAMS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale")
_SDPA_DEFAULTS: Mapping[str, Any] = MappingProxyType(
    {"attn_mask": None, "dropout_p": 0.0, "is_causal": False, "scale": None, "enable_gqa": False}
)


def _is_sdpa(func: Callable[..., Any]) -> bool:
    return func is F.scaled_dot_product_attention or func is _compat.SDPA_BUILTIN


def _bind(args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
    """Name the arguments of an SDPA call (positional or keyword)."""
    bound = dict(_SDPA_DEFAULTS)
    bound.update(zip(_SDPA_PARAMS, args, strict=False))
    bound.update(kwargs)
    return bound


def _stale_error(where: str) -> ValueError:
    return ValueError(
        f"{where} a local tensor of another batch than the one this CP context was made for: a "
        "ctx, its token meta and its sharder belong to the batch they were returned with. Use "
        "the ctx returned together with this batch (ctx, batch, sharder = "
        "prepare_cp_forward(...) once per batch)"
    )


class StepTracker(Protocol):
    """Hooks around each CP attention call of a context (``cpshard.guards.step.ForwardTracker``):
    the step headers and the backward record of the step's life. Handed in by the dispatcher;
    this module never imports the guards."""

    def enter_call(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Before the call's first collective (may exchange a step header); returns q, k, v."""

    def leave_call(self, out: torch.Tensor) -> torch.Tensor:
        """After the call; returns the output (marked so its backward is recorded)."""


class _CPSDPAMode(TorchFunctionMode):
    """Serves matching SDPA calls with :func:`cp_sdpa`; see the module docstring."""

    def __init__(
        self,
        group: ProcessGroup | None,
        meta: TokenMeta,
        method: str,
        tracker: StepTracker | None = None,
        grid: CPGrid | None = None,
    ) -> None:
        super().__init__()
        self.group = group
        # the groups of a 2-D CP mesh (Ulysses x method), else None; checked against ``group``
        # (check_grid) once, when the context is entered, not on every call
        self.grid = grid
        self.meta = meta
        self.method = method
        self.tracker = tracker  # None in a recomputation (its calls are not a new forward)
        self.suspended = 0  # > 0 inside suspend()
        self.warned = False
        self.checkpointed = 0  # > 0 inside the forward of a checkpoint_context_fn checkpoint
        # Contexts a recomputation re-enters with the routing (e.g. an HF model's "cpshard"
        # attention implementation, which is selected only while its ctx() is open).
        self.on_recompute: list[Callable[[], contextlib.AbstractContextManager[Any]]] = []
        # CP attention calls served in this context (the model guard's backstop counts them).
        self.attention_calls = 0

    def __torch_function__(
        self,
        func: Callable[..., Any],
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        if self.suspended:
            return func(*args, **kwargs)
        if args and isinstance(args[0], torch.Tensor):
            tag = batch_tag(args[0])
            if tag is not None and tag is not self.meta and not same_shard(tag, self.meta):
                raise _stale_error("an op inside ctx() got")
        if not _is_sdpa(func):
            return func(*args, **kwargs)
        call = _bind(args, kwargs)
        if not self.matches(call):
            return func(*args, **kwargs)
        if not call["is_causal"] and call["attn_mask"] is None:
            if not self.warned:
                self.warned = True
                warnings.warn(
                    "a non-causal scaled_dot_product_attention call with the local sequence "
                    f"length ({self.meta.local_len}) inside a CP context ran as LOCAL attention "
                    "(not routed): cpshard cannot tell a bidirectional self-attention of the "
                    "sharded sequence from an unrelated module (e.g. a vision tower) of the same "
                    "length. For CP attention call cpshard.attention.cp_attention(q, k, v, "
                    "sharder=sharder, causal=False); for an unrelated module wrap it in "
                    "cpshard.attention.suspend() to silence this warning",
                    stacklevel=3,
                )
            return func(*args, **kwargs)
        return self.serve(call)

    def check_checkpoint(self) -> None:
        """Raise inside an activation checkpoint that would recompute this as local attention."""
        if not self.checkpointed and _inside_torch_checkpoint():
            raise ValueError(_CHECKPOINT_FIX)

    def matches(self, call: Mapping[str, Any]) -> bool:
        """Whether an SDPA call attends over the sharded sequence (both lengths ``L``)."""
        q, k = call["query"], call["key"]
        n = self.meta.local_len
        return bool(q.dim() == 4 and q.shape[-2] == n and k.shape[-2] == n)

    def serve(self, call: Mapping[str, Any]) -> torch.Tensor:
        """CP attention for a named SDPA call (checked first)."""
        q, k = call["query"], call["key"]
        self.check_checkpoint()
        self.attention_calls += 1
        if call["attn_mask"] is not None:
            raise ValueError(
                "scaled_dot_product_attention got an explicit attn_mask inside "
                "cp_attention_context; under CP the mask comes from the token meta (document ids "
                "and global positions, padding included): pass attn_mask=None and is_causal. "
                "An HF transformers model builds such a mask unless it runs inside its own "
                "prepared ctx: for a second model on this batch (e.g. a reference model) call "
                "ctx_ref, _, _ = cpshard.prepare_cp_forward(ref_model, cp_mesh, batch) and run it "
                "under `with ctx_ref():` (the local tensors of both prepares are interchangeable). "
                "Only a module that is NOT attention over the sharded sequence may be wrapped in "
                "cpshard.attention.suspend() (it then runs local attention)"
            )
        if call["dropout_p"] != 0.0:
            raise ValueError(
                f"CP attention does not support dropout, got dropout_p={call['dropout_p']}; "
                "pass dropout_p=0.0 (e.g. model.eval() or attention_dropout=0)"
            )
        hq, hkv = q.shape[1], k.shape[1]
        if hq != hkv and not call["enable_gqa"]:
            raise ValueError(
                f"query has {hq} heads and key {hkv}: pass enable_gqa=True for GQA (as "
                "scaled_dot_product_attention itself requires)"
            )
        return self.attend(q, k, call["value"], causal=bool(call["is_causal"]), scale=call["scale"])

    def attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **kwargs: Any
    ) -> torch.Tensor:
        """:func:`cp_sdpa` on this context's group, meta and method, inside the step tracker.

        A ``meta`` in ``kwargs`` replaces the context's (Llama 4's chunked layers attend over a
        chunk-split token meta of the same shards), a ``method`` and ``grid`` the context's
        (:func:`cpshard.attention.cp_attention` called inside the context: its method, 1-D).
        """
        meta = kwargs.pop("meta", self.meta)
        method = kwargs.pop("method", self.method)
        grid = kwargs.pop("grid", self.grid)
        kwargs["grid_checked"] = grid is not None and grid is self.grid  # at the ctx's entry
        tracker = self.tracker
        if tracker is None or torch.compiler.is_compiling():  # compiled forwards: not tracked
            return run_sdpa(
                q, k, v, group=self.group, meta=meta, method=method, grid=grid, agreed=False,
                where="ctx()", **kwargs,
            )  # fmt: skip
        # the tracker's header compares the dtype the call computes in (autocast's, as for SDPA)
        q, k, v = tracker.enter_call(*autocast_inputs(q, k, v))
        out = run_sdpa(
            q, k, v, group=self.group, meta=meta, method=method, grid=grid, agreed=True,
            where="ctx()", **kwargs,
        )  # fmt: skip
        return tracker.leave_call(out)


_CHECKPOINT_FIX = (
    "CP attention ran inside an activation checkpoint (torch.utils.checkpoint or HF gradient "
    "checkpointing) without cpshard's recompute context: backward() recomputes the forward "
    "outside the CP context, where attention would silently be local to this rank's shard "
    "(wrong gradients). Pass context_fn=cpshard.attention.checkpoint_context_fn to the "
    "non-reentrant checkpoint: torch.utils.checkpoint.checkpoint(fn, *args, use_reentrant=False, "
    "context_fn=cpshard.attention.checkpoint_context_fn), or for an HF model "
    "model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={'use_reentrant': False, "
    "'context_fn': cpshard.attention.checkpoint_context_fn})"
)


def _inside_torch_checkpoint() -> bool:
    """Whether the forward of a non-reentrant ``torch.utils.checkpoint`` is running here.

    Read from autograd's saved-tensors hooks (:func:`cpshard._compat.in_checkpoint_forward`).
    """
    if torch.compiler.is_compiling():  # not traceable; compiled checkpoints are not checked
        return False
    return _compat.in_checkpoint_forward()


def _modes() -> list[_CPSDPAMode]:
    return [m for m in _compat.function_mode_stack() if isinstance(m, _CPSDPAMode)]


def active_mode() -> _CPSDPAMode | None:
    """The CP context active on this thread, or ``None`` (none entered, or suspended)."""
    modes = _modes()
    if not modes or modes[-1].suspended:
        return None
    return modes[-1]


def check_meta_of_active_context(meta: TokenMeta, where: str) -> None:
    """Raise when a CP context is active for another batch than ``meta``'s.

    ``cp_attention(q, k, v, sharder=...)`` inside ``ctx()`` with a sharder that has since sharded
    another batch would apply the new batch's masks to the tensors of the old one: the context
    knows which batch its forward runs on.

    Raises:
        ValueError: the active context's token meta is neither ``meta`` nor equal to it.
    """
    mode = active_mode()
    if mode is not None and mode.meta is not meta and not same_shard(meta, mode.meta):
        raise ValueError(
            f"{where} got a sharder whose last batch is not the one this ctx() runs (the sharder "
            "has sharded another batch since): its masks would be applied to this batch's "
            "tensors. Pass the sharder returned together with this batch (ctx, batch, sharder = "
            "prepare_cp_forward(...) once per batch), or shard the next batch after this forward"
        )


def attend_in_active_context(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    group: ProcessGroup | None,
    meta: TokenMeta,
    **kwargs: Any,
) -> torch.Tensor | None:
    """A direct CP attention call inside the active context, run as one of its calls.

    :func:`cpshard.attention.cp_attention` inside ``ctx()``: its call is one of the forward's CP
    attention calls, so the context's step tracker sees it (the first call of a forward makes the
    ranks agree on dtypes and shapes, the backward is recorded).

    Args:
        q: ``[B, Hq, L, D]`` local queries.
        k: ``[B, Hkv, L, D]`` local keys.
        v: ``[B, Hkv, L, Dv]`` local values.
        group: The call's CP group.
        meta: The call's token meta (checked against the context's by the caller).
        **kwargs: ``method``, ``causal``, ``scale``, ``window``, ``softcap`` of the call.

    Returns:
        The output, or ``None`` when no context is active (or suspended) or it runs over
        another group: the caller runs the call itself.
    """
    mode = active_mode()
    if mode is None or mode.group is not group:
        return None
    mode.attention_calls += 1  # a CP attention call of this context, as a routed one
    # the call keeps its own semantics: its method over its group (1-D, as outside ctx())
    return mode.attend(q, k, v, meta=meta, grid=None, **kwargs)


def cp_context_active() -> bool:
    """Whether a :func:`cp_attention_context` is active (and not suspended) on this thread."""
    return active_mode() is not None


def active_cp_attention() -> Callable[..., torch.Tensor] | None:
    """:func:`cp_sdpa` bound to the active (not suspended) context's group, meta and method.

    For integrations that pass attention arguments SDPA cannot carry (``window``, ``softcap``):
    call the result as ``attn(q, k, v, causal=..., scale=..., window=..., softcap=...)``.

    Returns:
        The bound function, or ``None`` when no CP context is active (or it is suspended).

    Raises:
        ValueError: inside an activation checkpoint without :func:`checkpoint_context_fn` (its
            recomputation would run local attention).
    """
    mode = active_mode()
    if mode is None:
        return None
    mode.check_checkpoint()
    return mode.attend


@contextlib.contextmanager
def suspend() -> Iterator[None]:
    """Exempt a region from CP routing: e.g. a vision tower or an unrelated model in ``ctx()``.

    Inside it no SDPA call is routed, :func:`cp_context_active` is ``False`` (HF models use their
    plain attention and masks), and tensors are not checked against the batch.

    Example:
        >>> with ctx():
        ...     with cpshard.attention.suspend():
        ...         image_features = vision_tower(pixel_values)
        ...     logits = model(inputs_embeds=..., position_ids=...)
    """
    modes = _modes()
    for m in modes:
        m.suspended += 1
    try:
        yield
    finally:
        for m in modes:
            m.suspended -= 1


@contextlib.contextmanager
def _marked(mode: _CPSDPAMode) -> Iterator[None]:
    mode.checkpointed += 1
    try:
        yield
    finally:
        mode.checkpointed -= 1


@contextlib.contextmanager
def _recompute_in(mode: _CPSDPAMode) -> Iterator[None]:
    """Re-enter ``mode``'s routing (same group, batch meta and method) for a recomputation."""
    if _modes():  # already inside a CP context (e.g. a checkpoint recomputed in the forward)
        yield
        return
    again = _CPSDPAMode(mode.group, mode.meta, mode.method, grid=mode.grid)
    again.checkpointed = 1
    with contextlib.ExitStack() as stack:
        for factory in mode.on_recompute:
            stack.enter_context(factory())
        stack.enter_context(again)
        yield


def checkpoint_context_fn() -> tuple[
    contextlib.AbstractContextManager[None], contextlib.AbstractContextManager[None]
]:
    """``context_fn`` for ``torch.utils.checkpoint.checkpoint`` (non-reentrant) under CP.

    The recomputation of a checkpointed region runs during ``backward()``, where no CP context is
    active (also when ``backward()`` is called inside ``ctx()``): without this it would silently
    compute local attention. Called when the checkpointed forward starts, it captures the active
    CP context; the recomputation then routes exactly like the forward did. Outside ``ctx()``
    (evaluation, generation) both contexts do nothing.

    Returns:
        ``(forward_context, recompute_context)`` as ``torch.utils.checkpoint`` expects.

    Example:
        >>> model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={
        ...     "use_reentrant": False, "context_fn": cpshard.attention.checkpoint_context_fn})
        >>> out = torch.utils.checkpoint.checkpoint(block, h, use_reentrant=False,
        ...     context_fn=cpshard.attention.checkpoint_context_fn)
    """
    mode = active_mode()
    if mode is None:
        return contextlib.nullcontext(), contextlib.nullcontext()
    return _marked(mode), _recompute_in(mode)


@contextlib.contextmanager
def _scope(
    cp_mesh: DeviceMesh | None, meta: TokenMeta, method: str, tracker: StepTracker | None
) -> Iterator[None]:
    if _modes():
        raise ValueError(
            "a CP context was entered inside another one (nested ctx() / with ctx:): the inner "
            "batch's attention would silently mix with the outer one; leave the first ctx "
            "before entering the next"
        )
    flat, grid_mesh = split_cp_mesh(cp_mesh)
    grid = None
    if grid_mesh is not None:
        grid = cp_grid(grid_mesh)
        check_grid(grid, cp_group(flat), meta.rank, meta.world_size)
    with _CPSDPAMode(cp_group(flat), meta, method, tracker, grid):
        yield


def cp_attention_context(
    cp_mesh: DeviceMesh | None,
    meta: TokenMeta,
    method: str,
    *,
    tracker: StepTracker | None = None,
) -> contextlib.AbstractContextManager[None]:
    """A context in which SDPA calls over the local shard become CP attention.

    Args:
        cp_mesh: 1-D CP mesh, or ``None`` (then ``meta.world_size`` must be 1), or a 2-D
            ``("cp_outer", "cp_inner")`` mesh whose flattening the batch was sharded over: then
            Ulysses runs inside ``cp_inner`` and ``method`` across ``cp_outer``
            (:mod:`cpshard.attention.hybrid`).
        meta: Token meta of the sharded batch.
        method: A method of :data:`cpshard.names.METHOD_NAMES` (``"all_gather"``, ``"ring"``,
            ``"ulysses"``, ``"selective"``) or ``"auto"`` (resolved per call by
            :func:`cpshard.attention.cp_sdpa` from the batch's plan and the call's shapes).
        tracker: The step tracker of the dispatcher (:class:`StepTracker`), or ``None``.

    Returns:
        A context manager; use as ``with cp_attention_context(mesh, meta, "ring"): model(...)``.

    Raises:
        ValueError: unknown ``method`` or a mesh that is neither 1-D nor a 2-D CP mesh (raised
            here, before the model runs).
        TypeError: ``cp_mesh`` is not a ``DeviceMesh`` (or ``None``).

    Example:
        >>> ctx = functools.partial(cp_attention_context, cp_mesh, meta, "ring")
        >>> with ctx():
        ...     out = model(**batch)
    """
    check_method(method)
    return _scope(validate_cp_mesh(cp_mesh, grid=True), meta, method, tracker)
