"""The HF attention arguments that change the result, read once per call of the "cpshard" function.

transformers hands an attention function per-layer keyword arguments on top of q/k/v/mask:
``sliding_window`` (Mistral, Qwen2/Qwen3 with ``use_sliding_window``, Gemma 2/3 on their sliding
layers), ``softcap`` (Gemma 2), ``s_aux`` (GPT-OSS attention sinks), ``head_mask``, and
bookkeeping that does not change the result (``position_ids``, ``cu_seq_lens_*``,
``output_attentions``...). Under CP every argument that changes the result is honoured
(window, soft-cap) or rejected with a ``ValueError`` naming it; never silently dropped. (Outside
a CP context the "cpshard" name runs transformers' own sdpa function, except for a ``softcap``,
which that function ignores in some releases (5.17) and rejects in others: such a layer runs the
soft-capped math of :mod:`cpshard.attention.softcap`; see :mod:`cpshard.attention.hf`.)

Imports only the window and soft-cap checks and the routing context of this package.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from cpshard.attention.plan import check_window
from cpshard.attention.softcap import check_softcap

__all__ = ["HFAttentionOptions", "hf_attention_options", "run_cp_hf_attention"]

_UNSUPPORTED = ("s_aux", "sinks", "head_mask", "score_mod", "block_mask")


@dataclass(frozen=True)
class HFAttentionOptions:
    """What one HF attention call asks for.

    Attributes:
        causal: Causal masking (``is_causal`` kwarg, else ``module.is_causal``, else True).
        window: Sliding window or ``None``.
        softcap: Score soft-cap or ``None``.
    """

    causal: bool
    window: int | None
    softcap: float | None


def hf_attention_options(module: torch.nn.Module, kwargs: Mapping[str, Any]) -> HFAttentionOptions:
    """Read and check the result-changing HF attention kwargs.

    Args:
        module: The calling attention module.
        kwargs: The extra keyword arguments transformers passed.

    Returns:
        The :class:`HFAttentionOptions`.

    Raises:
        ValueError: an argument that cannot be honoured (attention sinks, a head mask, a score
            mod or block mask), or a bad window/soft-cap value.
    """
    for name in _UNSUPPORTED:
        if kwargs.get(name) is not None:
            raise ValueError(
                f"the 'cpshard' attention got {name}=..., which changes the attention result and "
                "is not supported by CP attention; use a model/config without it (e.g. attention "
                "sinks, head masks and score mods are not implemented), or another "
                "attn_implementation without CP"
            )
    causal = kwargs.get("is_causal")
    if causal is None:
        causal = bool(getattr(module, "is_causal", True))
    window = kwargs.get("sliding_window")
    softcap = kwargs.get("softcap")
    check_window(window, bool(causal))
    check_softcap(softcap)
    return HFAttentionOptions(bool(causal), window, None if softcap is None else float(softcap))


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
    from cpshard.attention.context import active_cp_attention

    attn = active_cp_attention()
    if attn is None:
        raise ValueError("run_cp_hf_attention needs an active cp_attention_context (ctx())")
    opts = hf_attention_options(module, kwargs)
    return attn(
        query, key, value, causal=opts.causal, scale=scaling, window=opts.window,
        softcap=opts.softcap,
    )  # fmt: skip
