"""CUDA kernel selection (pure rules) and the fused-op calls' conventions on ``meta`` tensors.

torch registers meta kernels for the CUDA attention ops, so argument order, keyword names and
result shapes of every call in ``cpshard.attention.cuda_kernels`` are checked here without a GPU.
The numerics are covered by ``tests/gpu``.
"""

from __future__ import annotations

import warnings

import pytest
import torch

import _varlen as vk
from cpshard.attention import cuda_kernels as ck
from cpshard.attention.kernels import pick_backend

H100, T4, V100 = (9, 0), (7, 5), (7, 0)
BF16, FP16, FP32, FP64 = torch.bfloat16, torch.float16, torch.float32, torch.float64


def _choose(
    dtype: torch.dtype = BF16,
    head_dim: int = 64,
    cap: tuple[int, int] = H100,
    masked: bool = False,
    nonsquare: bool = False,
    requested: str = "auto",
    lk: int | None = None,
) -> ck.KernelChoice:
    return ck.choose_cuda_backend(
        dtype=dtype, head_dim=head_dim, capability=cap, masked=masked,
        causal_nonsquare=nonsquare, requested=requested, lk=lk,
    )  # fmt: skip


@pytest.mark.parametrize(
    ("kwargs", "backend"),
    [
        ({}, "cuda_flash"),
        ({"dtype": FP16}, "cuda_flash"),
        ({"head_dim": 100}, "cuda_flash"),  # padded to 104
        ({"head_dim": 256}, "cuda_flash"),
        ({"head_dim": 257}, "cuda_efficient"),
        ({"dtype": FP32}, "cuda_efficient"),
        ({"masked": True}, "cuda_efficient"),
        ({"nonsquare": True}, "cuda_efficient"),
        ({"dtype": FP16, "cap": T4}, "cuda_efficient"),
        ({"dtype": FP32, "cap": V100}, "cuda_efficient"),
        ({"requested": "cudnn"}, "cudnn"),
        ({"requested": "cudnn", "masked": True}, "cuda_efficient"),
        ({"requested": "cudnn", "lk": 2}, "cudnn"),
        ({"requested": "cudnn", "lk": 1}, "cuda_flash"),  # cuDNN rejects a block of one key
        ({"requested": "cudnn", "lk": 1, "head_dim": 100, "cap": (8, 0)}, "cuda_flash"),
        ({"requested": "cudnn", "lk": 1, "masked": True}, "cuda_efficient"),
        ({"requested": "cuda_flash", "masked": True}, "cuda_efficient"),
        ({"requested": "cuda_efficient"}, "cuda_efficient"),
        ({"requested": "math"}, "math"),
        ({"head_dim": 200, "cap": (8, 9)}, "cuda_efficient"),  # no flash backward there
        ({"head_dim": 224, "cap": (8, 6)}, "cuda_efficient"),
        ({"head_dim": 232, "cap": (8, 9)}, "cuda_flash"),
        ({"head_dim": 200, "cap": (12, 0)}, "cuda_efficient"),
        ({"head_dim": 200}, "cuda_flash"),  # H100/H200 are fine
    ],
)
def test_choice(kwargs: dict[str, object], backend: str) -> None:
    got = _choose(**kwargs)  # type: ignore[arg-type]
    assert got.backend == backend
    assert got.reason == ""


@pytest.mark.parametrize(
    ("kwargs", "why", "runs_in"),
    [
        ({"dtype": FP64}, "float64", "math kernel in fp64"),
        ({"dtype": BF16, "cap": T4}, "bf16", "math kernel in fp32"),
        ({"dtype": FP64, "masked": True}, "masked tile", "math kernel in fp64"),
    ],
)
def test_math_fallback_says_why(kwargs: dict[str, object], why: str, runs_in: str) -> None:
    got = _choose(**kwargs)  # type: ignore[arg-type]
    assert got.backend == "math"
    assert why in got.reason
    assert runs_in in got.reason  # the accumulation dtype of the math kernel, fp64 for fp64
    assert "fp32/fp16/bf16" in got.reason  # and the fix


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"requested": "cuda_flash", "dtype": FP32}, "only fp16/bf16"),
        ({"requested": "cuda_flash", "cap": T4}, "capability"),
        ({"requested": "cuda_flash", "head_dim": 320}, "head dim"),
        ({"requested": "cudnn", "head_dim": 192}, "head dim"),
        ({"requested": "cuda_flash", "head_dim": 200, "cap": (8, 6)}, r"\(192, 224\]"),
        ({"requested": "cuda_efficient", "dtype": FP64}, "fp32/fp16/bf16"),
        ({"requested": "cpu_flash"}, "cannot run CUDA"),
    ],
)
def test_impossible_explicit_backend_raises(kwargs: dict[str, object], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        _choose(**kwargs)  # type: ignore[arg-type]


def test_cuda_backends_rejected_for_cpu_tensors() -> None:
    with pytest.raises(ValueError, match="only CUDA tensors"):
        pick_backend(torch.zeros(1, 1, 2, 4), "cuda_flash")
    assert pick_backend(torch.zeros(1, 1, 2, 4)) == "cpu_flash"  # CPU unchanged


def test_math_fallback_warns_once_per_reason() -> None:
    q = torch.empty(1, 2, 3, 8, device="meta")
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("default")
        for _ in range(3):
            assert pick_backend(q) == "math"
    msgs = [str(w.message) for w in seen]
    assert len(msgs) == 1
    assert "meta" in msgs[0]
    assert "math kernel" in msgs[0]


def test_padded_head_dim() -> None:
    assert [ck.padded_head_dim(d) for d in (1, 8, 12, 64, 100, 256)] == [8, 8, 16, 64, 104, 256]


def _meta(*shape: int, dtype: torch.dtype = BF16) -> torch.Tensor:
    return torch.empty(*shape, dtype=dtype, device="meta")


@pytest.mark.parametrize("head_dim", [64, 12])
def test_dense_ops_on_meta(head_dim: int) -> None:
    q, k = _meta(2, 4, 10, head_dim), _meta(2, 2, 12, head_dim)
    for fwd, bwd, dtype in (
        (ck.flash_forward, ck.flash_backward, BF16),
        (ck.cudnn_forward, ck.cudnn_backward, BF16),
    ):
        qq, kk = q.to(dtype), k.to(dtype)
        out, lse = fwd(qq, kk, kk, is_causal=False, scale=0.1)
        assert out.shape == q.shape
        assert lse.shape == (2, 4, 10)
        assert lse.dtype == FP32
        dq, dk, dv = bwd(qq, qq, kk, kk, out, lse, is_causal=False, scale=0.1)
        assert (dq.shape, dk.shape, dv.shape) == (q.shape, k.shape, k.shape)
    mask = torch.empty(1, 10, 12, dtype=torch.bool, device="meta")
    for dtype in (FP32, BF16):
        qq, kk = q.to(dtype), k.to(dtype)
        for m in (None, mask):
            out, lse = ck.efficient_forward(qq, kk, kk, m, is_causal=False, scale=0.1)
            assert out.shape == q.shape
            assert out.dtype == dtype
            assert lse.shape == (2, 4, 10)  # the op's 32-padding is cut off
            dq, dk, dv = ck.efficient_backward(
                qq, qq, kk, kk, out, lse, m, is_causal=False, scale=0.1
            )
            assert (dq.shape, dk.shape, dv.shape) == (q.shape, k.shape, k.shape)
            assert dk.dtype == FP32


def test_aligned_bias_layout() -> None:
    mask = torch.tensor([[[True, False, True], [False, False, False]]])
    bias = ck._aligned_bias(mask, FP32, (2, 3, 2, 3))
    assert bias.shape == (2, 3, 2, 3)
    assert bias.stride(-2) % ck.BIAS_ALIGN == 0
    assert bias.stride(1) == 0  # one tile for every head
    want = torch.tensor([[0.0, float("-inf"), 0.0], [float("-inf")] * 3])
    assert torch.equal(bias[1, 2], want)


def test_varlen_ops_on_meta() -> None:
    q, k = _meta(30, 4, 72), _meta(40, 2, 72)
    cu = torch.empty(4, dtype=torch.int32, device="meta")
    out, lse = vk.flash_varlen_forward(q, k, k, cu, cu, 16, 20, causal=True, scale=0.1)
    assert out.shape == q.shape
    assert lse.shape == (4, 30)
    dq, dk, dv = vk.flash_varlen_backward(
        q, q, k, k, out, lse, cu, cu, 16, 20, causal=True, scale=0.1
    )
    assert (dq.shape, dk.shape, dv.shape) == (q.shape, k.shape, k.shape)


def test_varlen_visible_keys_bottom_right() -> None:
    cu_q = torch.tensor([0, 3, 5, 5, 6], dtype=torch.int32)  # runs: 3, 2, 0, 1 queries
    cu_k = torch.tensor([0, 5, 6, 8, 8], dtype=torch.int32)  # runs: 5, 1, 2, 0 keys
    got = vk.varlen_visible_keys(cu_q, cu_k, 6, causal=True)
    assert got.tolist() == [3, 4, 5, 0, 1, 0]
    assert vk.varlen_visible_keys(cu_q, cu_k, 6, causal=False).tolist() == [5, 5, 5, 1, 1, 0]


@pytest.mark.parametrize("broken", [False, True])
def test_fp64_cpu_blocks_under_compile_avoid_the_broken_op(broken: bool) -> None:
    """torch < 2.13 cannot compile the CPU flash op's fp64 backward: math (fp64) there instead."""
    from unittest import mock

    from cpshard.attention import kernels

    q64, q32 = torch.zeros(1, 1, 2, 4, dtype=torch.float64), torch.zeros(1, 1, 2, 4)
    with (
        mock.patch.object(kernels, "COMPILE_BEFORE_2_13", broken),
        mock.patch.object(torch.compiler, "is_compiling", return_value=True),
    ):
        assert pick_backend(q64) == ("math" if broken else "cpu_flash")
        assert pick_backend(q32) == "cpu_flash"
    with mock.patch.object(kernels, "COMPILE_BEFORE_2_13", broken):
        assert pick_backend(q64) == "cpu_flash"  # eager: always the fused op
