"""CPSharder verbs and dispatch without a process group (cp_mesh=None: the identity layout)."""

from __future__ import annotations

import pytest
import torch

import cpshard
from cpshard.names import METHOD_NAMES, PACKED_LAYOUTS


def _batch(s: int = 7) -> dict[str, torch.Tensor]:
    ids = torch.arange(2 * s).reshape(2, s)
    return {"input_ids": ids, "labels": cpshard.shift_labels(ids)}


def test_identity_dispatch_is_branch_free() -> None:
    batch = _batch()
    ctx, out, sharder = cpshard.make_cp_batch_and_ctx(None, batch)
    assert sharder.layout == "none" and sharder.cp_size == 1
    assert out["input_ids"] is not batch["input_ids"]  # never shares memory, cp=1 too
    assert torch.equal(out["input_ids"], batch["input_ids"])
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
    assert out["loss_mask"] is not lm and torch.equal(out["loss_mask"], lm)


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


@pytest.mark.parametrize("layout", PACKED_LAYOUTS)
@pytest.mark.parametrize("method", METHOD_NAMES)
def test_packed_attention_without_mesh(layout: str, method: str) -> None:
    """cp_mesh=None: packed batches still get per-document causal attention (ctx() + SDPA and
    cp_attention), matching fp64 one-process attention forward and backward."""
    import torch.nn.functional as F

    from _attention_common import reference_with_grads
    from cpshard.attention import cp_attention
    from cpshard.layouts.documents import PackSpec
    from cpshard.sharding.meta import pad_document_ids

    seq_lens = [[3, 1], [], [2, 5]]  # an all-padding row and a row ending in padding
    spec = PackSpec.from_seq_lens(seq_lens, 8)
    g = torch.Generator().manual_seed(0)
    q, k, v, go = (torch.randn(3, 8, 2, 4, dtype=torch.float64, generator=g) for _ in range(4))
    docs = pad_document_ids(spec.document_ids(), spec.padding_mask())
    ref = reference_with_grads(*(t.transpose(1, 2) for t in (q, k, v, go)), docs, causal=True)
    real = ~spec.padding_mask()
    batch = {"input_ids": torch.zeros(3, 8, dtype=torch.long), "seq_lens": seq_lens}
    ctx, _, sh = cpshard.make_cp_batch_and_ctx(None, batch, layout=layout, attention=method)  # type: ignore[arg-type]
    for path in ("ctx", "cp_attention"):
        ql, kl, vl = (
            sh.shard_token_tensor(t, fill=0.0).transpose(1, 2).requires_grad_() for t in (q, k, v)
        )
        if path == "ctx":
            with ctx():
                o = F.scaled_dot_product_attention(ql, kl, vl, is_causal=True)
        else:
            o = cp_attention(ql, kl, vl, sharder=sh, method=method)
        (o * sh.shard_token_tensor(go, fill=0.0).transpose(1, 2)).sum().backward()
        for local, want in zip((o.detach(), ql.grad, kl.grad, vl.grad), ref, strict=True):
            assert local is not None
            full = sh.gather_token_tensor(local.transpose(1, 2), trim=True, fill=0.0)
            torch.testing.assert_close(full[real], want.transpose(1, 2)[real])
