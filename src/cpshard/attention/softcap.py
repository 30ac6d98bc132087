"""Attention with soft-capped scores (Gemma 2): ``s = cap * tanh(q.k * scale / cap)``.

No fused CPU kernel caps the scores, so one block runs as explicit math in the accumulation dtype
(fp32, fp64 for fp64 inputs), :data:`ROWS` query rows at a time, so memory stays bounded by
``ROWS x Lk`` scores per head whatever the block size. The interface matches
:func:`cpshard.attention.kernels.block_attention` / ``block_attention_backward`` (partial output
and natural-log LSE; gradients given the merged output and LSE), so the blockwise merge is the same.

:func:`softcap_masked_attention` is the same math for an HF attention mask, differentiable by
autograd: the "cpshard" HF attention runs it outside a CP context when a layer passes ``softcap``,
because transformers' own sdpa function ignores ``softcap`` in some releases (5.17: Gemma 2 would
silently lose its soft-capping) and rejects it in others (5.25).

Import rules: the rows of ``RULES`` in tests/unit/test_architecture.py that cover this module.
"""

from __future__ import annotations

import torch

from cpshard.attention.merge import accumulation_dtype

__all__ = [
    "ROWS",
    "check_softcap",
    "softcap_attention",
    "softcap_attention_backward",
    "softcap_masked_attention",
]

ROWS = 128
"""Query rows per chunk of the math."""


def check_softcap(softcap: float | None) -> None:
    """Raise ``ValueError`` unless ``softcap`` is ``None`` or a positive finite number."""
    if softcap is None:
        return
    ok = isinstance(softcap, (int, float)) and not isinstance(softcap, bool)
    if not ok or not (0.0 < float(softcap) < float("inf")):
        raise ValueError(
            f"softcap must be a positive finite number (scores become cap * tanh(s / cap)), got "
            f"{softcap!r}; pass None for no soft-capping"
        )


def _chunk_scores(
    q5: torch.Tensor,
    k: torch.Tensor,
    mask: torch.Tensor | None,
    is_causal: bool,
    r0: int,
    scale: float,
    cap: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Capped masked scores ``[B, Hkv, G, r, Lk]`` of query rows ``r0..`` and their ``tanh``."""
    t = torch.tanh(torch.einsum("bhgqd,bhkd->bhgqk", q5, k) * (scale / cap))
    s = t * cap
    rows = q5.shape[3]
    if is_causal:
        qi = torch.arange(r0, r0 + rows, device=q5.device)[:, None]
        ki = torch.arange(k.shape[2], device=q5.device)[None, :]
        s = s.masked_fill(ki > qi, float("-inf"))
    if mask is not None:
        s = s.masked_fill(~mask[:, None, None, r0 : r0 + rows], float("-inf"))
    return s, t


def _split(q: torch.Tensor, hkv: int, acc: torch.dtype) -> torch.Tensor:
    return torch.unflatten(q, 1, (hkv, q.shape[1] // hkv)).to(acc)


def softcap_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    mask: torch.Tensor | None,
    is_causal: bool,
    scale: float,
    softcap: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One block of soft-capped attention with its log-sum-exp.

    Args:
        q: ``[B, Hq, Lq, D]`` queries.
        k: ``[B, Hkv, Lk, D]`` keys (``Hq % Hkv == 0``).
        v: ``[B, Hkv, Lk, D]`` values.
        mask: Bool ``[B or 1, Lq, Lk]`` (``True`` = visible) or ``None``.
        is_causal: Lower-triangular mask by index (``Lq == Lk``).
        scale: Score scale (applied before the cap).
        softcap: The cap.

    Returns:
        ``(out [B, Hq, Lq, D] in q's dtype, lse [B, Hq, Lq] in the accumulation dtype)``; rows
        with no visible key have ``out = 0`` and ``lse = -inf``.
    """
    acc = accumulation_dtype(q.dtype)
    hkv = k.shape[1]
    q5 = _split(q, hkv, acc)
    ka, va = k.to(acc), v.to(acc)
    outs, lses = [], []
    for r0 in range(0, q.shape[2], ROWS):
        s, _ = _chunk_scores(q5[:, :, :, r0 : r0 + ROWS], ka, mask, is_causal, r0, scale, softcap)
        lse = torch.logsumexp(s, dim=-1)
        safe = torch.where(torch.isneginf(lse), torch.zeros_like(lse), lse)
        outs.append(torch.einsum("bhgqk,bhkd->bhgqd", torch.exp(s - safe.unsqueeze(-1)), va))
        lses.append(lse)
    out = torch.cat(outs, dim=3).flatten(1, 2)
    return out.to(q.dtype), torch.cat(lses, dim=3).flatten(1, 2)


def softcap_attention_backward(
    grad_out: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    *,
    mask: torch.Tensor | None,
    is_causal: bool,
    scale: float,
    softcap: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of one soft-capped block, given the merged output and LSE over all key blocks.

    Args:
        grad_out: ``[B, Hq, Lq, D]`` upstream gradient of the global output.
        q: ``[B, Hq, Lq, D]`` queries.
        k: ``[B, Hkv, Lk, D]`` keys of this block.
        v: ``[B, Hkv, Lk, D]`` values of this block.
        out: ``[B, Hq, Lq, D]`` global output.
        lse: ``[B, Hq, Lq]`` global LSE.
        mask: As in the forward.
        is_causal: As in the forward.
        scale: Score scale.
        softcap: The cap.

    Returns:
        ``(dq [B, Hq, Lq, D], dk [B, Hkv, Lk, D], dv [B, Hkv, Lk, D])`` in the accumulation dtype.
    """
    acc = accumulation_dtype(q.dtype)
    hkv = k.shape[1]
    q5, go5, o5 = (_split(t, hkv, acc) for t in (q, grad_out, out))
    l5 = _split(torch.where(torch.isneginf(lse), torch.zeros_like(lse), lse), hkv, acc)
    ka, va = k.to(acc), v.to(acc)
    dk = torch.zeros(k.shape, dtype=acc, device=k.device)
    dv = torch.zeros(v.shape, dtype=acc, device=v.device)
    dqs = []
    for r0 in range(0, q.shape[2], ROWS):
        sl = slice(r0, r0 + ROWS)
        qc, goc = q5[:, :, :, sl], go5[:, :, :, sl]
        s, t = _chunk_scores(qc, ka, mask, is_causal, r0, scale, softcap)
        p = torch.exp(s - l5[:, :, :, sl].unsqueeze(-1))
        dv += torch.einsum("bhgqk,bhgqd->bhkd", p, goc)
        dp = torch.einsum("bhgqd,bhkd->bhgqk", goc, va)
        ds = p * (dp - (goc * o5[:, :, :, sl]).sum(-1, keepdim=True)) * (1 - t * t) * scale
        dqs.append(torch.einsum("bhgqk,bhkd->bhgqd", ds, ka))
        dk += torch.einsum("bhgqk,bhgqd->bhkd", ds, qc)
    return torch.cat(dqs, dim=3).flatten(1, 2), dk, dv


def _visible(mask: torch.Tensor, lq: int, lk: int) -> torch.Tensor:
    """HF's ``[B|1, 1, Lq, Lk]`` mask as bool ``[B|1, Lq, Lk]`` (``True`` = visible)."""
    if mask.dim() != 4 or mask.shape[1] != 1 or tuple(mask.shape[2:]) != (lq, lk):
        raise ValueError(
            f"soft-capped attention takes an attention mask [B or 1, 1, {lq}, {lk}], got "
            f"{tuple(mask.shape)}; per-head masks are not supported"
        )
    if mask.dtype == torch.bool:
        return mask[:, 0]
    visible = mask > torch.finfo(mask.dtype).min / 2
    if bool((mask[visible] != 0).any()):
        raise ValueError(
            "soft-capped attention takes a bool mask or an additive mask of 0 / -inf (or the "
            "dtype's minimum); this one adds other values to the scores (a bias), which the "
            "cap would have to see first; pass the bias another way"
        )
    return visible[:, 0]


def softcap_masked_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    attention_mask: torch.Tensor | None,
    *,
    is_causal: bool,
    scale: float,
    softcap: float,
) -> torch.Tensor:
    """Soft-capped attention of a whole (unsharded) sequence with an HF attention mask.

    The math of :func:`softcap_attention` (accumulation dtype, :data:`ROWS` rows at a time) as
    plain differentiable ops, for a model prepared for CP that runs without CP (evaluation,
    generation).

    Args:
        q: ``[B, Hq, Lq, D]`` queries.
        k: ``[B, Hkv, Lk, D]`` keys (``Hq % Hkv == 0``).
        v: ``[B, Hkv, Lk, D]`` values.
        attention_mask: Bool ``[B|1, 1, Lq, Lk]`` (``True`` = visible), or additive with 0 for
            visible and ``-inf`` / the dtype's minimum for hidden keys; or ``None``.
        is_causal: Lower-triangular by index (top-left aligned, as SDPA's ``is_causal``), on top
            of the mask.
        scale: Score scale (applied before the cap).
        softcap: The cap, a positive finite number.

    Returns:
        ``[B, Hq, Lq, D]`` in ``q``'s dtype; a query that sees no key gets zeros.

    Raises:
        ValueError: a bad ``softcap``, a per-head mask, or an additive mask with a bias.
    """
    check_softcap(softcap)
    lq, lk = q.shape[2], k.shape[2]
    mask = None if attention_mask is None else _visible(attention_mask, lq, lk)
    acc = accumulation_dtype(q.dtype)
    hkv = k.shape[1]
    q5 = _split(q, hkv, acc)
    ka, va = k.to(acc), v.to(acc)
    outs = []
    for r0 in range(0, lq, ROWS):
        s, _ = _chunk_scores(q5[:, :, :, r0 : r0 + ROWS], ka, mask, is_causal, r0, scale, softcap)
        dead = torch.isneginf(s).all(dim=-1, keepdim=True)  # a row with no visible key: zeros
        p = torch.softmax(s.masked_fill(dead, 0.0), dim=-1).masked_fill(dead, 0.0)
        outs.append(torch.einsum("bhgqk,bhkd->bhgqd", p, va))
    return torch.cat(outs, dim=3).flatten(1, 2).to(q.dtype)
