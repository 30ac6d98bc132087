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

Import rules: the rows of ``RULES`` in tests/unit/test_architecture.py that cover this module.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import re
from collections.abc import Callable, Iterator
from typing import Any

import torch

from cpshard import _compat
from cpshard.attention.context import active_mode, cp_context_active
from cpshard.attention.hf_options import run_cp_hf_attention
from cpshard.attention.softcap import softcap_masked_attention

__all__ = [
    "ATTENTION_NAME",
    "attention_implementations",
    "check_cp_attention_support",
    "cp_attention_scope",
    "cpshard_attention_forward",
    "cpshard_attention_mask",
    "interface_attention_modules",
    "use_cp_attention",
    "uses_attention_interface",
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
    if attention_mask is not None and not _is_no_mask(attention_mask):
        # The mask builder returns None under CP and the model guard refuses a caller's mask:
        # this one was computed inside the model's attention itself (e.g. doge's dynamic mask).
        raise ValueError(
            f"{type(module).__name__} computed its own attention mask (shape "
            f"{tuple(attention_mask.shape)}) and passed it to the 'cpshard' attention: a "
            "model-made mask over this rank's local tokens (a dynamic/learned mask or score "
            "bias) cannot be applied under CP (it would be silently wrong). This model cannot "
            "run under cpshard CP; run it at cp=1 with its own attn_implementation (without "
            "prepare_cp_forward), or configure it without that mask"
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
        given = kwargs.get("attention_mask")
        if given is not None and not _is_no_mask(given):
            _reject_mask_under_cp(given)
        return None
    from transformers.masking_utils import sdpa_mask

    mask: torch.Tensor | None = sdpa_mask(*args, **kwargs)
    return mask


def _is_no_mask(mask: object) -> bool:
    """A 2-D keep-mask of all ones (some models, e.g. BioGPT, build one themselves): no mask."""
    if not isinstance(mask, torch.Tensor) or mask.dim() != 2:
        return False
    if mask.dtype == torch.bool:
        return bool(mask.all())
    return bool((mask == 1).all())


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
    _compat.set_config_attn_implementation(config, ATTENTION_NAME)


def attention_implementations(config: Any) -> str | dict[str, Any]:
    """The attention implementation of a transformers config and its sub-configs.

    Args:
        config: A ``PretrainedConfig``.

    Returns:
        The name (e.g. ``"flash_attention_2"``) when every sub-config uses the same one, else the
        nested dict that ``model.set_attn_implementation`` accepts (``""`` = the config itself).
    """
    own: str = _compat.attn_implementation(config)
    subs: dict[str, Any] = {}
    for key in getattr(config, "sub_configs", None) or {}:
        sub = getattr(config, key, None)
        if sub is not None and _compat.has_attn_implementation(sub):
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


def uses_attention_interface(cls: type) -> bool:
    """Whether ``cls.forward`` dispatches through transformers' attention registry.

    Read from the forward's source (:func:`cpshard._compat.source_uses_attention_registry`), the
    structural fact transformers' own verdict checks per file.
    """
    forward = getattr(cls, "forward", None)
    if forward is None:
        return False
    try:
        src = inspect.getsource(forward)
    except (OSError, TypeError):
        return False
    return _compat.source_uses_attention_registry(src)


_READS_MASK = re.compile(r"attention_mask\s*\[|attention_mask\.(?!shape\b|dim\b)\w+\(")


def _reads_mask(cls: type) -> bool:
    """Whether ``cls.forward`` reads the mask's values itself (indexes it, calls its methods)."""
    try:
        src = inspect.getsource(cls.forward)  # type: ignore[attr-defined]
    except (OSError, TypeError):
        return False
    return _READS_MASK.search(src) is not None


def interface_attention_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The submodules whose forward calls the attention registry (one call each per forward)."""
    return [m for m in model.modules() if uses_attention_interface(type(m))]


def _off_interface(model: torch.nn.Module) -> list[str]:
    """Classes of attention-like submodules (``*Attention*`` with projections) off the registry."""
    names: list[str] = []
    for m in model.modules():
        name = type(m).__name__
        if "Attention" not in name or uses_attention_interface(type(m)) or name in names:
            continue
        projects = any(
            isinstance(c, torch.nn.Linear) or type(c).__name__ == "Conv1D" for c in m.children()
        )
        if projects or any(True for _ in m.parameters(recurse=False)):
            names.append(name)
    return names


def check_cp_attention_support(model: torch.nn.Module) -> None:
    """Raise unless every attention of the HF ``model`` runs through cpshard's registered one.

    Four facts, all local (no collective, the same verdict on every rank): transformers'
    ``_can_set_attn_implementation`` of every sub-model (it reads whether the model's attention
    classes dispatch through ``AttentionInterface``), the attention-like submodules that bypass
    it, interface attention modules that read the mask's values themselves (sparse indexers:
    under CP there is no mask) or configs whose alibi bias rides on the mask, and a trial
    switch: after ``set_attn_implementation("cpshard")`` every (sub-)config must report
    ``"cpshard"`` (it is switched back at once).

    Raises:
        ValueError: naming the module class(es), why, and what to do.
    """
    from transformers import PreTrainedModel

    subs = [m for m in model.modules() if isinstance(m, PreTrainedModel)]
    for sub in subs:
        can = _compat.can_set_attn_implementation(type(sub))
        # HF's verdict is per file: a file whose vision tower uses the interface may still hold
        # a text attention that does not (GIT), so the module structure is checked too.
        off = _off_interface(sub)
        if off or can is False:
            off = off or [type(sub).__name__]
            raise ValueError(
                f"{type(model).__name__}: {', '.join(off)} computes attention itself instead of "
                "through transformers' AttentionInterface, so cpshard cannot route it to CP "
                "attention (it would attend over this rank's shard only, or across packed "
                "documents: silently wrong). Feature: attention off the AttentionInterface. Use "
                "a model whose attention goes through the interface (e.g. the Llama-style "
                "families), or train this one without cpshard (cp=1, no prepare_cp_forward)"
            )
    for sub in subs:
        cfg = sub.config
        if getattr(cfg, "alibi", False) is True or "alibi" in str(
            getattr(cfg, "position_embedding_type", "")
        ):
            raise ValueError(
                f"{type(model).__name__}: config {type(cfg).__name__} enables alibi, whose "
                "position bias the model adds to the attention mask it builds; under CP there "
                "is no mask (CP attention takes visibility from the token meta), so the bias "
                "would be silently dropped. Feature: alibi carried by the mask. Use a RoPE "
                "configuration of the model, or train it without cpshard (cp=1, no "
                "prepare_cp_forward)"
            )
    readers = sorted({type(m).__name__ for m in interface_attention_modules(model)
                      if _reads_mask(type(m))})  # fmt: skip
    if readers:
        raise ValueError(
            f"{type(model).__name__}: {', '.join(readers)} reads the attention mask itself (e.g. "
            "a sparse-attention indexer that selects keys from it, or a mask it edits), but "
            "under CP there is no mask over the sequence (visibility comes from the token meta "
            "inside CP attention), so it cannot run exactly. Feature: a mask-reading attention. "
            "Train this model without cpshard (cp=1, no prepare_cp_forward)"
        )
    with _selected(model):
        wrong = [
            f"{type(sub).__name__} ({_compat.attn_implementation(sub.config)!r})"
            for sub in subs
            if _compat.attn_implementation(sub.config, ATTENTION_NAME) != ATTENTION_NAME
        ]
    if wrong:
        raise ValueError(
            f"{type(model).__name__}: set_attn_implementation('cpshard') did not take on "
            f"{', '.join(wrong)}; its attention would run locally over this rank's shard "
            "(silently wrong). Train this model without cpshard (cp=1, no prepare_cp_forward)"
        )
