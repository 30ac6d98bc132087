"""The example plain-PyTorch model: RoPE follows position_ids, config validation."""

from __future__ import annotations

import pytest
import torch
from torch.testing import assert_close

import cpshard
from cpshard.loss import count_tokens, cp_cross_entropy
from cpshard.models import (
    GlobalPrefixConfig,
    GlobalPrefixDecoder,
    TinyDecoder,
    TinyDecoderConfig,
    TinyVLM,
    TinyVLMConfig,
    with_images,
)
from cpshard.models.global_prefix import global_prefix_mask


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


def _vlm_batch() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 259, (2, 21), generator=gen)
    ids[0, 2:6] = 259  # one image of 4 patches per row
    ids[1, 9:13] = 259
    return {
        "input_ids": ids,
        "pixel_values": torch.randn(2, 4, 16, generator=gen, dtype=torch.float64),
        "labels": cpshard.shift_labels(ids),
    }


def test_vlm_hook_path_matches_plain_forward_at_cp1() -> None:
    """The hook runs at cp=1: pixel_values are consumed, inputs_embeds are trainable."""
    ref = TinyVLM.from_config(seed=1).double()
    cp1 = TinyVLM.from_config(seed=1).double()
    batch = _vlm_batch()
    keep = {k: v.clone() for k, v in batch.items()}
    full = ref(batch["input_ids"], pixel_values=batch["pixel_values"])
    n = count_tokens(batch["labels"])
    cp_cross_entropy(full, batch["labels"], num_tokens=n).backward()
    ctx, local, sharder = cpshard.prepare_cp_forward(cp1, None, batch)
    assert "pixel_values" not in local and "input_ids" not in local
    assert local["inputs_embeds"].requires_grad
    with ctx():
        out = cp1(inputs_embeds=local["inputs_embeds"], position_ids=local["position_ids"])
    cp_cross_entropy(out, local["labels"], num_tokens=n).backward()
    assert_close(out, full)
    for (name, a), b in zip(ref.named_parameters(), cp1.parameters(), strict=True):
        assert a.grad is not None and b.grad is not None, name
        assert_close(b.grad, a.grad, msg=name)
    assert ref.vision.patch.weight.grad is not None
    assert float(ref.vision.patch.weight.grad.abs().sum()) > 0
    for k, v in keep.items():
        assert torch.equal(batch[k], v)
    assert sharder.layout == "none"


def test_vlm_errors() -> None:
    vlm = TinyVLM.from_config()
    batch = _vlm_batch()
    with pytest.raises(ValueError, match="give 4 image features but input_ids hold 8"):
        vlm(batch["input_ids"], pixel_values=batch["pixel_values"][:1].float())
    with pytest.raises(ValueError, match="no pixel_values were given"):
        vlm(batch["input_ids"])
    with pytest.raises(ValueError, match="folded them in"):
        vlm(inputs_embeds=torch.zeros(1, 3, 64), pixel_values=torch.zeros(1, 1, 16))
    with pytest.raises(ValueError, match="image_token_id=300 must be a token"):
        TinyVLMConfig(image_token_id=300)


def test_global_prefix_layout_and_cp1_path() -> None:
    cfg = GlobalPrefixConfig(num_global_tokens=3, block_size=4)
    model = GlobalPrefixDecoder.from_config(cfg, seed=2).double()
    ids = torch.randint(0, 259, (2, 13), generator=torch.Generator().manual_seed(0))
    full = model(ids)
    batch = {"input_ids": ids, "labels": cpshard.shift_labels(ids)}
    ctx, local, sharder = cpshard.prepare_cp_forward(model, None, batch)
    # each row: prefix (3) + body 10 padded to whole blocks of 4 -> 12; one [1, 2 * 15] stream
    assert local["input_ids"].shape == (1, 30)
    assert sharder.layout == "global_prefix" and sharder.padded_seq_len == 30
    pos = sharder.input_token_stream_positions
    assert pos is not None and pos[1, 0] == 15 and pos[1, 12] == 15 + 12
    assert int((~local["padding_mask"]).sum()) == ids.numel()
    with ctx():
        out = model(local["input_ids"], local["position_ids"])
    assert_close(sharder.gather_token_tensor(out, trim=True, fill=0.0), full)
    # the mask: block-local plus the prefix, causal
    mask = global_prefix_mask(torch.arange(9)[None], 2, 3)[0, 0]
    assert mask[7].tolist() == [True, True, False, False, False, True, True, True, False]
    assert mask[4].tolist()[:6] == [True, True, True, True, True, False]


def test_global_prefix_errors() -> None:
    model = GlobalPrefixDecoder.from_config(GlobalPrefixConfig(num_global_tokens=4))
    with pytest.raises(ValueError, match="no tokens after the num_global_tokens=4"):
        cpshard.prepare_cp_forward(model, None, {"input_ids": torch.zeros(1, 4, dtype=torch.long)})
    with pytest.raises(ValueError, match="position_ids must be 0..S-1"):
        cpshard.prepare_cp_forward(
            model,
            None,
            {"input_ids": torch.zeros(1, 8, dtype=torch.long), "position_ids": torch.ones(1, 8)},
        )
    with pytest.raises(ValueError, match="num_global_tokens and block_size must be >= 1"):
        GlobalPrefixConfig(block_size=0)
    left = torch.ones(1, 8, dtype=torch.long)
    left[0, 0] = 0
    with pytest.raises(ValueError, match="right-padded rows only"):
        cpshard.prepare_cp_forward(
            model, None, {"input_ids": torch.zeros(1, 8, dtype=torch.long), "attention_mask": left}
        )


def test_global_prefix_num_chunks_gives_whole_chunks_of_blocks() -> None:
    cfg = GlobalPrefixConfig(num_global_tokens=2, block_size=3)
    model = GlobalPrefixDecoder.from_config(cfg, seed=0).double()
    ids = torch.randint(0, 259, (1, 9), generator=torch.Generator().manual_seed(1))
    ctx, local, sharder = cpshard.prepare_cp_forward(model, None, {"input_ids": ids}, num_chunks=2)
    assert local["input_ids"].shape == (1, 2 + 12)  # body 7 -> a multiple of 3 * 2
    with ctx():
        out = model(local["input_ids"], local["position_ids"])
    assert_close(sharder.gather_token_tensor(out, trim=True, fill=0.0), model(ids))


def test_with_images_builds_a_vlm_batch() -> None:
    ids = torch.randint(0, 259, (2, 12), generator=torch.Generator().manual_seed(0))
    batch = with_images(ids, patches=3, start=2, seed=1)
    assert (batch["input_ids"][:, 2:5] == 259).all() and torch.equal(
        ids[:, 5:], batch["input_ids"][:, 5:]
    )
    assert batch["pixel_values"].shape == (2, 3, 16)
    assert (batch["labels"][:, 1:4] == -100).all() and torch.equal(batch["labels"][:, 4], ids[:, 5])
    out = TinyVLM.from_config()(batch["input_ids"], pixel_values=batch["pixel_values"])
    assert out.shape == (2, 12, 260)
    with pytest.raises(ValueError, match="S >= start \\+ patches \\+ 1 = 6"):
        with_images(ids[:, :5], patches=3, start=2)
