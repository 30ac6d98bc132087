"""CPSharder verbs and dispatch without a process group (cp_mesh=None: the identity layout)."""

from __future__ import annotations

import pytest
import torch

import cpshard


def _batch(s: int = 7) -> dict[str, torch.Tensor]:
    ids = torch.arange(2 * s).reshape(2, s)
    return {"input_ids": ids, "labels": cpshard.shift_labels(ids)}


def test_identity_dispatch_is_branch_free() -> None:
    batch = _batch()
    ctx, out, sharder = cpshard.make_cp_batch_and_ctx(None, batch)
    assert sharder.layout == "none" and sharder.cp_size == 1
    assert out["input_ids"] is batch["input_ids"]  # no copies at cp=1 without padding
    assert set(out) == {"input_ids", "labels", "position_ids"}  # same keys as at cp > 1
    assert sharder.original_seq_len == sharder.padded_seq_len == 7
    with ctx():
        pass
    adv = torch.randn(2, 7)
    local = sharder.shard_token_tensor(adv, fill=0.0)
    assert torch.equal(local, adv)
    assert torch.equal(sharder.gather_token_tensor(local, trim=True), adv)
    assert sharder.token_meta is not None and sharder.token_meta.local_len == 7


def test_identity_keeps_loss_mask_argument() -> None:
    lm = torch.ones(2, 7)
    _, out, _ = cpshard.make_cp_batch_and_ctx(None, _batch(), loss_mask=lm)
    assert out["loss_mask"] is lm


def test_verbs_errors() -> None:
    _, _, sharder = cpshard.make_cp_batch_and_ctx(None, _batch())
    x = torch.randn(2, 7)
    with pytest.raises(ValueError, match=r"seq_dim=2 is out of range for a 2-D tensor"):
        sharder.shard_token_tensor(x, seq_dim=2)
    with pytest.raises(ValueError, match=r"seq_dim=-3 is out of range"):
        sharder.gather_token_tensor(x, seq_dim=-3)
    with pytest.raises(ValueError, match=r"padded_seq_len=7.*length on dim 1 is 5"):
        sharder.shard_token_tensor(torch.randn(2, 5))
    with pytest.raises(ValueError, match="grad must be 'sum'.*got grad='mean'"):
        sharder.gather_token_tensor(x, grad="mean")
    with pytest.raises(ValueError, match="gathers to 5 tokens over 1 ranks.*padded_seq_len=7"):
        sharder.gather_token_tensor(torch.randn(2, 5))


def test_data_dependent_layout_before_first_shard_raises() -> None:
    sharder = cpshard.CPSharder(
        shard_batch=lambda *a, **k: (None, {}),  # type: ignore[arg-type,return-value]
        local_token_global_indices=None,
        layout="custom_packed",
    )
    with pytest.raises(ValueError, match="data-dependent.*before the first shard"):
        sharder.shard_token_tensor(torch.randn(1, 8))


def test_bad_mesh_and_names() -> None:
    with pytest.raises(TypeError, match="1-D torch DeviceMesh or None, got int"):
        cpshard.make_cp_batch_and_ctx(3, _batch())  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="layout must be one of"):
        cpshard.make_cp_batch_and_ctx(None, _batch(), layout="zigzag")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="attention must be one of"):
        cpshard.make_cp_batch_and_ctx(None, _batch(), attention="flash")
