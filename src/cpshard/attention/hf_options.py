"""The HF attention arguments that change the result, read once per call of the "cpshard" function.

transformers hands an attention function per-layer keyword arguments on top of q/k/v/mask:
``sliding_window`` (Mistral, Qwen2/Qwen3 with ``use_sliding_window``, Gemma 2/3 on their sliding
layers), ``softcap`` (Gemma 2), ``s_aux`` / ``sinks`` (gpt-oss style attention sinks), and
bookkeeping that does not change the result (``position_ids``, ``cu_seq_lens_*``,
``output_attentions``...). Under CP every argument is either honoured (causality, window,
soft-cap, sinks), known bookkeeping (an allow-list: transformers' own ``TransformersKwargs`` /
``FlashAttentionKwargs`` names plus the cache arguments), or rejected with a ``ValueError`` naming
it when it is not ``None`` (``position_bias``, ``head_mask``, a DSA ``indices``...): never silently
dropped.

Two rules that transformers carries only in the *mask* or in local positions are rebuilt here
from the module's config and the batch's token meta:

* Llama 4 chunked attention (``config.attention_chunk_size`` on the layers whose
  ``config.layer_types`` entry is ``"chunked_attention"``): query ``i`` sees key ``j`` iff they
  share a document, ``j <= i`` and ``(j - s) // chunk == (i - s) // chunk`` with ``s`` the
  document's first position. Served by CP attention over a derived token meta whose document ids
  also carry the chunk index (planned once per batch, like a window; every layout and method).
* Llama 4's NoPE temperature tuning scales the queries by
  ``log1p(floor((pos + 1) / floor_scale)) * attn_scale + 1`` with ``pos`` the *local* index;
  under CP the scale of the global position replaces it (exact: the factor is positive).

(Outside a CP context the "cpshard" name runs transformers' own sdpa function, except for a
``softcap``, which that function ignores in some releases (5.17) and rejects in others: such a
layer runs the soft-capped math of :mod:`cpshard.attention.softcap`; see
:mod:`cpshard.attention.hf`.)

Import rules: the rows of ``RULES`` in tests/unit/test_architecture.py that cover this module.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from cpshard.attention.plan import check_window
from cpshard.attention.softcap import check_softcap
from cpshard.sharding.meta import TokenMeta

__all__ = [
    "HFAttentionOptions",
    "bookkeeping_kwargs",
    "chunked_meta",
    "document_positions",
    "hf_attention_options",
    "run_cp_hf_attention",
]

_HONOURED = ("is_causal", "sliding_window", "softcap", "s_aux", "sinks")
_CACHE_KWARGS = (
    "use_cache", "cache_position", "past_key_values", "past_key_value", "cache", "layer_idx",
    "position_embeddings", "return_dict", "deterministic", "dropout", "scaling",
    # cpshard's own sharded-batch keys (the README passes the sharded batch to the model): the
    # padding reaches CP attention through the token meta, the loss mask does not touch it
    "padding_mask", "loss_mask",
)  # fmt: skip


def bookkeeping_kwargs() -> frozenset[str]:
    """Names of HF attention kwargs that never change the result under CP.

    transformers' typed kwarg sets (``TransformersKwargs``, ``FlashAttentionKwargs``: positions,
    packing boundaries, output flags...; under CP positions and documents come from the token
    meta) plus the cache and call arguments. Read from the installed transformers, so new
    bookkeeping names are known without a list here.
    """
    names = set(_CACHE_KWARGS)
    try:
        from transformers.modeling_flash_attention_utils import FlashAttentionKwargs
        from transformers.utils.generic import TransformersKwargs
    except ImportError:  # pragma: no cover - another transformers layout
        pass
    else:
        for typed in (TransformersKwargs, FlashAttentionKwargs):
            names.update(getattr(typed, "__annotations__", {}))
    return frozenset(names - set(_HONOURED))


@dataclass(frozen=True)
class HFAttentionOptions:
    """What one HF attention call asks for.

    Attributes:
        causal: Causal masking (``is_causal`` kwarg, else ``module.is_causal``, else True).
        window: Sliding window or ``None``.
        softcap: Score soft-cap or ``None``.
        sinks: ``[Hq]`` attention-sink logits or ``None``.
        chunk: Llama 4 attention chunk size of this layer or ``None``.
    """

    causal: bool
    window: int | None
    softcap: float | None
    sinks: torch.Tensor | None = None
    chunk: int | None = None


def _layer_chunk(module: torch.nn.Module) -> int | None:
    """The chunk size of a chunked-attention layer (config facts), else ``None``."""
    config = getattr(module, "config", None)
    chunk = getattr(config, "attention_chunk_size", None)
    if chunk is None:
        return None
    types = getattr(config, "layer_types", None)
    idx = getattr(module, "layer_idx", None)
    if types is None or idx is None:
        raise ValueError(
            f"{type(module).__name__} has config.attention_chunk_size={chunk} but cpshard cannot "
            "tell whether this layer is chunked (no config.layer_types / module.layer_idx); CP "
            "attention would silently attend across chunks. Run this model at cp=1 without "
            "cpshard, or set attention_chunk_size=None if the model is meant to attend fully"
        )
    if types[idx] != "chunked_attention":
        return None
    if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk <= 0:
        raise ValueError(f"attention_chunk_size must be a positive int, got {chunk!r}")
    return chunk


def hf_attention_options(module: torch.nn.Module, kwargs: Mapping[str, Any]) -> HFAttentionOptions:
    """Read and check the result-changing HF attention kwargs.

    Args:
        module: The calling attention module.
        kwargs: The extra keyword arguments transformers passed.

    Returns:
        The :class:`HFAttentionOptions`.

    Raises:
        ValueError: a non-``None`` argument that is neither honoured nor known bookkeeping
            (e.g. ``position_bias``, ``head_mask``, a score mod or a sparse-index ``indices``),
            or a bad window/soft-cap/sink value.
    """
    known = bookkeeping_kwargs()
    for name, value in kwargs.items():
        if value is None or name in _HONOURED or name in known:
            continue
        raise ValueError(
            f"{type(module).__name__} passed {name}=... to the 'cpshard' attention function; "
            "cpshard does not know this argument, and dropping it could change the attention "
            "result (e.g. a relative position bias, a head mask, a score mod or sparse indices), "
            "so CP refuses it. Use a model/config without it, or run this model at cp=1 with its "
            "own attn_implementation (without prepare_cp_forward)"
        )
    causal = kwargs.get("is_causal")
    if causal is None:
        causal = bool(getattr(module, "is_causal", True))
    window = kwargs.get("sliding_window")
    softcap = kwargs.get("softcap")
    sinks = kwargs.get("s_aux")
    if sinks is None:
        sinks = kwargs.get("sinks")
    check_window(window, bool(causal))
    check_softcap(softcap)
    chunk = _layer_chunk(module)
    if chunk is not None and not causal:
        raise ValueError(
            f"{type(module).__name__}: chunked attention (attention_chunk_size={chunk}) needs "
            "causal attention under CP, got is_causal=False"
        )
    return HFAttentionOptions(
        bool(causal), window, None if softcap is None else float(softcap), sinks, chunk
    )


def document_positions(meta: TokenMeta) -> torch.Tensor:
    """``[B or 1, C * L]`` position of every slot inside its document (``0`` at its start).

    Cached on ``meta``. Pads (negative document ids) get positions relative to the first pad.
    """
    hit = meta.plan_cache.get("document_positions")
    if isinstance(hit, torch.Tensor):
        return hit
    pos, doc = meta.positions, meta.document_ids
    # First position of every (row, document): the minimum position over its tokens.
    ids, inverse = torch.unique(torch.where(doc >= 0, doc, -1), return_inverse=True)
    start = torch.full((pos.shape[0], ids.numel()), torch.iinfo(pos.dtype).max, dtype=pos.dtype)
    start = start.to(pos.device).scatter_reduce(1, inverse, pos, reduce="amin")
    rel = pos - start.gather(1, inverse)
    meta.plan_cache["document_positions"] = rel
    return rel


def chunked_meta(meta: TokenMeta, chunk: int) -> TokenMeta:
    """``meta`` with each document split into its attention chunks (cached on ``meta``).

    Query ``i`` and key ``j`` of one document then share a (derived) document iff
    ``(i - s) // chunk == (j - s) // chunk``, ``s`` the document's first position (packed
    documents included, as transformers' chunked mask on per-document positions). Pads keep
    their unique negative ids.

    Args:
        meta: Token meta of the sharded batch.
        chunk: Attention chunk size (positive).

    Returns:
        A :class:`TokenMeta` with the same rank, world size and positions.
    """
    key = f"chunked:{chunk}"
    hit = meta.plan_cache.get(key)
    if isinstance(hit, TokenMeta):
        return hit
    doc = meta.document_ids
    rel = document_positions(meta)
    per_doc = int(rel.max().item()) // chunk + 1 if rel.numel() else 1
    idx = torch.div(rel, chunk, rounding_mode="floor")
    split = torch.where(doc >= 0, doc * per_doc + idx, doc)
    derived = TokenMeta(meta.rank, meta.world_size, meta.positions, split)
    meta.plan_cache[key] = derived
    return derived


def _nope_temperature(
    module: torch.nn.Module, query: torch.Tensor, meta: TokenMeta
) -> torch.Tensor:
    """Queries of a Llama 4 NoPE layer rescaled from local to global positions (else as is)."""
    if not getattr(module, "attn_temperature_tuning", False) or getattr(module, "use_rope", True):
        return query
    floor_scale = float(getattr(module, "floor_scale"))  # noqa: B009
    attn_scale = float(getattr(module, "attn_scale"))  # noqa: B009

    def scale(p: torch.Tensor) -> torch.Tensor:  # as transformers computes it (fp32)
        return torch.log1p(torch.floor((p.float() + 1.0) / floor_scale)) * attn_scale + 1.0

    n = query.shape[2]
    local = scale(torch.arange(n, device=query.device))  # what the module applied
    n_loc = meta.local_len
    rel = document_positions(meta)[:, meta.rank * n_loc : (meta.rank + 1) * n_loc]
    glob = scale(rel.to(query.device))  # [B or 1, L]: the position inside the document
    factor = (glob / local).to(query.dtype)[:, None, :, None]
    return query * factor


def run_cp_hf_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    scaling: float | None,
    kwargs: Mapping[str, Any],
) -> torch.Tensor:
    """CP attention for one HF attention call inside a CP context, kwargs honoured.

    Args:
        module: The calling attention module.
        query: ``[B, Hq, L, D]`` local queries.
        key: ``[B, Hkv, L, D]`` local keys.
        value: ``[B, Hkv, L, D]`` local values.
        scaling: Score scale (``None`` -> ``1/sqrt(D)``).
        kwargs: The extra keyword arguments transformers passed.

    Returns:
        ``[B, Hq, L, D]`` attention output.

    Raises:
        ValueError: see :func:`hf_attention_options`; also when no CP context is active.
    """
    from cpshard.attention.context import active_cp_attention, active_mode

    attn = active_cp_attention()
    mode = active_mode()
    if attn is None or mode is None:
        raise ValueError("run_cp_hf_attention needs an active cp_attention_context (ctx())")
    opts = hf_attention_options(module, kwargs)
    mode.attention_calls += 1
    meta = mode.meta
    query = _nope_temperature(module, query, meta)
    extra: dict[str, Any] = {}
    if opts.chunk is not None:
        extra["meta"] = chunked_meta(meta, opts.chunk)
    if opts.sinks is not None:
        extra["sinks"] = opts.sinks
    return attn(
        query, key, value, causal=opts.causal, scale=scaling, window=opts.window,
        softcap=opts.softcap, **extra,
    )  # fmt: skip
