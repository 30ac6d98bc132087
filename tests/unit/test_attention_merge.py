"""Online-softmax merge math against a full softmax."""

from __future__ import annotations

import torch

from cpshard.attention.merge import accumulation_dtype, empty_partial, merge, merge_into


def _partial(s: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention over one key block from scores ``[..., Lq, Lk]``; -inf rows allowed."""
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - torch.where(torch.isneginf(lse), 0.0, lse).unsqueeze(-1))
    return p @ v, lse


def test_merge_of_blocks_equals_full_softmax() -> None:
    g = torch.Generator().manual_seed(0)
    s = torch.randn(2, 3, 5, 12, generator=g, dtype=torch.float64) * 4
    v = torch.randn(2, 3, 12, 4, generator=g, dtype=torch.float64)
    s[..., 0, 4:] = float("-inf")  # row 0 sees only block 0
    want = torch.softmax(s, dim=-1) @ v
    out, lse = empty_partial((2, 3, 5, 4), torch.float64, v.device)
    for blk in (slice(0, 4), slice(4, 9), slice(9, 12)):
        o, l_ = _partial(s[..., blk], v[..., blk, :])
        out, lse = merge(out, lse, o, l_)
    torch.testing.assert_close(out, want)
    torch.testing.assert_close(lse, torch.logsumexp(s, dim=-1))


def test_merge_into_matches_merge_and_handles_empty_blocks_without_nan() -> None:
    g = torch.Generator().manual_seed(1)
    o_a = torch.randn(1, 2, 3, 4, generator=g)
    l_a = torch.randn(1, 2, 3, generator=g)
    o_b = torch.randn(1, 2, 3, 4, generator=g)
    l_b = torch.randn(1, 2, 3, generator=g)
    l_a[0, 0, 0] = float("-inf")  # A empty for one row
    l_a[0, 1, 1] = l_b[0, 1, 1] = float("-inf")  # both empty for another
    o_a[0, 1, 1] = o_b[0, 1, 1] = 0.0
    want_o, want_l = merge(o_a, l_a, o_b, l_b)
    acc_o, acc_l = o_a.clone(), l_a.clone()
    merge_into(acc_o, acc_l, o_b, l_b)
    torch.testing.assert_close(acc_o, want_o)
    torch.testing.assert_close(acc_l, want_l)
    assert not torch.isnan(want_o).any()
    torch.testing.assert_close(want_o[0, 0, 0], o_b[0, 0, 0])  # empty A gets weight 0
    assert torch.isneginf(want_l[0, 1, 1])
    assert torch.equal(want_o[0, 1, 1], torch.zeros(4))


def test_merge_is_stable_for_huge_logits() -> None:
    o = torch.ones(1, 1, 1, 2)
    big = torch.tensor([[[500.0]]])  # exp(500) overflows fp32: the naive form gives inf/nan
    assert torch.isinf(torch.exp(big)).all()
    out, lse = merge(o, big, 3 * o, big)
    torch.testing.assert_close(out, 2 * o, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(lse, big + 0.6931471805599453)


def test_bf16_partials_accumulate_in_fp32() -> None:
    assert accumulation_dtype(torch.bfloat16) == torch.float32
    assert accumulation_dtype(torch.float64) == torch.float64
    out, lse = merge(
        torch.ones(1, 1, 1, 2, dtype=torch.bfloat16),
        torch.zeros(1, 1, 1),
        torch.ones(1, 1, 1, 2, dtype=torch.bfloat16),
        torch.zeros(1, 1, 1),
    )
    assert out.dtype == torch.float32
    assert lse.dtype == torch.float32
