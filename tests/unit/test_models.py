"""The example plain-PyTorch model: RoPE follows position_ids, config validation."""

from __future__ import annotations

import pytest
import torch
from torch.testing import assert_close

from cpshard.models import TinyDecoder, TinyDecoderConfig


def test_rope_follows_global_positions() -> None:
    torch.manual_seed(0)
    model = TinyDecoder(TinyDecoderConfig(num_layers=1)).double()
    ids = torch.randint(0, 260, (1, 12))
    full = model(ids)
    # The first 5 tokens alone, with their global positions, match the full causal run.
    head = model(ids[:, :5], position_ids=torch.arange(5)[None])
    assert_close(head, full[:, :5])
    # Wrong positions change the result: RoPE reads position_ids (a uniform shift would not:
    # RoPE attention depends on relative positions only).
    jumped = model(ids[:, :5], position_ids=torch.tensor([[0, 1, 2, 3, 9]]))
    assert not torch.allclose(jumped[:, 4], full[:, 4])


def test_config_validation() -> None:
    with pytest.raises(ValueError, match="divisible by num_heads=3"):
        TinyDecoderConfig(hidden_size=64, num_heads=3)
    with pytest.raises(ValueError, match="divisible by num_kv_heads=3"):
        TinyDecoderConfig(num_heads=4, num_kv_heads=3)
