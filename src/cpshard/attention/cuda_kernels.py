"""torch's fused CUDA attention ops that return the log-sum-exp, and which one a call may use.

:mod:`cpshard.attention.kernels` calls these behind its ``block_attention`` (and
``benchmarks/_varlen_kernels.py`` its helpers); nothing else should. Every function here only
calls ``torch.ops.aten`` ops (through :mod:`cpshard._compat`, the ops' one seam), so it also runs
on ``meta`` tensors (torch registers meta kernels for the CUDA ops), which is how the CPU test
suite checks argument order and result shapes.

Ops (schemas of torch 2.11-2.13; only positional arguments and ``scale=`` are used):

* ``cuda_flash``: ``aten._scaled_dot_product_flash_attention`` (+ ``_backward``), ``[B, H, L, D]``,
  fp16/bf16, sm80+, head dim <= 256, no mask, ``is_causal`` only on square tiles (flash aligns the
  causal mask to the bottom-right corner, the other kernels to the top-left; they agree only when
  ``Lq == Lk``). GQA native: ``k``/``v`` keep ``Hkv`` heads, the backward returns ``Hkv``-head
  gradients. LSE ``[B, H, Lq]`` fp32.
* ``cuda_efficient``: ``aten._scaled_dot_product_efficient_attention`` (+ ``_backward``),
  fp32/fp16 (sm50+) and bf16 (sm80+), any head dim that is a multiple of 8 after padding, an
  additive bias of q's dtype (the only fused op here that takes a mask), causal from the top-left.
  No GQA: it runs once per query group on a strided view of ``q`` (K/V are never repeated). Its LSE
  is ``[B, H, ceil(Lq / 32) * 32]``; the padding is cut off here and restored for the backward.
* ``cudnn``: ``aten._scaled_dot_product_cudnn_attention`` (+ ``_backward``), fp16/bf16, sm80+,
  head dim <= 128, no mask, square causal only, at least 2 keys (cuDNN rejects a block of one
  key: such blocks, e.g. of a 1-token document, go to flash or memory-efficient attention);
  explicit request only (never chosen by ``auto``).
* varlen (``aten._flash_attention_forward`` / ``_flash_attention_backward``): in
  ``benchmarks/_varlen_kernels.py``, which no engine path calls.

Head dims that are not a multiple of 8 are zero-padded (scores and the output's first ``D``
columns are unchanged with an explicit ``scale``) and the padding is sliced off. Every backward is
given the *merged* output and LSE of the full key set, so per-block gradients add up exactly.
The random-state tensors of the backward ops are only read with dropout, which is always 0 here.

Desk-checked against torch's sources (``native_functions.yaml``, ``attention.cu``,
``attention_backward.cu``, ``flash_api.cpp``, the mem-efficient kernels) and the meta kernels of
torch 2.13; **not yet run on a GPU** (``tests/gpu`` and ``benchmarks/gpu_check.sh`` do that):

* confirmed in the sources: the positional order of every call below; flash takes ``Hkv < Hq``
  natively (``num_heads % num_heads_k == 0``) and sums the group gradients itself; flash needs
  ``stride(-1) == 1`` only and makes ``grad_out``/``out`` contiguous itself; the flash varlen LSE
  is unpadded ``[H, Tq]``, the dense one ``[B, H, Lq]``; flash (dense and varlen) aligns causal
  masks bottom-right, memory-efficient attention (``CausalFromTopLeft``) and the CPU op top-left;
  flash reports ``lse = +inf`` (out 0) for a query with no key; the memory-efficient forward pads
  its LSE to a multiple of 32 and its backward reads it through its batch/head strides; the
  memory-efficient backward derives the output's row stride as ``H * D`` (``o_strideM``), so
  ``out`` must be ``[B, L, H, D]``-contiguous (:func:`_bmhk`), and it needs equal head counts;
  with ``max_q == 1`` and GQA flash varlen reshapes ``q`` to ``[n_runs, ...]``, which fails when
  a run has no query (so ``max_q`` is passed as at least 2, a valid bound).
* unverified until a GPU runs ``tests/gpu``: the numerics (tolerances), cuDNN's LSE being a
  natural log (torch's own context parallelism merges it like flash's), cuDNN's shape limits for
  small or odd sequence lengths, and the memory-efficient kernel's output for a row whose bias is
  all ``-inf`` (overwritten here with ``out = 0``, ``lse = -inf`` either way).

Import rules: the rows of ``RULES`` in tests/unit/test_architecture.py that cover this module.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F

from cpshard import _compat

__all__ = [
    "BIAS_ALIGN",
    "EFFICIENT_LSE_ALIGN",
    "FLASH_MAX_HEAD_DIM",
    "ConcreteBackend",
    "KernelChoice",
    "choose_cuda_backend",
    "cudnn_backward",
    "cudnn_forward",
    "efficient_backward",
    "efficient_forward",
    "flash_backward",
    "flash_forward",
    "padded_head_dim",
]

ConcreteBackend = Literal["cpu_flash", "math", "cuda_flash", "cuda_efficient", "cudnn"]

FLASH_MAX_HEAD_DIM = 256
CUDNN_MAX_HEAD_DIM = 128
HEAD_DIM_MULTIPLE = 8
EFFICIENT_LSE_ALIGN = 32  # memory-efficient attention pads its LSE's query dim to this
BIAS_ALIGN = 16  # memory-efficient attention wants the bias's row stride a multiple of this

_HALF = (torch.float16, torch.bfloat16)


@dataclass(frozen=True)
class KernelChoice:
    """The concrete kernel for one call, and why the math fallback was taken (else ``""``)."""

    backend: ConcreteBackend
    reason: str = ""


def padded_head_dim(head_dim: int) -> int:
    """Head dim rounded up to the multiple of 8 the fused kernels need."""
    return -(-head_dim // HEAD_DIM_MULTIPLE) * HEAD_DIM_MULTIPLE


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _flash_blocker(dtype: torch.dtype, head_dim: int, capability: tuple[int, int]) -> str:
    if dtype not in _HALF:
        return f"flash attention supports only fp16/bf16, got {_dtype_name(dtype)}"
    if capability < (8, 0):
        return f"flash attention needs compute capability >= 8.0, got {capability}"
    dp = padded_head_dim(head_dim)
    if dp > FLASH_MAX_HEAD_DIM:
        return f"flash attention supports head dim <= {FLASH_MAX_HEAD_DIM}, got {head_dim}"
    if _flash_bwd_lacks_192_224(capability) and 192 < dp <= 224:
        # torch's sdp_utils (check_requires_grad_and_head_dim_gt192_constraints_on_sm86_89_or_120)
        # refuses flash training there: its backward kernel does not fit these GPUs.
        return (
            f"flash attention's backward does not support head dim in (192, 224] on compute "
            f"capability {capability}, got {head_dim}"
        )
    return ""


def _flash_bwd_lacks_192_224(capability: tuple[int, int]) -> bool:
    """sm86-sm89 and sm120-sm121: no flash backward for head dims in (192, 224]."""
    return (8, 6) <= capability <= (8, 9) or (12, 0) <= capability <= (12, 1)


def _efficient_blocker(dtype: torch.dtype, capability: tuple[int, int]) -> str:
    if dtype not in (torch.float32, *_HALF):
        return f"memory-efficient attention supports only fp32/fp16/bf16, got {_dtype_name(dtype)}"
    if dtype == torch.bfloat16 and capability < (8, 0):
        return (
            f"memory-efficient attention needs compute capability >= 8.0 for bf16, got {capability}"
        )
    if capability < (5, 0):
        return f"memory-efficient attention needs compute capability >= 5.0, got {capability}"
    return ""


def _cudnn_blocker(dtype: torch.dtype, head_dim: int, capability: tuple[int, int]) -> str:
    if dtype not in _HALF:
        return f"cuDNN attention supports only fp16/bf16, got {_dtype_name(dtype)}"
    if capability < (8, 0):
        return f"cuDNN attention needs compute capability >= 8.0, got {capability}"
    if padded_head_dim(head_dim) > CUDNN_MAX_HEAD_DIM:
        return f"cuDNN attention supports head dim <= {CUDNN_MAX_HEAD_DIM} here, got {head_dim}"
    return ""


def choose_cuda_backend(
    *,
    dtype: torch.dtype,
    head_dim: int,
    capability: tuple[int, int],
    masked: bool,
    causal_nonsquare: bool,
    requested: str,
    lk: int | None = None,
) -> KernelChoice:
    """Pick the fused CUDA kernel for one block (a pure function of the call's properties).

    ``auto`` prefers flash, then memory-efficient attention, then the math fallback (with the
    reason). An explicit fused backend that cannot run this dtype/device at all is an error; a
    masked tile or a non-square causal tile, which flash/cuDNN cannot express, goes to
    memory-efficient attention (the only fused op with an additive bias) instead, and so does a
    block of one key under ``cudnn`` (which rejects it), to flash where flash can run it.

    Args:
        dtype: Query dtype.
        head_dim: Query/key/value head dim (before padding).
        capability: CUDA compute capability ``(major, minor)``.
        masked: The call has a boolean visibility mask.
        causal_nonsquare: ``is_causal`` with ``Lq != Lk`` (top-left alignment needed).
        requested: ``"auto"``, ``"math"``, ``"cuda_flash"``, ``"cuda_efficient"`` or ``"cudnn"``.
        lk: Key length of the block, when known (``1``: not for cuDNN).

    Returns:
        The :class:`KernelChoice`.

    Raises:
        ValueError: an explicit backend that cannot run ``dtype`` on this device, or a CPU-only
            backend requested for a CUDA tensor.
    """
    if requested == "math":
        return KernelChoice("math")
    if requested not in ("auto", "cuda_flash", "cuda_efficient", "cudnn"):
        raise ValueError(
            f"attention backend {requested!r} cannot run CUDA tensors; use 'auto', "
            "'cuda_flash', 'cuda_efficient', 'cudnn' or 'math'"
        )
    needs_bias_kernel = masked or causal_nonsquare
    eff = _efficient_blocker(dtype, capability)
    if requested in ("cuda_flash", "cudnn"):
        blocker = (
            _flash_blocker(dtype, head_dim, capability)
            if requested == "cuda_flash"
            else _cudnn_blocker(dtype, head_dim, capability)
        )
        if blocker:
            raise ValueError(
                f"attention backend {requested!r} cannot run this call: {blocker}; "
                "use backend='auto' (it picks a kernel that can) or 'math'"
            )
        if requested == "cudnn" and lk == 1 and not needs_bias_kernel:  # cuDNN rejects it
            if not _flash_blocker(dtype, head_dim, capability):
                return KernelChoice("cuda_flash")
            needs_bias_kernel = True  # to memory-efficient attention, as below
        if not needs_bias_kernel:
            return KernelChoice(requested)  # type: ignore[arg-type]
        # Masked / non-square causal tiles: flash and cuDNN cannot express them.
        return KernelChoice("cuda_efficient") if not eff else KernelChoice("math", eff)
    if requested == "cuda_efficient":
        if eff:
            raise ValueError(
                f"attention backend 'cuda_efficient' cannot run this call: {eff}; "
                "use backend='auto' or 'math'"
            )
        return KernelChoice("cuda_efficient")
    flash = _flash_blocker(dtype, head_dim, capability)
    if not flash and not needs_bias_kernel:
        return KernelChoice("cuda_flash")
    if not eff:
        return KernelChoice("cuda_efficient")
    why = "a masked tile" if masked else "a causal tile with Lq != Lk"
    if not needs_bias_kernel:
        why = flash
    return KernelChoice(
        "math",
        f"no fused CUDA attention kernel for {why} ({eff}); running the math kernel in "
        f"{'fp64' if dtype == torch.float64 else 'fp32'}, which materialises the [Lq, Lk] "
        "scores: use fp32/fp16/bf16 inputs to get a fused kernel",
    )


# --- helpers ---------------------------------------------------------------------------------


def _pad_head(x: torch.Tensor, dp: int) -> torch.Tensor:
    """Zero-pad the last dim to ``dp`` and make it unit-stride (what every fused op needs)."""
    if x.shape[-1] != dp:
        return F.pad(x, (0, dp - x.shape[-1]))
    return x if x.stride(-1) == 1 else x.contiguous()


def _groups(q: torch.Tensor, k: torch.Tensor, head_dim: int) -> int:
    hq, hkv = q.shape[head_dim], k.shape[head_dim]
    if hkv == 0 or hq % hkv != 0:
        raise ValueError(
            f"query heads must be a multiple of key/value heads (GQA), got Hq={hq}, Hkv={hkv}"
        )
    return hq // hkv


def _lse_rows(
    lse: torch.Tensor, lead: tuple[int, ...], rows: int, op: str, *, exact: bool = False
) -> torch.Tensor:
    """The first ``rows`` LSE entries of a ``[*lead, >= rows]`` op result, else a clear error.

    A torch build whose op returns another LSE layout (e.g. a padded per-run varlen LSE) must
    fail loudly here instead of merging misaligned values (host metadata only, no sync).
    ``exact``: the last dim must be exactly ``rows`` (no padding allowed).
    """
    n = lse.shape[-1] if lse.dim() else -1
    if (
        lse.dim() != len(lead) + 1
        or tuple(lse.shape[:-1]) != lead
        or n < rows
        or (exact and n != rows)
    ):
        raise RuntimeError(
            f"{op} returned a log-sum-exp of shape {tuple(lse.shape)}, expected "
            f"{(*lead, rows)} (torch {torch.__version__}); cpshard's fused CUDA path supports the "
            "layouts of torch 2.11-2.13: use backend='math' with this torch"
        )
    return lse[..., :rows]


def _bmhk(x: torch.Tensor) -> torch.Tensor:
    """``[B, H, L, D]`` view whose storage is ``[B, L, H, D]``-contiguous (no copy if it is)."""
    return x.transpose(1, 2).contiguous().transpose(1, 2)


def _aligned_bias(
    mask: torch.Tensor, dtype: torch.dtype, shape: tuple[int, int, int, int]
) -> torch.Tensor:
    """Bool ``[B or 1, Lq, Lk]`` (True = visible) -> additive bias ``[B, H, Lq, Lk]`` of ``dtype``.

    The storage rows are padded to a multiple of :data:`BIAS_ALIGN` elements and the head dim is a
    stride-0 broadcast, so one ``[B', Lq, Lk]`` tile serves every head.
    """
    b1, lq, lk = mask.shape
    lk_pad = -(-lk // BIAS_ALIGN) * BIAS_ALIGN
    buf = torch.zeros((b1, lq, lk_pad), dtype=dtype, device=mask.device)
    view = buf[:, :, :lk]
    view.masked_fill_(~mask, float("-inf"))
    return view.unsqueeze(1).expand(shape)


# --- flash (dense) ---------------------------------------------------------------------------


def flash_forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, is_causal: bool, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Flash attention with its LSE.

    Args:
        q: ``[B, Hq, Lq, D]`` fp16/bf16.
        k: ``[B, Hkv, Lk, D]``, ``Hq % Hkv == 0``.
        v: ``[B, Hkv, Lk, D]``.
        is_causal: Lower-triangular mask (only with ``Lq == Lk``).
        scale: Score scale.

    Returns:
        ``(out [B, Hq, Lq, D] in q's dtype, lse [B, Hq, Lq] fp32)``.
    """
    _groups(q, k, 1)
    d = q.shape[-1]
    dp = padded_head_dim(d)
    res = _compat.flash_attention(
        _pad_head(q, dp), _pad_head(k, dp), _pad_head(v, dp), is_causal=is_causal, scale=scale
    )
    lse = _lse_rows(res[1], tuple(q.shape[:2]), q.shape[2], "flash attention")
    return res[0][..., :d], lse.float()


def flash_backward(
    grad_out: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    *,
    is_causal: bool,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of :func:`flash_forward` given the merged ``out`` / ``lse`` (finite).

    Returns:
        ``(dq [B, Hq, Lq, D], dk [B, Hkv, Lk, D], dv [B, Hkv, Lk, D])`` in q's dtype.
    """
    _groups(q, k, 1)
    d = q.shape[-1]
    dp = padded_head_dim(d)
    dq, dk, dv = _compat.flash_attention_backward(
        _pad_head(grad_out.to(q.dtype), dp),
        _pad_head(q, dp),
        _pad_head(k, dp),
        _pad_head(v, dp),
        _pad_head(out.to(q.dtype), dp),
        lse.float().contiguous(),
        is_causal=is_causal,
        scale=scale,
    )
    return dq[..., :d], dk[..., :d], dv[..., :d]


# --- memory-efficient ------------------------------------------------------------------------


def efficient_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    *,
    is_causal: bool,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Memory-efficient attention with its LSE, one call per query group.

    Args:
        q: ``[B, Hq, Lq, D]`` fp32/fp16/bf16.
        k: ``[B, Hkv, Lk, D]``.
        v: ``[B, Hkv, Lk, D]``.
        mask: Bool ``[B or 1, Lq, Lk]`` (True = visible) or ``None``.
        is_causal: Top-left lower-triangular mask.
        scale: Score scale.

    Returns:
        ``(out [B, Hq, Lq, D] in q's dtype, lse [B, Hq, Lq] fp32)``; rows with no visible key
        have ``out = 0`` and ``lse = -inf``.
    """
    g = _groups(q, k, 1)
    b, _, lq, d = q.shape
    hkv = k.shape[1]
    dp = padded_head_dim(d)
    qp, kp, vp = _pad_head(q, dp), _pad_head(k, dp), _pad_head(v, dp)
    bias = None if mask is None else _aligned_bias(mask, q.dtype, (b, hkv, lq, k.shape[2]))
    q5 = torch.unflatten(qp, 1, (hkv, g))
    outs, lses = [], []
    for i in range(g):
        res = _compat.efficient_attention(
            q5[:, :, i], kp, vp, bias, is_causal=is_causal, scale=scale
        )
        outs.append(res[0][..., :d])
        lses.append(_lse_rows(res[1], (b, hkv), lq, "memory-efficient attention"))
    if g == 1:
        out, lse = outs[0], lses[0].float()
    else:
        out = torch.stack(outs, dim=2).flatten(1, 2)
        lse = torch.stack(lses, dim=2).flatten(1, 2).float()
    if mask is not None:
        empty = (~mask.any(dim=-1)).unsqueeze(1)  # [B', 1, Lq]
        lse = lse.masked_fill(empty, float("-inf"))
        out = out.masked_fill(empty.unsqueeze(-1), 0.0)
    return out, lse


def efficient_backward(
    grad_out: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    mask: torch.Tensor | None,
    *,
    is_causal: bool,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of :func:`efficient_forward` given the merged ``out`` / ``lse`` (finite).

    Returns:
        ``(dq [B, Hq, Lq, D] in q's dtype, dk, dv [B, Hkv, Lk, D] fp32, summed over groups)``.
    """
    g = _groups(q, k, 1)
    b, _, lq, d = q.shape
    hkv = k.shape[1]
    dp = padded_head_dim(d)
    qp, kp, vp = _pad_head(q, dp), _pad_head(k, dp), _pad_head(v, dp)
    bias = None if mask is None else _aligned_bias(mask, q.dtype, (b, hkv, lq, k.shape[2]))
    lq_pad = -(-lq // EFFICIENT_LSE_ALIGN) * EFFICIENT_LSE_ALIGN
    lse_p = F.pad(lse.float(), (0, lq_pad - lq))
    q5 = torch.unflatten(qp, 1, (hkv, g))
    go5 = torch.unflatten(_pad_head(grad_out.to(q.dtype), dp), 1, (hkv, g))
    o5 = torch.unflatten(_pad_head(out.to(q.dtype), dp), 1, (hkv, g))
    l5 = torch.unflatten(lse_p, 1, (hkv, g))
    dqs = []
    dk_sum: torch.Tensor | None = None
    dv_sum: torch.Tensor | None = None
    for i in range(g):
        dq_i, dk_i, dv_i = _compat.efficient_attention_backward(
            _bmhk(go5[:, :, i]),
            q5[:, :, i],
            kp,
            vp,
            bias,
            _bmhk(o5[:, :, i]),
            l5[:, :, i].contiguous(),
            is_causal=is_causal,
            scale=scale,
        )
        dqs.append(dq_i[..., :d])
        dk_sum = dk_i[..., :d].float() if dk_sum is None else dk_sum + dk_i[..., :d]
        dv_sum = dv_i[..., :d].float() if dv_sum is None else dv_sum + dv_i[..., :d]
    assert dk_sum is not None
    assert dv_sum is not None
    dq = dqs[0] if g == 1 else torch.stack(dqs, dim=2).flatten(1, 2)
    return dq, dk_sum, dv_sum


# --- cuDNN -----------------------------------------------------------------------------------


def cudnn_forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, is_causal: bool, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """cuDNN attention with its LSE, one call per query group (no mask).

    Returns:
        ``(out [B, Hq, Lq, D] in q's dtype, lse [B, Hq, Lq] fp32)``.
    """
    g = _groups(q, k, 1)
    b, _, lq, d = q.shape
    hkv = k.shape[1]
    dp = padded_head_dim(d)
    kp, vp = _pad_head(k, dp).contiguous(), _pad_head(v, dp).contiguous()
    q5 = torch.unflatten(_pad_head(q, dp), 1, (hkv, g))
    outs, lses = [], []
    for i in range(g):
        res = _compat.cudnn_attention(
            q5[:, :, i].contiguous(), kp, vp, is_causal=is_causal, scale=scale
        )
        outs.append(res[0][..., :d])
        lses.append(res[1].reshape(b, hkv, lq))  # [B, H, Lq, 1] in torch 2.13
    out = outs[0] if g == 1 else torch.stack(outs, dim=2).flatten(1, 2)
    lse = lses[0] if g == 1 else torch.stack(lses, dim=2).flatten(1, 2)
    return out, lse.float()


def cudnn_backward(
    grad_out: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    *,
    is_causal: bool,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of :func:`cudnn_forward` given the merged ``out`` / ``lse`` (finite).

    Returns:
        ``(dq [B, Hq, Lq, D] in q's dtype, dk, dv [B, Hkv, Lk, D] fp32, summed over groups)``.
    """
    g = _groups(q, k, 1)
    d = q.shape[-1]
    hkv = k.shape[1]
    dp = padded_head_dim(d)
    kp, vp = _pad_head(k, dp).contiguous(), _pad_head(v, dp).contiguous()
    q5 = torch.unflatten(_pad_head(q, dp), 1, (hkv, g))
    go5 = torch.unflatten(_pad_head(grad_out.to(q.dtype), dp), 1, (hkv, g))
    o5 = torch.unflatten(_pad_head(out.to(q.dtype), dp), 1, (hkv, g))
    l5 = torch.unflatten(lse.float(), 1, (hkv, g))
    dqs = []
    dk_sum: torch.Tensor | None = None
    dv_sum: torch.Tensor | None = None
    for i in range(g):
        dq_i, dk_i, dv_i = _compat.cudnn_attention_backward(
            go5[:, :, i].contiguous(),
            q5[:, :, i].contiguous(),
            kp,
            vp,
            o5[:, :, i].contiguous(),
            l5[:, :, i].unsqueeze(-1).contiguous(),
            is_causal=is_causal,
            scale=scale,
        )
        dqs.append(dq_i[..., :d])
        dk_sum = dk_i[..., :d].float() if dk_sum is None else dk_sum + dk_i[..., :d]
        dv_sum = dv_i[..., :d].float() if dv_sum is None else dv_sum + dv_i[..., :d]
    assert dk_sum is not None
    assert dv_sum is not None
    dq = dqs[0] if g == 1 else torch.stack(dqs, dim=2).flatten(1, 2)
    return dq, dk_sum, dv_sum
