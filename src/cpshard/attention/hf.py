"""HF transformers integration through its attention registry (no monkey-patching).

:func:`use_cp_attention` registers the attention name ``"cpshard"`` and selects it on a model.
Its function calls ``F.scaled_dot_product_attention`` with ``is_causal`` and no mask, so inside
:func:`cpshard.attention.cp_attention_context` the call becomes CP attention, and outside it is
plain local attention. A custom name matters: with the stock ``"sdpa"`` path, transformers reads
jumps in sharded ``position_ids`` as packed-document boundaries and builds a wrong block mask;
for an unregistered-mask name it builds no mask at all. transformers is imported lazily.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

__all__ = ["ATTENTION_NAME", "cpshard_attention_forward", "use_cp_attention"]

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
        attention_mask: Must be ``None``: under CP, masks come from the token meta.
        dropout: Attention dropout; must be 0 while training.
        scaling: Score scale (``None`` -> ``1/sqrt(D)``).
        **kwargs: Ignored except ``is_causal``, which overrides ``module.is_causal``.

    Returns:
        ``(attn_output [B, S, Hq, D], None)``.

    Raises:
        ValueError: a mask was given, or dropout > 0 in training mode.
    """
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
    is_causal = kwargs.get("is_causal")
    if is_causal is None:
        is_causal = bool(getattr(module, "is_causal", True))
    out = F.scaled_dot_product_attention(
        query,
        key,
        value,
        is_causal=bool(is_causal),
        scale=scaling,
        enable_gqa=query.shape[1] != key.shape[1],
    )
    return out.transpose(1, 2).contiguous(), None


def use_cp_attention(model: torch.nn.Module) -> None:
    """Register the ``"cpshard"`` attention name (idempotent) and select it on ``model``.

    Args:
        model: A transformers ``PreTrainedModel``.

    Note:
        transformers (5.x) builds no mask for this name and drops a 2-D ``attention_mask`` given
        to the model before the attention function sees it: under CP, padding must reach the
        token meta through the sharder's ``padding_mask`` (pad tokens get their own documents).

    Raises:
        ImportError: transformers is not installed.
        TypeError: ``model`` has neither ``set_attn_implementation`` nor a ``config``.
    """
    from transformers import AttentionInterface

    registry = AttentionInterface()  # type: ignore[no-untyped-call]
    if registry.get(ATTENTION_NAME) is not cpshard_attention_forward:
        AttentionInterface.register(ATTENTION_NAME, cpshard_attention_forward)
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
