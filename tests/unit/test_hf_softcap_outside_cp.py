"""A Gemma 2 prepared for CP keeps its score soft-capping outside ctx() (eval, generation).

transformers 5.17's sdpa function ignores ``softcap`` (5.25's raises), so the "cpshard" attention
runs soft-capped layers as explicit math outside a CP context. The reference is HF's eager
attention, chosen explicitly, so it does not change with the transformers release.
"""

from __future__ import annotations

import pytest
import torch
from torch.testing import assert_close

from cpshard.attention import use_cp_attention
from cpshard.attention.softcap import softcap_masked_attention

tf = pytest.importorskip("transformers")

# fp32 models: HF's eager attention adds the fp64 dtype minimum to masked scores, then runs its
# softmax in fp32, where that is -inf: fully masked rows (window over pads) turn NaN in fp64.
TOL = {"rtol": 1e-4, "atol": 1e-5}


def _gemma2(cap: float | None, dropout: float = 0.0) -> torch.nn.Module:
    cfg = tf.Gemma2Config(
        vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, sliding_window=3,
        attn_logit_softcapping=cap, initializer_range=0.5, use_cache=False,
        attention_dropout=dropout,
    )  # fmt: skip
    torch.manual_seed(0)
    return tf.Gemma2ForCausalLM(cfg)


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(1, 128, (2, 9), generator=torch.Generator().manual_seed(3))
    mask = torch.ones_like(ids)
    mask[0, :3] = 0  # left padding on one row
    return ids.masked_fill(mask == 0, 0), mask


def _logits_and_grads(model: torch.nn.Module) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    ids, mask = _batch()
    logits = model(input_ids=ids, attention_mask=mask).logits
    logits[mask.bool()].pow(2).mean().backward()
    return logits.detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


def test_prepared_gemma2_matches_eager_outside_ctx() -> None:
    ref = _gemma2(2.0)
    ref.set_attn_implementation("eager")
    want, want_grads = _logits_and_grads(ref)
    model = _gemma2(2.0)
    use_cp_attention(model)
    got, grads = _logits_and_grads(model)
    real = _batch()[1].bool()
    assert_close(got[real], want[real], **TOL)
    assert grads.keys() == want_grads.keys()
    for name, g in want_grads.items():
        assert_close(grads[name], g, **TOL, msg=lambda m, n=name: f"{n}: {m}")
    uncapped = _gemma2(None)
    uncapped.set_attn_implementation("eager")
    plain, _ = _logits_and_grads(uncapped)
    assert (plain[real] - want[real]).abs().max() > 1e-2  # the cap matters in this model


def test_dropout_in_training_raises_outside_ctx() -> None:
    model = _gemma2(2.0, dropout=0.1)
    use_cp_attention(model)
    model.train()
    ids, mask = _batch()
    with pytest.raises(ValueError, match="without dropout"):
        model(input_ids=ids, attention_mask=mask)


def _dense_reference(q, k, v, visible, scale, cap):  # type: ignore[no-untyped-def]
    g = q.shape[1] // k.shape[1]
    s = (q @ k.repeat_interleave(g, 1).transpose(-1, -2)) * scale
    s = cap * torch.tanh(s / cap)
    s = s.masked_fill(~visible, float("-inf"))
    return torch.softmax(s, -1).nan_to_num(0.0) @ v.repeat_interleave(g, 1)


@pytest.mark.parametrize("kind", ["bool", "additive", "causal", "none"])
def test_masked_softcap_matches_dense(kind: str) -> None:
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 5, 8, generator=gen, dtype=torch.float64, requires_grad=True)
    k, v = (torch.randn(2, 2, 5, 8, generator=gen, dtype=torch.float64) for _ in range(2))
    visible = torch.rand(2, 1, 5, 5, generator=gen) > 0.4
    visible[1, 0, 2] = False  # a query that sees nothing: zeros, finite gradients
    mask: torch.Tensor | None = {
        "bool": visible,
        "additive": torch.zeros(visible.shape, dtype=torch.float64).masked_fill(
            ~visible, torch.finfo(torch.float64).min
        ),
        "causal": None,
        "none": None,
    }[kind]
    if kind == "causal":
        visible = torch.ones(5, 5, dtype=torch.bool).tril().expand(2, 1, 5, 5)
    if kind == "none":
        visible = torch.ones(2, 1, 5, 5, dtype=torch.bool)
    got = softcap_masked_attention(
        q, k, v, mask, is_causal=kind == "causal", scale=0.4, softcap=1.5
    )
    want = _dense_reference(q, k, v, visible, 0.4, 1.5)
    assert_close(got, want)
    (gq,) = torch.autograd.grad(got.sum(), q)
    (wq,) = torch.autograd.grad(want.sum(), q)
    assert torch.isfinite(gq).all()
    assert_close(gq, wq.nan_to_num(0.0))


def test_masked_softcap_refuses_a_bias() -> None:
    q = torch.randn(1, 2, 3, 4)
    bias = torch.full((1, 1, 3, 3), 0.5)
    with pytest.raises(ValueError, match="adds other values"):
        softcap_masked_attention(
            q, q[:, :1], q[:, :1], bias, is_causal=False, scale=1.0, softcap=2.0
        )
