"""Every fused CUDA op call of ``cpshard.attention.cuda_kernels``, bound to torch's op schema.

The calls run on ``meta`` tensors (torch registers meta kernels for the CUDA attention ops) through
a recorder that binds each call's positional and keyword arguments to the names in the op's
schema. So a swapped positional argument (``is_causal`` vs ``return_debug_mask``, the philox
placeholders, ``scale``) or a keyword the op does not have fails here, without a GPU. The layout
rules checked (the memory-efficient backward's ``[B, L, H, D]`` output, its 32-padded LSE, the
aligned bias, flash varlen's ``max_q`` bound) come from torch's CUDA sources; the numerics are
``tests/gpu``'s.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

import _varlen as vk
from cpshard.attention import cuda_kernels as ck

BF16, FP32 = torch.bfloat16, torch.float32

# Arguments cpshard may pass: positional ones that torch 2.11-2.13 all have, and ``scale=``.
# Later keywords (window sizes, seqused_k, ...) are deliberately never used.
USED = {
    "_scaled_dot_product_flash_attention": {
        "query", "key", "value", "dropout_p", "is_causal", "return_debug_mask", "scale",
    },
    "_scaled_dot_product_flash_attention_backward": {
        "grad_out", "query", "key", "value", "out", "logsumexp", "cum_seq_q", "cum_seq_k",
        "max_q", "max_k", "dropout_p", "is_causal", "philox_seed", "philox_offset", "scale",
    },
    "_scaled_dot_product_efficient_attention": {
        "query", "key", "value", "attn_bias", "compute_log_sumexp", "dropout_p", "is_causal",
        "scale",
    },
    "_scaled_dot_product_efficient_attention_backward": {
        "grad_out_", "query", "key", "value", "attn_bias", "out", "logsumexp", "philox_seed",
        "philox_offset", "dropout_p", "grad_input_mask", "is_causal", "scale",
    },
    "_scaled_dot_product_cudnn_attention": {
        "query", "key", "value", "attn_bias", "compute_log_sumexp", "dropout_p", "is_causal",
        "return_debug_mask", "scale",
    },
    "_scaled_dot_product_cudnn_attention_backward": {
        "grad_out", "query", "key", "value", "out", "logsumexp", "philox_seed", "philox_offset",
        "attn_bias", "cum_seq_q", "cum_seq_k", "max_q", "max_k", "dropout_p", "is_causal",
        "scale",
    },
    "_flash_attention_forward": {
        "query", "key", "value", "cum_seq_q", "cum_seq_k", "max_q", "max_k", "dropout_p",
        "is_causal", "return_debug_mask", "scale",
    },
    "_flash_attention_backward": {
        "grad_out", "query", "key", "value", "out", "logsumexp", "cum_seq_q", "cum_seq_k",
        "max_q", "max_k", "dropout_p", "is_causal", "rng_state", "unused", "scale",
    },
}  # fmt: skip


class _Recorder:
    """Stands in for ``torch.ops.aten.<name>``: binds every call to the schema, then runs it."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.op = getattr(torch.ops.aten, name).default
        self.calls: list[dict[str, Any]] = []

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        schema = self.op._schema
        positional = [a.name for a in schema.arguments if not a.kwarg_only]
        assert len(args) <= len(positional), f"{self.name}: too many positional arguments"
        bound = dict(zip(positional, args, strict=False))
        names = {a.name for a in schema.arguments}
        for key in kwargs:
            assert key in names, f"{self.name} has no argument {key!r}"
            assert key not in bound, f"{self.name}: {key!r} given twice"
        bound.update(kwargs)
        unused = set(bound) - USED[self.name]
        assert not unused, f"{self.name}: arguments outside the 2.11-2.13 subset: {unused}"
        required = {a.name for a in schema.arguments if not a.has_default_value()}
        assert required <= set(bound), f"{self.name}: missing {required - set(bound)}"
        self.calls.append(bound)
        return self.op(*args, **kwargs)


@pytest.fixture
def rec(monkeypatch: pytest.MonkeyPatch) -> dict[str, _Recorder]:
    recs = {name: _Recorder(name) for name in USED}
    for name, r in recs.items():
        monkeypatch.setattr(torch.ops.aten, name, r)
    return recs


def _meta(*shape: int, dtype: torch.dtype = BF16) -> torch.Tensor:
    return torch.empty(*shape, dtype=dtype, device="meta")


@pytest.mark.parametrize("is_causal", [True, False])
def test_flash_calls_bind_to_schema(rec: dict[str, _Recorder], is_causal: bool) -> None:
    q, k = _meta(2, 4, 10, 12), _meta(2, 2, 10, 12)  # GQA, head dim padded 12 -> 16
    out, lse = ck.flash_forward(q, k, k, is_causal=is_causal, scale=0.3)
    ck.flash_backward(q, q, k, k, out, lse, is_causal=is_causal, scale=0.3)
    (f,) = rec["_scaled_dot_product_flash_attention"].calls
    assert (f["dropout_p"], f["is_causal"], f["return_debug_mask"]) == (0.0, is_causal, False)
    assert f["scale"] == 0.3  # explicit: the padded head dim must not change the scale
    assert f["key"].shape == (2, 2, 10, 16)  # K/V keep Hkv heads (flash takes GQA natively)
    (b,) = rec["_scaled_dot_product_flash_attention_backward"].calls
    assert b["cum_seq_q"] is None  # undefined -> the dense (not varlen) backward
    assert (b["max_q"], b["max_k"], b["dropout_p"], b["is_causal"]) == (10, 10, 0.0, is_causal)
    assert b["logsumexp"].shape == (2, 4, 10)
    assert b["logsumexp"].dtype == FP32
    assert b["logsumexp"].is_contiguous()
    assert b["grad_out"].dtype == b["out"].dtype == BF16  # flash checks both against q's
    assert b["scale"] == 0.3


@pytest.mark.parametrize("dtype", [FP32, BF16])
def test_efficient_calls_bind_to_schema(rec: dict[str, _Recorder], dtype: torch.dtype) -> None:
    q, k = _meta(2, 4, 40, 12, dtype=dtype), _meta(2, 2, 56, 12, dtype=dtype)
    mask = torch.empty(1, 40, 56, dtype=torch.bool, device="meta")
    out, lse = ck.efficient_forward(q, k, k, mask, is_causal=False, scale=0.3)
    ck.efficient_backward(q, q, k, k, out, lse, mask, is_causal=False, scale=0.3)
    fwd = rec["_scaled_dot_product_efficient_attention"].calls
    bwd = rec["_scaled_dot_product_efficient_attention_backward"].calls
    assert len(fwd) == len(bwd) == 2  # one call per query group, K/V never repeated
    for f in fwd:
        assert f["compute_log_sumexp"] is True
        assert (f["dropout_p"], f["is_causal"], f["scale"]) == (0.0, False, 0.3)
        assert f["query"].shape == (*f["key"].shape[:2], 40, 16)  # equal head counts
        bias = f["attn_bias"]
        assert bias.shape == (2, 2, 40, 56)
        assert bias.dtype == dtype  # the kernel checks the bias dtype against q's
        assert bias.stride(-1) == 1
        assert bias.stride(-2) % ck.BIAS_ALIGN == 0
    for b in bwd:
        # The kernel derives the output's row stride as H * D: out (and grad_out) must be
        # [B, L, H, D]-contiguous once the op transposes them.
        assert b["out"].transpose(1, 2).is_contiguous()
        assert b["grad_out_"].transpose(1, 2).is_contiguous()
        lse_b = b["logsumexp"]
        assert lse_b.shape == (2, 2, 64)  # the forward's 32-padding, restored
        assert lse_b.dtype == FP32
        assert lse_b.stride(-1) == 1
        assert b["grad_input_mask"] == [True, True, True, False]
        assert (b["dropout_p"], b["is_causal"], b["scale"]) == (0.0, False, 0.3)
        assert b["philox_seed"].dtype == b["philox_offset"].dtype == torch.int64


def test_cudnn_calls_bind_to_schema(rec: dict[str, _Recorder]) -> None:
    q, k = _meta(2, 4, 10, 64), _meta(2, 2, 10, 64)
    out, lse = ck.cudnn_forward(q, k, k, is_causal=True, scale=0.3)
    ck.cudnn_backward(q, q, k, k, out, lse, is_causal=True, scale=0.3)
    for f in rec["_scaled_dot_product_cudnn_attention"].calls:
        assert f["attn_bias"] is None
        assert (f["compute_log_sumexp"], f["dropout_p"], f["is_causal"]) == (True, 0.0, True)
        assert f["return_debug_mask"] is False
    for b in rec["_scaled_dot_product_cudnn_attention_backward"].calls:
        assert b["attn_bias"] is None
        assert b["cum_seq_q"] is None  # undefined -> the dense (not nested) backward
        assert (b["max_q"], b["max_k"], b["dropout_p"], b["is_causal"]) == (10, 10, 0.0, True)
        assert b["logsumexp"].shape == (2, 2, 10, 1)


def test_varlen_calls_bind_to_schema(rec: dict[str, _Recorder]) -> None:
    q, k = _meta(30, 4, 72), _meta(40, 2, 72)
    cu = torch.empty(4, dtype=torch.int32, device="meta")
    out, lse = vk.flash_varlen_forward(q, k, k, cu, cu, 16, 20, causal=True, scale=0.3)
    vk.flash_varlen_backward(q, q, k, k, out, lse, cu, cu, 16, 20, causal=True, scale=0.3)
    (f,) = rec["_flash_attention_forward"].calls
    assert f["cum_seq_q"] is cu
    assert (f["max_q"], f["max_k"], f["dropout_p"]) == (16, 20, 0.0)
    assert (f["is_causal"], f["return_debug_mask"], f["scale"]) == (True, False, 0.3)
    (b,) = rec["_flash_attention_backward"].calls
    assert b["logsumexp"].shape == (4, 30)
    assert b["logsumexp"].is_contiguous()
    assert (b["max_q"], b["max_k"], b["dropout_p"], b["is_causal"]) == (16, 20, 0.0, True)
    assert b["rng_state"].dtype == torch.uint64


def test_varlen_single_query_runs_keep_a_bound_of_two(rec: dict[str, _Recorder]) -> None:
    """max_q == 1 with GQA takes flash's reshape to [n_runs, ...], which an empty run breaks."""
    q, k = _meta(2, 4, 64), _meta(9, 2, 64)  # 3 runs: 1, 0 and 1 queries
    cu_q = torch.empty(4, dtype=torch.int32, device="meta")
    vk.flash_varlen_forward(q, k, k, cu_q, cu_q, 1, 5, causal=True, scale=0.3)
    assert rec["_flash_attention_forward"].calls[0]["max_q"] == 2
    assert [vk.varlen_max_q_bound(m) for m in (0, 1, 2, 7)] == [2, 2, 2, 7]


def test_unexpected_lse_layout_raises(monkeypatch: pytest.MonkeyPatch) -> None:
    """A torch whose varlen op returned a padded per-run LSE would misalign every merge: raise."""
    real = torch.ops.aten._flash_attention_forward

    def padded(*args: Any, **kwargs: Any) -> Any:
        res = real(*args, **kwargs)
        n, h = args[3].numel() - 1, args[0].shape[1]
        return (res[0], torch.empty(n, h, args[5], device="meta"), *res[2:])

    monkeypatch.setattr(torch.ops.aten, "_flash_attention_forward", padded)
    q, k = _meta(30, 4, 64), _meta(40, 2, 64)
    cu = torch.empty(4, dtype=torch.int32, device="meta")
    with pytest.raises(
        RuntimeError, match=r"log-sum-exp of shape \(3, 4, 16\), expected \(4, 30\)"
    ):
        vk.flash_varlen_forward(q, k, k, cu, cu, 16, 20, causal=True, scale=0.3)


def test_lse_rows_accepts_padding_only_where_allowed() -> None:
    lse = _meta(2, 3, 64, dtype=FP32)
    assert ck._lse_rows(lse, (2, 3), 40, "op").shape == (2, 3, 40)
    with pytest.raises(RuntimeError, match="expected"):
        ck._lse_rows(lse, (2, 3), 40, "op", exact=True)
    with pytest.raises(RuntimeError, match="expected"):
        ck._lse_rows(lse, (2, 4), 40, "op")
    with pytest.raises(RuntimeError, match="expected"):
        ck._lse_rows(lse, (2, 3), 65, "op")
