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

* ``"cuda_flash"`` / ``"cuda_efficient"`` / ``"cudnn"``: torch's fused CUDA ops that return the
  LSE (see :mod:`cpshard.attention.cuda_kernels` for the ops, their constraints and conventions).
  ``"auto"`` on CUDA picks flash for fp16/bf16 mask-free tiles, memory-efficient attention for
  fp32 and for masked tiles (an additive bias, the only fused op that takes one), and the math
  kernel only as a fallback that warns once per reason (e.g. fp64, or bf16 before sm80).

GQA: ``k``/``v`` have ``Hkv`` heads dividing ``Hq``; query head ``h`` uses key head
``h // (Hq // Hkv)`` (the ``repeat_kv`` convention). K/V are never repeated: the CPU flash,
memory-efficient and cuDNN backends run once per query group on a strided view of ``q``, CUDA flash
takes ``Hkv`` heads natively, the math backend broadcasts.

Import rules: the rows of ``RULES`` in tests/unit/test_architecture.py that cover this module.
"""

from __future__ import annotations

import warnings
from typing import Literal

import torch

from cpshard import _compat
from cpshard.attention import cuda_kernels as ck
from cpshard.attention.cuda_kernels import ConcreteBackend
from cpshard.attention.merge import accumulation_dtype, empty_partial

__all__ = [
    "COMPILE_BEFORE_2_13",
    "ConcreteBackend",
    "KernelBackend",
    "block_attention",
    "block_attention_backward",
    "pick_backend",
]

KernelBackend = Literal["auto", "cpu_flash", "math", "cuda_flash", "cuda_efficient", "cudnn"]

_CUDA_ONLY = ("cuda_flash", "cuda_efficient", "cudnn")

COMPILE_BEFORE_2_13 = tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2]) < (
    2,
    13,
)
"""torch < 2.13 (the GPU image's 2.11), whose ``torch.compile`` mishandles two CP paths: the CPU
flash op's fp64 backward fails ("expected scalar type Double but found Float": its meta kernel
gives an fp32 logsumexp), so a compiled fp64 CPU block runs the math kernel (fp64) instead; and
:func:`cpshard.attention.core.cp_sdpa` refuses the gathering methods in compiled regions there.
Eager is unaffected."""


def _warn_fallback(reason: str) -> None:
    """One warning per distinct reason: always raised from this line, so ``warnings`` dedups it."""
    warnings.warn(reason, RuntimeWarning, stacklevel=1)


def pick_backend(
    q: torch.Tensor,
    backend: KernelBackend = "auto",
    *,
    masked: bool = False,
    is_causal: bool = False,
    lk: int | None = None,
) -> ConcreteBackend:
    """Resolve ``backend`` to the kernel that runs one block.

    CPU: ``"auto"`` is the CPU flash op when torch has it, else math. CUDA: see
    :func:`cpshard.attention.cuda_kernels.choose_cuda_backend` (flash, memory-efficient, math
    fallback with a warning). Other devices: math, with a warning.

    Args:
        q: Query tensor ``[B, Hq, Lq, D]`` (its device, dtype and head dim decide).
        backend: Requested backend.
        masked: The block has a boolean mask (CUDA: flash/cuDNN cannot take one).
        is_causal: The block is causal (CUDA: with ``lk != Lq`` only top-left kernels qualify).
        lk: Key length of the block (default: ``Lq``).

    Returns:
        The concrete backend name.

    Raises:
        ValueError: a CUDA-only backend for a non-CUDA tensor, or a fused backend that cannot run
            this dtype/device.
    """
    if q.device.type == "cuda":
        if backend == "cpu_flash":
            raise ValueError(
                "attention backend 'cpu_flash' runs only CPU tensors, got a CUDA tensor; "
                "use 'auto', 'cuda_flash', 'cuda_efficient', 'cudnn' or 'math'"
            )
        lq = q.shape[-2]
        choice = ck.choose_cuda_backend(
            dtype=q.dtype,
            head_dim=q.shape[-1],
            capability=torch.cuda.get_device_capability(q.device),
            masked=masked,
            causal_nonsquare=is_causal and lk is not None and lk != lq,
            requested=backend,
            lk=lq if lk is None else lk,
        )
        if choice.reason:
            _warn_fallback(choice.reason)
        return choice.backend
    if backend in _CUDA_ONLY:
        raise ValueError(
            f"attention backend {backend!r} runs only CUDA tensors, got a {q.device.type} "
            "tensor; use 'auto', 'cpu_flash' or 'math'"
        )
    if backend != "auto":
        return backend  # type: ignore[return-value]
    if q.device.type == "cpu" and _compat.CPU_FLASH_AVAILABLE:
        if q.dtype == torch.float64 and COMPILE_BEFORE_2_13 and torch.compiler.is_compiling():
            return "math"  # same result; the compiled CPU flash op fails in fp64 there
        return "cpu_flash"
    _warn_fallback(
        f"no fused attention kernel for {q.device.type} tensors in cpshard; running the math "
        "kernel, which materialises the [Lq, Lk] scores: use CPU or CUDA tensors"
    )
    return "math"


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
    kind = pick_backend(q, backend, masked=mask is not None, is_causal=is_causal, lk=k.shape[-2])
    if kind in _CUDA_ONLY:
        return _fused_forward(kind, q, k, v, mask, is_causal, scale)
    if kind == "math":
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
        o, lse = _compat.cpu_flash_attention(
            q5[:, :, i], k, v, is_causal=is_causal, attn_mask=add, scale=scale
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
        dtype for the math backend; for the CPU flash, memory-efficient and cuDNN backends ``dq``
        is in q's dtype and ``dk``/``dv`` (summed over query groups) in the accumulation dtype;
        CUDA flash returns all three in q's dtype. Callers add them into accumulation-dtype
        buffers.
    """
    acc = accumulation_dtype(q.dtype)
    g = _groups(q, k)
    hkv = k.shape[1]
    lse = torch.where(torch.isneginf(lse), torch.zeros_like(lse), lse)
    kind = pick_backend(q, backend, masked=mask is not None, is_causal=is_causal, lk=k.shape[-2])
    if kind in _CUDA_ONLY:
        return _fused_backward(kind, grad_out, q, k, v, out, lse, mask, is_causal, scale)
    if kind == "math":
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
        dq_i, dk_i, dv_i = _compat.cpu_flash_attention_backward(
            go5[:, :, i].contiguous(),
            q5[:, :, i],
            k,
            v,
            o5[:, :, i].contiguous(),
            l5[:, :, i].contiguous(),
            is_causal=is_causal,
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


def _empty_block(q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The result for a block without queries or keys (fused kernels reject empty tensors)."""
    if q.shape[2] and k.shape[2]:
        return None
    out, lse = empty_partial(tuple(q.shape), torch.float32, q.device)
    return out.to(q.dtype), lse


def _fused_forward(
    kind: str,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    is_causal: bool,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    ck._groups(q, k, 1)
    empty = _empty_block(q, k)
    if empty is not None:
        return empty
    if kind == "cuda_flash":
        return ck.flash_forward(q, k, v, is_causal=is_causal, scale=scale)
    if kind == "cudnn":
        return ck.cudnn_forward(q, k, v, is_causal=is_causal, scale=scale)
    return ck.efficient_forward(q, k, v, mask, is_causal=is_causal, scale=scale)


def _fused_backward(
    kind: str,
    grad_out: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    mask: torch.Tensor | None,
    is_causal: bool,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    ck._groups(q, k, 1)
    if not (q.shape[2] and k.shape[2]):
        return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    if kind == "cuda_flash":
        return ck.flash_backward(grad_out, q, k, v, out, lse, is_causal=is_causal, scale=scale)
    if kind == "cudnn":
        return ck.cudnn_backward(grad_out, q, k, v, out, lse, is_causal=is_causal, scale=scale)
    return ck.efficient_backward(
        grad_out, q, k, v, out, lse, mask, is_causal=is_causal, scale=scale
    )
