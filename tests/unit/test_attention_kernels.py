"""The local block kernel, without a process group."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from cpshard.attention.kernels import block_attention, block_attention_backward

BACKENDS = ("cpu_flash", "math")


def _qkv(dtype: torch.dtype = torch.float64) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 6, 8, generator=g, dtype=dtype)
    k = torch.randn(2, 2, 7, 8, generator=g, dtype=dtype)
    v = torch.randn(2, 2, 7, 8, generator=g, dtype=dtype)
    return q, k, v


@pytest.mark.parametrize("backend", BACKENDS)
def test_block_matches_sdpa_with_fully_masked_rows(backend: str) -> None:
    q, k, v = _qkv()
    mask = torch.rand(1, 6, 7, generator=torch.Generator().manual_seed(3)) > 0.4
    mask[0, 2] = False  # a query that sees nothing in this block
    mask[0, 0, 0] = True
    out, lse = block_attention(q, k, v, mask=mask, is_causal=False, scale=0.3, backend=backend)  # type: ignore[arg-type]
    ref = F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask[:, None], scale=0.3, enable_gqa=True
    )
    keep = mask.any(-1)[0]
    torch.testing.assert_close(out[:, :, keep], ref[:, :, keep])
    assert torch.isneginf(lse[:, :, 2]).all()  # the op alone reports 0 here
    assert torch.equal(out[:, :, 2], torch.zeros_like(out[:, :, 2]))
    s = (q @ k.repeat_interleave(2, 1).transpose(-1, -2)) * 0.3
    want = torch.logsumexp(s.masked_fill(~mask[:, None], float("-inf")), -1)
    torch.testing.assert_close(lse[:, :, keep], want[:, :, keep])


@pytest.mark.parametrize("backend", BACKENDS)
def test_block_backward_matches_autograd(backend: str) -> None:
    q, k, v = (t.requires_grad_() for t in _qkv())
    k2, v2 = k[:, :, :6], v[:, :, :6]
    ref = F.scaled_dot_product_attention(q, k2, v2, is_causal=True, enable_gqa=True)
    go = torch.randn_like(ref)
    want = torch.autograd.grad(ref, (q, k, v), go)
    out, lse = block_attention(q, k2, v2, mask=None, is_causal=True, scale=8**-0.5, backend=backend)  # type: ignore[arg-type]
    torch.testing.assert_close(out, ref)
    dq, dk, dv = block_attention_backward(
        go, q.detach(), k2.detach(), v2.detach(), out, lse, mask=None, is_causal=True,
        scale=8**-0.5, backend=backend,  # type: ignore[arg-type]
    )  # fmt: skip
    torch.testing.assert_close(dq.double(), want[0])
    torch.testing.assert_close(dk.double(), want[1][:, :, :6])
    torch.testing.assert_close(dv.double(), want[2][:, :, :6])


def test_block_accepts_bf16_and_fp16() -> None:
    for dtype in (torch.bfloat16, torch.float16):
        q, k, v = _qkv(dtype)
        out, lse = block_attention(q, k, v, mask=None, is_causal=False, scale=0.35)
        ref = F.scaled_dot_product_attention(
            q.float(), k.float(), v.float(), scale=0.35, enable_gqa=True
        )
        assert out.dtype == dtype
        assert lse.dtype == torch.float32
        torch.testing.assert_close(out.float(), ref, atol=2e-2, rtol=2e-2)
