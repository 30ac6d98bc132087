"""CP-correct losses: per-rank shares add up to the single-process mean, values and gradients."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.testing import assert_close

from cpshard.layouts.closed_form import RoundRobinLayout
from cpshard.loss import (
    count_tokens,
    cp_cross_entropy,
    cp_loss_scale,
    cp_token_mean,
    reduce_for_logging,
)


def _split(t: torch.Tensor, world: int) -> list[torch.Tensor]:
    rank_map = RoundRobinLayout().rank_map(world, t.shape[1])
    return [t.index_select(1, rank_map[r]) for r in range(world)]


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_cross_entropy_shares_sum_to_global_mean(world: int) -> None:
    g = torch.Generator().manual_seed(0)
    s = 24
    logits = torch.randn(2, s, 11, generator=g, dtype=torch.float64, requires_grad=True)
    labels = torch.randint(0, 11, (2, s), generator=g)
    labels[0, :7] = -100  # uneven supervision across ranks
    ref = F.cross_entropy(logits.reshape(-1, 11), labels.reshape(-1), ignore_index=-100)
    (g_ref,) = torch.autograd.grad(ref, logits)
    n = count_tokens(labels)
    parts = [
        cp_cross_entropy(lg, lb, num_tokens=n)
        for lg, lb in zip(_split(logits, world), _split(labels, world), strict=True)
    ]
    total = torch.stack(parts).sum()
    assert_close(total, ref.float(), rtol=1e-6, atol=1e-6)
    (g_cp,) = torch.autograd.grad(total, logits)
    assert_close(g_cp, g_ref, rtol=1e-5, atol=1e-7)


def test_token_mean_and_scale() -> None:
    v = torch.arange(8.0).reshape(2, 4)
    m = torch.tensor([[1, 1, 0, 0], [1, 0, 0, 1]])
    assert float(cp_token_mean(v, m, num_tokens=4)) == pytest.approx((0 + 1 + 4 + 7) / 4)
    assert float(cp_token_mean(v, m, num_tokens=4, scale=2.0)) == pytest.approx(6.0)
    assert float(cp_token_mean(v, m * 0, num_tokens=0)) == 0.0
    assert cp_loss_scale(None, "mean") == 1.0
    assert cp_loss_scale(None) == 1.0


def test_logging_reduce_without_cp_is_a_detached_copy() -> None:
    x = torch.tensor(3.0, requires_grad=True)
    y = reduce_for_logging(x * 2, None)
    assert float(y) == 6.0
    assert not y.requires_grad


def test_loss_errors() -> None:
    with pytest.raises(ValueError, match="grad_reduction must be 'sum' or 'mean'"):
        cp_loss_scale(None, "avg")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="num_tokens must be >= 0"):
        cp_token_mean(torch.ones(2), torch.ones(2), num_tokens=-1)
    with pytest.raises(ValueError, match="same shape"):
        cp_token_mean(torch.ones(2), torch.ones(3), num_tokens=1)
    with pytest.raises(ValueError, match=r"must be labels \(2, 3\) \+ \[V\]"):
        cp_cross_entropy(torch.ones(2, 4, 5), torch.zeros(2, 3, dtype=torch.long), num_tokens=1)
