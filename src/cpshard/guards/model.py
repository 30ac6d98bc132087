"""Call-time guards on a CP-prepared model: the sharded batch runs inside its own ``ctx()``.

:func:`cpshard.prepare_cp_forward` installs one forward pre-hook and one forward hook on the
model (:func:`install_model_guard`: idempotent, the public ``register_forward_pre_hook`` /
``register_forward_hook`` API; nothing is patched). On every forward it checks, from facts
the call itself carries (the local batch tensors carry the identity of the shard that made them):

* a local batch tensor reaches the model *outside* ``ctx()`` (or inside
  :func:`cpshard.attention.suspend`): attention would silently be shard-local -> ``ValueError``;
* inside ``ctx()``, a local tensor of *another* batch (a stale ctx, or a ctx of a newer batch)
  -> ``ValueError``;
* inside ``ctx()``, a sharded batch without ``position_ids`` (when the forward takes them): the
  model would number the local tokens ``0..L-1`` -> ``ValueError`` with the fix;
* inside ``ctx()``, ``labels`` handed to the model: an HF model would shift the pre-shifted labels
  again and average over the local tokens only -> ``ValueError`` with the fix;
* inside ``ctx()``, an ``attention_mask`` handed to the model: it would be ignored (padding
  reaches CP attention through the sharded batch) -> ``ValueError`` with the fix.

Calls on unsharded tensors outside ``ctx()`` (evaluation, generation) are not affected.

HF gradient checkpointing is checked at prepare: its recomputation runs in ``backward()``, outside
any CP context, so it must be non-reentrant with
``context_fn=cpshard.attention.checkpoint_context_fn`` (else attention would be recomputed as local
attention: silently wrong gradients) -> ``ValueError`` with the fix.

Whether every rank ran every phase of its step (an exception caught inside the forward, a
skipped backward or ``sync_grads``) is the step record's job (:mod:`cpshard.guards.step`).

Imports the shard identity (:mod:`cpshard.sharding.facts`) and the active attention mode
(:mod:`cpshard.attention.context`); never :mod:`cpshard.dispatch` (which installs the guard),
tools, cli or models.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any

from torch import nn

from cpshard.attention.context import active_mode, checkpoint_context_fn
from cpshard.sharding.facts import batch_tag, same_shard

__all__ = ["check_gradient_checkpointing", "install_model_guard"]

_LOSS_FIX = (
    "compute the loss from the logits with the global token count instead, e.g. "
    "loss = cpshard.loss.cp_cross_entropy(logits, local['labels'], "
    "num_tokens=cpshard.loss.count_tokens(batch['labels']))"
)


class _ModelGuard:
    """The forward pre-hook of one prepared model."""

    def pre(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        _check_call(module, args, kwargs)


def _check_call(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    if kwargs.get("_pre_embed_only"):  # the dispatcher's model-hook call
        return
    tags = [t for t in (batch_tag(v) for v in (*args, *kwargs.values())) if t is not None]
    mode = active_mode()
    if mode is None:
        if tags:
            raise ValueError(
                f"{type(module).__name__} was prepared for CP and called on a sharded batch "
                "outside its ctx(): attention would only see this rank's shard (silently wrong "
                "at cp > 1). Run the forward inside the context: `with ctx(): "
                "out = model(**local)`"
            )
        return
    if not all(same_shard(t, mode.meta) for t in tags):
        raise ValueError(
            f"{type(module).__name__} got a local tensor of another batch than the one its "
            "ctx() was made for; use the ctx returned together with this batch"
        )
    if kwargs.get("labels") is not None:
        raise ValueError(
            f"{type(module).__name__} got `labels` inside ctx(): its own loss would shift the "
            "(already shifted) labels again and average over this rank's tokens only. Do not "
            f"pass labels to the model under CP; {_LOSS_FIX}"
        )
    if kwargs.get("attention_mask") is not None:
        raise ValueError(
            f"{type(module).__name__} got an `attention_mask` inside ctx(), which CP attention "
            "cannot use (masks come from the sharded batch's token meta). Put the padding in the "
            "batch given to prepare_cp_forward (attention_mask or padding_mask) and call the "
            "model without it, e.g. model(input_ids=local['input_ids'], "
            "position_ids=local['position_ids'])"
        )
    if tags and _omits_position_ids(module, args, kwargs):
        raise ValueError(
            f"{type(module).__name__} got a sharded batch inside ctx() without `position_ids`: "
            "it would number this rank's tokens 0..L-1 (RoPE / position embeddings silently "
            "wrong, for packed rows at cp=1 too). Pass the sharded batch's global positions, "
            "e.g. model(input_ids=local['input_ids'], position_ids=local['position_ids'])"
        )


def _omits_position_ids(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """Whether ``module``'s forward takes ``position_ids`` and this call leaves it ``None``."""
    if kwargs.get("position_ids") is not None:
        return False
    try:
        sig = inspect.signature(module.forward)
        bound = sig.bind_partial(*args, **kwargs)
    except (TypeError, ValueError):
        return False
    return "position_ids" in sig.parameters and bound.arguments.get("position_ids") is None


def check_gradient_checkpointing(model: nn.Module) -> None:
    """Raise unless HF gradient checkpointing (if enabled) recomputes under the CP context.

    Raises:
        ValueError: a module checkpoints with the reentrant variant, or without
            ``context_fn=cpshard.attention.checkpoint_context_fn``.
    """
    for name, module in model.named_modules():
        if getattr(module, "gradient_checkpointing", False) is not True or not module.training:
            continue  # HF checkpoints only in training mode (eval / log-prob passes are fine)
        func = getattr(module, "_gradient_checkpointing_func", None)
        if func is None:
            continue
        kwargs = func.keywords if isinstance(func, functools.partial) else {}
        if kwargs.get("use_reentrant", True) is not False:
            problem = "uses reentrant checkpointing, whose recomputation cannot see the CP context"
        elif kwargs.get("context_fn") is not checkpoint_context_fn:
            problem = "checkpoints without cpshard's recompute context"
        else:
            continue
        raise ValueError(
            f"{type(model).__name__} has gradient checkpointing enabled (module "
            f"{name or type(module).__name__!r}) and {problem}: backward() would recompute "
            "attention as local attention of this rank's shard (silently wrong gradients under "
            "CP). Enable it as model.gradient_checkpointing_enable(gradient_checkpointing_kwargs="
            "{'use_reentrant': False, 'context_fn': cpshard.attention.checkpoint_context_fn})"
        )


def install_model_guard(model: nn.Module, cp_size: int) -> None:
    """Register the call-time guard on ``model`` once.

    Raises:
        ValueError: HF gradient checkpointing that would recompute attention outside CP (see
            :func:`check_gradient_checkpointing`).
    """
    check_gradient_checkpointing(model)
    for hook in model._forward_pre_hooks.values():
        guard = getattr(hook, "__self__", None)
        if isinstance(guard, _ModelGuard):
            return
    guard = _ModelGuard()
    model.register_forward_pre_hook(guard.pre, with_kwargs=True)
