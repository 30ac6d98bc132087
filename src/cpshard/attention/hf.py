"""HF transformers integration through its attention registry (no monkey-patching).

:func:`use_cp_attention` registers the attention name ``"cpshard"`` (an attention function and a
mask builder) and selects it on a model.

* Inside :func:`cpshard.attention.cp_attention_context` the mask builder builds nothing and the
  function runs CP attention through the active context (``active_cp_attention``), with
  ``is_causal``, ``sliding_window`` and ``softcap`` honoured and no mask (padding and documents
  come from the token meta). A custom name
  matters: with the stock ``"sdpa"`` path, transformers reads jumps in sharded ``position_ids`` as
  packed-document boundaries and builds a wrong block mask.
* Outside it the name behaves exactly like transformers' ``"sdpa"`` (its mask builder and its
  attention function), so a model prepared for CP still honours ``attention_mask`` when it runs
  without CP (evaluation, generation); a layer that passes ``softcap`` (Gemma 2) runs the
  soft-capped math of :mod:`cpshard.attention.softcap` instead, because transformers' sdpa
  function silently ignores ``softcap`` in some releases (5.17) and rejects it in others.

transformers is imported lazily.

Imports only this package's routing context and HF options (and transformers, lazily); never
:mod:`cpshard.dispatch` (which calls :func:`cp_attention_scope`) or :mod:`cpshard.guards`.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import Any

import torch

from cpshard.attention.context import active_mode, cp_context_active
from cpshard.attention.hf_options import run_cp_hf_attention
from cpshard.attention.softcap import softcap_masked_attention

__all__ = [
    "ATTENTION_NAME",
    "attention_implementations",
    "cp_attention_scope",
    "cpshard_attention_forward",
    "cpshard_attention_mask",
    "use_cp_attention",
]

ATTENTION_NAME = "cpshard"


def cpshard_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """The attention function registered as ``"cpshard"`` in transformers.

    Args:
        module: The calling attention module (``module.is_causal`` is read).
        query: ``[B, Hq, S, D]``.
        key: ``[B, Hkv, S, D]`` (GQA not expanded).
        value: ``[B, Hkv, S, D]``.
        attention_mask: Under CP must be ``None`` (masks come from the token meta); outside
            a CP context, transformers' sdpa mask.
        dropout: Attention dropout; must be 0 while training.
        scaling: Score scale (``None`` -> ``1/sqrt(D)``).
        **kwargs: ``is_causal`` (overrides ``module.is_causal``), ``sliding_window`` and
            ``softcap`` are honoured under CP; ``s_aux``/``head_mask``/score mods raise
            (:mod:`cpshard.attention.hf_options`); the rest is bookkeeping.

    Returns:
        ``(attn_output [B, S, Hq, D], None)``.

    Outside a CP context this is transformers' own ``sdpa`` attention (mask and dropout honoured),
    except for a ``softcap``: that layer runs soft-capped attention as explicit math (mask and
    ``is_causal`` honoured; dropout in training raises).

    Raises:
        ValueError: inside a CP context, a mask was given, or dropout > 0 in training mode.
    """
    if not cp_context_active():
        if kwargs.get("softcap") is not None:  # transformers' sdpa ignores it (5.17) or raises
            return _softcap_outside_cp(
                module, query, key, value, attention_mask, dropout, scaling, kwargs
            )
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        out, _ = sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
        return out, None
    if attention_mask is not None:
        raise ValueError(
            f"the 'cpshard' attention got an attention_mask of shape "
            f"{tuple(attention_mask.shape)}; masks come from the CP token meta (document ids, "
            "positions and the batch's padding_mask), so pass padding as padding_mask to the "
            "sharder and no attention_mask to the model"
        )
    if dropout > 0.0 and module.training:
        raise ValueError(
            f"the 'cpshard' attention does not support dropout, got dropout={dropout} in "
            "training mode; set config.attention_dropout=0.0"
        )
    # The prepared model's own self-attention: routed explicitly (causal or not), with
    # sliding_window / softcap / is_causal honoured and sinks & co. rejected (hf_options.py).
    out = run_cp_hf_attention(module, query, key, value, scaling, kwargs)
    return out.transpose(1, 2).contiguous(), None


def _softcap_outside_cp(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float,
    scaling: float | None,
    kwargs: dict[str, Any],
) -> tuple[torch.Tensor, None]:
    """A soft-capped layer without CP: the cap as explicit math (:mod:`.softcap`), the mask and
    ``is_causal`` as transformers' sdpa path reads them; dropout in training raises."""
    if dropout > 0.0 and module.training:
        raise ValueError(
            f"the 'cpshard' attention runs soft-capped layers outside a CP context as explicit "
            f"math without dropout, got dropout={dropout} in training mode; set "
            "config.attention_dropout=0.0"
        )
    causal = bool(kwargs.get("is_causal", getattr(module, "is_causal", True)))
    causal = causal and attention_mask is None and query.shape[2] > 1
    out = softcap_masked_attention(
        query, key, value, attention_mask, is_causal=causal,
        scale=query.shape[-1] ** -0.5 if scaling is None else scaling,
        softcap=float(kwargs["softcap"]),
    )  # fmt: skip
    return out.transpose(1, 2).contiguous(), None


def cpshard_attention_mask(*args: Any, **kwargs: Any) -> torch.Tensor | None:
    """The mask builder registered as ``"cpshard"``: none under CP, transformers' sdpa mask else.

    Raises:
        ValueError: under CP, the model was handed an ``attention_mask`` (it would be ignored).
    """
    if cp_context_active():
        _reject_mask_under_cp(kwargs.get("attention_mask"))
        return None
    from transformers.masking_utils import sdpa_mask

    mask: torch.Tensor | None = sdpa_mask(*args, **kwargs)
    return mask


def _reject_mask_under_cp(mask: object) -> None:
    """An ``attention_mask`` handed to the model under CP would be silently ignored: raise."""
    if mask is not None:
        raise ValueError(
            f"the model got an attention_mask (shape {tuple(getattr(mask, 'shape', ()))}) inside "
            "a CP context, where masks come from the sharded batch's token meta and this one "
            "would be ignored; put the padding in the batch given to prepare_cp_forward "
            "(attention_mask or padding_mask) and call the model without attention_mask"
        )


def use_cp_attention(model: torch.nn.Module) -> None:
    """Register the ``"cpshard"`` attention name (idempotent) and select it on ``model``.

    Args:
        model: A transformers ``PreTrainedModel``.

    Note:
        Under CP (inside the batch's ``ctx()``) transformers builds no mask for this name, so a
        2-D ``attention_mask`` given to the model is not used there: padding reaches the token
        meta through the sharded batch (``attention_mask`` -> ``padding_mask``; pad tokens get
        their own documents). Outside ``ctx()`` the model behaves as with ``"sdpa"``.

    Raises:
        ImportError: transformers is not installed.
        TypeError: ``model`` has neither ``set_attn_implementation`` nor a ``config``.
    """
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    registry = AttentionInterface()  # type: ignore[no-untyped-call]
    if registry.get(ATTENTION_NAME) is not cpshard_attention_forward:
        AttentionInterface.register(ATTENTION_NAME, cpshard_attention_forward)
    masks = AttentionMaskInterface()  # type: ignore[no-untyped-call]
    if masks.get(ATTENTION_NAME) is not cpshard_attention_mask:
        AttentionMaskInterface.register(ATTENTION_NAME, cpshard_attention_mask)
    setter = getattr(model, "set_attn_implementation", None)
    if callable(setter):
        setter(ATTENTION_NAME)
        return
    config = getattr(model, "config", None)
    if config is None:
        raise TypeError(
            f"use_cp_attention needs a transformers model (set_attn_implementation or config), "
            f"got {type(model).__name__}"
        )
    config._attn_implementation = ATTENTION_NAME


def attention_implementations(config: Any) -> str | dict[str, Any]:
    """The attention implementation of a transformers config and its sub-configs.

    Args:
        config: A ``PretrainedConfig``.

    Returns:
        The name (e.g. ``"flash_attention_2"``) when every sub-config uses the same one, else the
        nested dict that ``model.set_attn_implementation`` accepts (``""`` = the config itself).
    """
    own: str = config._attn_implementation
    subs: dict[str, Any] = {}
    for key in getattr(config, "sub_configs", None) or {}:
        sub = getattr(config, key, None)
        if sub is not None and hasattr(sub, "_attn_implementation"):
            subs[key] = attention_implementations(sub)
    if all(v == own for v in subs.values()):
        return own
    return {"": own, **subs}


@contextlib.contextmanager
def _selected(model: torch.nn.Module) -> Iterator[None]:
    """Select ``"cpshard"`` on ``model`` for the span of the block, then restore its own."""
    saved = attention_implementations(model.config)  # type: ignore[union-attr]
    use_cp_attention(model)
    try:
        yield
    finally:
        if saved != ATTENTION_NAME:
            model.set_attn_implementation(saved)  # type: ignore[operator]


@contextlib.contextmanager
def _scope(model: torch.nn.Module, inner: Callable[[], Any]) -> Iterator[None]:
    with _selected(model), inner():
        mode = active_mode()
        if mode is not None:  # a checkpoint's recomputation selects "cpshard" again
            mode.on_recompute.append(functools.partial(_selected, model))
        yield


def cp_attention_scope(
    model: torch.nn.Module, inner: Callable[[], Any]
) -> contextlib.AbstractContextManager[None]:
    """Select cpshard's attention on an HF model for the span of ``inner()``, then restore it.

    Outside the scope the model keeps whatever ``attn_implementation`` it had (``sdpa``,
    ``eager``, ``flash_attention_2``, ``flex_attention``, per sub-config), so evaluation and
    ``generate`` run the model's own attention; inside it, transformers dispatches to the
    ``"cpshard"`` attention and builds no mask. Both switches go through the public
    ``set_attn_implementation``; nothing global is changed.

    Args:
        model: A transformers ``PreTrainedModel``.
        inner: Factory of the CP attention context (the sharder's ``ctx``).

    Returns:
        A context manager: ``with cp_attention_scope(model, ctx): model(...)``.
    """
    return _scope(model, inner)
