"""One local attention block with its log-sum-exp, and its backward given the global result.

This is the only place that runs attention math. Every CP method reduces to calls of
:func:`block_attention` (forward: partial output and natural-log LSE of one query block against
one key block) and :func:`block_attention_backward` (gradients of one block, given the *merged*
output and LSE of the whole key set), merged by :mod:`cpshard.attention.merge`.

Backends:

* ``"cpu_flash"``: ``aten._scaled_dot_product_flash_attention_for_cpu`` (+ ``_backward``), the op
  ``F.scaled_dot_product_attention`` runs on CPU. It takes a *float* additive mask of the query
  dtype (bool masks are rejected), returns an LSE that is not differentiable, and reports
  ``lse = 0`` (not ``-inf``) for fully masked rows; :func:`block_attention` fixes that up.
* ``"math"``: explicit softmax attention in fp32 (fp64 for fp64 inputs). Device-agnostic and
  correct, used off CPU and wherever the CPU op is missing; slower and ``O(Lq * Lk)`` memory.

GQA: ``k``/``v`` have ``Hkv`` heads dividing ``Hq``; query head ``h`` uses key head
``h // (Hq // Hkv)`` (the ``repeat_kv`` convention). K/V are never repeated: the flash backend runs
once per query group on a strided view of ``q``, the math backend broadcasts.
"""

from __future__ import annotations

from typing import Literal

import torch

from cpshard.attention.merge import accumulation_dtype

__all__ = ["KernelBackend", "block_attention", "block_attention_backward", "pick_backend"]

KernelBackend = Literal["auto", "cpu_flash", "math"]


def pick_backend(q: torch.Tensor, backend: KernelBackend = "auto") -> Literal["cpu_flash", "math"]:
    """Resolve ``"auto"``: the CPU flash op for CPU tensors when torch has it, else math.

    Args:
        q: Query tensor (its device decides).
        backend: Requested backend.

    Returns:
        The concrete backend name.
    """
    if backend != "auto":
        return backend
    has_op = hasattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu")
    return "cpu_flash" if q.device.type == "cpu" and has_op else "math"


def _float_mask(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Bool ``[B', Lq, Lk]`` (True = visible) -> additive ``[B', 1, Lq, Lk]`` of ``dtype``."""
    add = torch.zeros(mask.shape, dtype=dtype, device=mask.device)
    add.masked_fill_(~mask, float("-inf"))
    return add.unsqueeze(1)


def _groups(q: torch.Tensor, k: torch.Tensor) -> int:
    hq, hkv = q.shape[1], k.shape[1]
    if hkv == 0 or hq % hkv != 0:
        raise ValueError(
            f"query heads must be a multiple of key/value heads (GQA), got Hq={hq}, Hkv={hkv}"
        )
    return hq // hkv


def _math_scores(
    q: torch.Tensor, k: torch.Tensor, mask: torch.Tensor | None, is_causal: bool, scale: float
) -> torch.Tensor:
    """Masked scaled scores ``[B, Hkv, G, Lq, Lk]`` in the accumulation dtype."""
    acc = accumulation_dtype(q.dtype)
    g = _groups(q, k)
    q5 = torch.unflatten(q, 1, (k.shape[1], g)).to(acc)
    s = torch.einsum("bhgqd,bhkd->bhgqk", q5, k.to(acc)) * scale
    if is_causal:
        lq, lk = q.shape[-2], k.shape[-2]
        tri = torch.ones(lq, lk, dtype=torch.bool, device=q.device).tril()
        s = s.masked_fill(~tri, float("-inf"))
    if mask is not None:
        s = s.masked_fill(~mask[:, None, None], float("-inf"))
    return s


def block_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    mask: torch.Tensor | None,
    is_causal: bool,
    scale: float,
    backend: KernelBackend = "auto",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of one query block against one key block, with its log-sum-exp.

    Args:
        q: ``[B, Hq, Lq, D]`` queries (any strides).
        k: ``[B, Hkv, Lk, D]`` keys, ``Hq % Hkv == 0``.
        v: ``[B, Hkv, Lk, D]`` values.
        mask: Bool ``[B or 1, Lq, Lk]``, ``True`` = visible, or ``None`` (no mask).
        is_causal: Lower-triangular mask by index (``Lq == Lk``); only with ``mask=None``.
        scale: Score scale.
        backend: See :func:`pick_backend`.

    Returns:
        ``(out [B, Hq, Lq, D] in q's dtype, lse [B, Hq, Lq] in the accumulation dtype)``; rows
        with no visible key have ``out = 0`` and ``lse = -inf``.
    """
    acc = accumulation_dtype(q.dtype)
    if pick_backend(q, backend) == "math":
        s = _math_scores(q, k, mask, is_causal, scale)
        lse = torch.logsumexp(s, dim=-1)
        safe = torch.where(torch.isneginf(lse), torch.zeros_like(lse), lse)
        p = torch.exp(s - safe.unsqueeze(-1))
        out = torch.einsum("bhgqk,bhkd->bhgqd", p, v.to(acc))
        return out.flatten(1, 2).to(q.dtype), lse.flatten(1, 2)
    g = _groups(q, k)
    add = None if mask is None else _float_mask(mask, q.dtype)
    q5 = torch.unflatten(q, 1, (k.shape[1], g))
    outs, lses = [], []
    for i in range(g):
        o, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q5[:, :, i], k, v, 0.0, is_causal, attn_mask=add, scale=scale
        )
        outs.append(o)
        lses.append(lse)
    if g == 1:  # no stacking copy without query groups
        out, lse_all = outs[0], lses[0].to(acc)
    else:
        out = torch.stack(outs, dim=2).flatten(1, 2)
        lse_all = torch.stack(lses, dim=2).flatten(1, 2).to(acc)
    if mask is not None:
        empty = ~mask.any(dim=-1)  # [B', Lq]: the op reports lse = 0 there
        lse_all = lse_all.masked_fill(empty.unsqueeze(1), float("-inf"))
    return out, lse_all


def block_attention_backward(
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
    backend: KernelBackend = "auto",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of one block, given the merged output and LSE over *all* key blocks.

    With the global ``out``/``lse``, the block's softmax probabilities are
    ``exp(s - lse_global)``, so summing the ``dq`` of every block and taking each block's
    ``dk``/``dv`` gives exactly the gradients of full attention.

    Args:
        grad_out: ``[B, Hq, Lq, D]`` upstream gradient of the global output.
        q: ``[B, Hq, Lq, D]`` queries.
        k: ``[B, Hkv, Lk, D]`` keys of this block.
        v: ``[B, Hkv, Lk, D]`` values of this block.
        out: ``[B, Hq, Lq, D]`` global (merged) output.
        lse: ``[B, Hq, Lq]`` global LSE (finite for every query).
        mask: Bool ``[B or 1, Lq, Lk]`` or ``None``, as in the forward.
        is_causal: As in the forward.
        scale: Score scale.
        backend: See :func:`pick_backend`.

    Returns:
        ``(dq [B, Hq, Lq, D], dk [B, Hkv, Lk, D], dv [B, Hkv, Lk, D])``, in the accumulation
        dtype for the math backend; for the flash backend ``dq`` is in q's dtype and ``dk``/``dv``
        (summed over query groups) in the accumulation dtype.
    """
    acc = accumulation_dtype(q.dtype)
    g = _groups(q, k)
    hkv = k.shape[1]
    lse = torch.where(torch.isneginf(lse), torch.zeros_like(lse), lse)
    if pick_backend(q, backend) == "math":
        s = _math_scores(q, k, mask, is_causal, scale)
        p = torch.exp(s - torch.unflatten(lse, 1, (hkv, g)).to(acc).unsqueeze(-1))
        go5 = torch.unflatten(grad_out, 1, (hkv, g)).to(acc)
        o5 = torch.unflatten(out, 1, (hkv, g)).to(acc)
        dv = torch.einsum("bhgqk,bhgqd->bhkd", p, go5)
        dp = torch.einsum("bhgqd,bhkd->bhgqk", go5, v.to(acc))
        ds = p * (dp - (go5 * o5).sum(-1, keepdim=True))
        dq = torch.einsum("bhgqk,bhkd->bhgqd", ds, k.to(acc)).flatten(1, 2) * scale
        q5 = torch.unflatten(q, 1, (hkv, g)).to(acc)
        dk = torch.einsum("bhgqk,bhgqd->bhkd", ds, q5) * scale
        return dq, dk, dv
    add = None if mask is None else _float_mask(mask, q.dtype)
    q5 = torch.unflatten(q, 1, (hkv, g))
    go5 = torch.unflatten(grad_out, 1, (hkv, g))
    o5 = torch.unflatten(out.to(q.dtype), 1, (hkv, g))
    l5 = torch.unflatten(lse.to(acc), 1, (hkv, g))
    dqs = []
    dk_sum: torch.Tensor | None = None
    dv_sum: torch.Tensor | None = None
    for i in range(g):
        dq_i, dk_i, dv_i = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            go5[:, :, i].contiguous(),
            q5[:, :, i],
            k,
            v,
            o5[:, :, i].contiguous(),
            l5[:, :, i].contiguous(),
            0.0,
            is_causal,
            attn_mask=add,
            scale=scale,
        )
        dqs.append(dq_i)
        dk_sum = dk_i.to(acc) if dk_sum is None else dk_sum + dk_i
        dv_sum = dv_i.to(acc) if dv_sum is None else dv_sum + dv_i
    assert dk_sum is not None
    assert dv_sum is not None
    dq = dqs[0] if g == 1 else torch.stack(dqs, dim=2).flatten(1, 2)
    return dq, dk_sum, dv_sum
