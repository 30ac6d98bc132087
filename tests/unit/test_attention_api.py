"""cp_sdpa / cp_attention / cp_attention_context / HF integration without a process group."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F

import cpshard
from _attention_common import inputs, make_case, make_meta, reference
from cpshard.attention import cp_attention, cp_attention_context, cp_sdpa, use_cp_attention
from cpshard.attention.hf import cpshard_attention_forward
from cpshard.names import METHOD_NAMES
from cpshard.sharding.meta import TokenMeta


def _meta(seq_len: int = 8, n_docs: int = 2, world: int = 1, rank: int = 0) -> TokenMeta:
    rmap, docs = make_case("contiguous", world, seq_len, 1, n_docs, 0, 1)
    return make_meta(rmap, docs, rank)


def _qkv(n: int = 8, hq: int = 4, hkv: int = 2) -> tuple[torch.Tensor, ...]:
    q, k, v, _ = inputs(1, hq, hkv, n, 8, 0)
    return q, k, v


@dataclass
class _Sharder:
    cp_mesh: None
    token_meta: TokenMeta | None


def test_local_path_applies_document_mask_and_scale() -> None:
    meta = _meta()
    q, k, v = _qkv()
    for method in METHOD_NAMES:
        out = cp_sdpa(q, k, v, group=None, meta=meta, method=method, scale=0.2)
        torch.testing.assert_close(out, reference(q, k, v, meta.document_ids, True, 0.2))
    out = cp_attention(q, k, v, sharder=_Sharder(None, meta), causal=False)
    torch.testing.assert_close(out, reference(q, k, v, meta.document_ids, False))


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"method": "flash"}, r"unknown CP attention method 'flash'; valid methods are all_gather"),
        ({"q": torch.zeros(4, 8, 8)}, r"needs q as \[B, H, L, D\], got shape \(4, 8, 8\)"),
        ({"k": torch.zeros(1, 3, 8, 8, dtype=torch.float64)}, r"k and v must agree on batch"),
        ({"v": torch.zeros(1, 2, 8, 8)}, r"must share a dtype"),
        (
            {"q": torch.zeros(1, 3, 8, 8, dtype=torch.float64)},
            r"multiple of key/value.*Hq=3, Hkv=2",
        ),
        ({"q": torch.zeros(1, 4, 6, 8, dtype=torch.float64)}, r"meta.local_len=8, got q L=6"),
        ({"q": torch.zeros(1, 4, 8, 4, dtype=torch.float64)}, r"agree on batch and head_dim"),
        ({"meta": _meta(world=2, seq_len=16)}, r"meta is for rank 0 of 2 but the process group"),
        ({"q": torch.zeros(1, 4, 8, 8, dtype=torch.long)}, r"floating-point inputs"),
    ],
)
def test_cp_sdpa_errors(kwargs: dict, match: str) -> None:
    q, k, v = _qkv()
    args = {"q": q, "k": k, "v": v, "meta": _meta(), "method": "ring"} | kwargs
    with pytest.raises(ValueError, match=match):
        cp_sdpa(args.pop("q"), args.pop("k"), args.pop("v"), group=None, **args)


def test_meta_batch_must_broadcast() -> None:
    q, k, v = (t.expand(3, -1, -1, -1) for t in _qkv())
    m = _meta()
    meta = TokenMeta(0, 1, m.positions.expand(2, -1), m.document_ids.expand(2, -1))
    with pytest.raises(ValueError, match=r"meta batch dim must be 1 or B=3, got 2"):
        cp_sdpa(q, k, v, group=None, meta=meta)


def test_cp_attention_without_token_meta_raises() -> None:
    q, k, v = _qkv()
    with pytest.raises(ValueError, match=r"sharder.token_meta, which is None"):
        cp_attention(q, k, v, sharder=_Sharder(None, None))


def _module_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **kw: object) -> torch.Tensor:
    return F.scaled_dot_product_attention(q, k, v, **kw)  # type: ignore[arg-type]


def test_context_routes_matching_sdpa_and_passes_others_through() -> None:
    meta = _meta()  # two documents: routed calls are document-masked
    q, k, v = _qkv(hq=2, hkv=2)
    plain = _module_sdpa(q, k, v, is_causal=True)
    with cp_attention_context(None, meta, "ring"):
        routed = _module_sdpa(q, k, v, is_causal=True)
        routed_pos = F.scaled_dot_product_attention(q, k, v, None, 0.0, True)
        other = _module_sdpa(q[:, :, :5], k[:, :, :5], v[:, :, :5], is_causal=True)
    want = reference(q, k, v, meta.document_ids, True)
    torch.testing.assert_close(routed, want)
    torch.testing.assert_close(routed_pos, want)
    assert not torch.allclose(routed, plain)
    torch.testing.assert_close(other, plain[:, :, :5])  # another length: untouched
    # the mode is scoped: outside the context SDPA is plain again
    torch.testing.assert_close(_module_sdpa(q, k, v, is_causal=True), plain)


def test_context_backward_runs_outside_the_context() -> None:
    meta = _meta()
    q, k, v = (t.clone().requires_grad_() for t in _qkv(hq=2, hkv=2))
    with cp_attention_context(None, meta, "all_gather"):
        out = _module_sdpa(q, k, v, is_causal=True)
    out.sum().backward()
    q2, k2, v2 = (t.detach().clone().requires_grad_() for t in (q, k, v))
    reference(q2, k2, v2, meta.document_ids, True).sum().backward()
    for a, b in ((q, q2), (k, k2), (v, v2)):
        torch.testing.assert_close(a.grad, b.grad)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"attn_mask": torch.ones(8, 8, dtype=torch.bool)}, r"explicit attn_mask inside"),
        ({"dropout_p": 0.1}, r"does not support dropout, got dropout_p=0.1"),
        ({"gqa": True}, r"pass enable_gqa=True for GQA"),
    ],
)
def test_context_errors(kwargs: dict, match: str) -> None:
    q, k, v = _qkv(hq=4, hkv=2 if kwargs.pop("gqa", False) else 4)
    causal = "attn_mask" not in kwargs  # unmasked non-causal calls are not routed (local)
    with cp_attention_context(None, _meta(), "ring"), pytest.raises(ValueError, match=match):
        _module_sdpa(q, k, v, is_causal=causal, **kwargs)


def test_context_rejects_unknown_method_before_running() -> None:
    with pytest.raises(ValueError, match=r"unknown CP attention method 'x'"):
        cp_attention_context(None, _meta(), "x")


class _Attn(torch.nn.Module):
    is_causal = True
    num_key_value_groups = 2  # as on HF attention modules (Hq=4, Hkv=2 in these tests)


def test_hf_function_is_plain_sdpa_outside_the_context_and_validates() -> None:
    q, k, v = _qkv()
    out, weights = cpshard_attention_forward(_Attn(), q, k, v, None, scaling=0.3)
    want = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=0.3, enable_gqa=True)
    assert weights is None
    torch.testing.assert_close(out, want.transpose(1, 2))
    plain = out
    # outside a CP context a mask is honoured (HF's sdpa semantics: the model may run without CP)
    keep = torch.ones(1, 1, 8, 8, dtype=torch.bool).tril()
    keep[..., :3] = False
    keep[..., :3, :3] = torch.eye(3, dtype=torch.bool)
    out, _ = cpshard_attention_forward(_Attn(), q, k, v, keep, scaling=0.3)
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=keep, scale=0.3, enable_gqa=True)
    torch.testing.assert_close(out, want.transpose(1, 2))
    # inside it, masks come from the token meta: a mask the module made itself is rejected,
    # naming the module; an all-ones 2-D keep-mask (BioGPT builds one) is no mask; no dropout
    with cp_attention_context(None, _meta(), "all_gather"):
        with pytest.raises(
            ValueError, match=r"_Attn computed its own attention mask \(shape \(1, 1, 8, 8\)\)"
        ):
            cpshard_attention_forward(_Attn(), q, k, v, keep)
        ones, _ = cpshard_attention_forward(_Attn(), q, k, v, torch.ones(1, 8), scaling=0.3)
        nothing, _ = cpshard_attention_forward(_Attn(), q, k, v, None, scaling=0.3)
        torch.testing.assert_close(ones, nothing)
        with pytest.raises(ValueError, match=r"does not support dropout, got dropout=0.1 in train"):
            cpshard_attention_forward(_Attn(), q, k, v, None, dropout=0.1)
        cpshard_attention_forward(_Attn().eval(), q, k, v, None, dropout=0.1)  # eval: ignored
    # outside it, dropout is transformers' sdpa dropout (random, so the output differs)
    torch.manual_seed(0)
    dropped, _ = cpshard_attention_forward(_Attn(), q, k, v, None, dropout=0.5)
    assert not torch.allclose(dropped, plain)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"position_bias": torch.zeros(4)}, "_Attn passed position_bias=.*does not know"),
        ({"head_mask": torch.ones(4)}, "_Attn passed head_mask=.*refuses it"),
        ({"s_aux": torch.zeros(3)}, r"sinks must have shape \[Hq\]=\(4,\)"),
        ({"sliding_window": 0}, "sliding_window must be a positive int"),
        ({"sliding_window": 3, "is_causal": False}, "needs causal attention"),
        ({"softcap": -1.0}, "softcap must be a positive finite number"),
    ],
)
def test_hf_function_rejects_kwargs_it_cannot_honour_under_cp(kwargs: dict, match: str) -> None:
    q, k, v = _qkv()
    with cp_attention_context(None, _meta(), "ring"), pytest.raises(ValueError, match=match):
        cpshard_attention_forward(_Attn().eval(), q, k, v, None, **kwargs)


def test_hf_function_honours_window_and_softcap_under_cp() -> None:
    q, k, v = _qkv()
    meta = _meta(n_docs=1)
    with cp_attention_context(None, meta, "all_gather"):
        out, _ = cpshard_attention_forward(
            _Attn().eval(), q, k, v, None, scaling=0.3, sliding_window=2, softcap=0.5
        )
    want = cp_sdpa(q, k, v, group=None, meta=meta, scale=0.3, window=2, softcap=0.5)
    torch.testing.assert_close(out, want.transpose(1, 2))
    docs = meta.document_ids
    ref = reference(q, k, v, docs, True, scale=0.3, window=2, softcap=0.5)
    torch.testing.assert_close(out, ref.transpose(1, 2))


def test_use_cp_attention_registers_and_selects_the_name() -> None:
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(
        vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=2, use_cache=False,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg)
    ids = torch.randint(0, 128, (2, 8))
    want = model(input_ids=ids).logits  # stock "sdpa"
    use_cp_attention(model)
    use_cp_attention(model)
    assert model.config._attn_implementation == "cpshard"
    assert transformers.AttentionInterface()["cpshard"] is cpshard_attention_forward
    # outside cp_attention_context the registered function is plain local causal attention
    torch.testing.assert_close(model(input_ids=ids).logits, want)
    with pytest.raises(TypeError, match=r"needs a transformers model"):
        use_cp_attention(torch.nn.Linear(2, 2))


def test_hf_model_outside_the_context_honours_attention_mask() -> None:
    """After prepare_cp_forward the model still runs without CP (eval, generation): padding given
    as attention_mask must not be dropped."""
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(
        vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=2, use_cache=False,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).double()
    ids = torch.randint(1, 128, (2, 8))
    mask = torch.ones(2, 8, dtype=torch.long)
    mask[0, :3] = 0  # left padding
    mask[1, 6:] = 0  # right padding
    want = model(input_ids=ids, attention_mask=mask).logits  # stock "sdpa"
    ctx, local, _ = cpshard.prepare_cp_forward(
        model, None, {"input_ids": ids, "attention_mask": mask}
    )
    assert model.config._attn_implementation == "sdpa"  # cpshard attention only inside ctx()
    real = mask.bool()
    got = model(input_ids=ids, attention_mask=mask).logits
    torch.testing.assert_close(got[real], want[real])
    with ctx():  # under the context the padding comes from the sharded batch
        cp = model(input_ids=local["input_ids"], position_ids=local["position_ids"]).logits
    torch.testing.assert_close(cp[real], want[real])


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("method", METHOD_NAMES)
def test_low_precision_matches_fp32_reference(dtype: torch.dtype, method: str) -> None:
    meta = _meta(seq_len=12, n_docs=2)
    q, k, v = (t.float() for t in _qkv(n=12, hq=4, hkv=2))
    ql, kl, vl = (t.to(dtype).requires_grad_() for t in (q, k, v))
    out = cp_sdpa(ql, kl, vl, group=None, meta=meta, method=method, causal=True)
    assert out.dtype == dtype
    g = torch.randn_like(q)
    out.backward(g.to(dtype))
    q32, k32, v32 = (t.to(dtype).float().requires_grad_() for t in (q, k, v))
    want = reference(q32, k32, v32, meta.document_ids, True)
    want.backward(g.to(dtype).float())
    tol = {"atol": 2e-2, "rtol": 2e-2}
    torch.testing.assert_close(out.float(), want.float(), **tol)
    for a, b in ((ql, q32), (kl, k32), (vl, v32)):
        assert a.grad is not None and a.grad.dtype == dtype
        assert b.grad is not None
        torch.testing.assert_close(a.grad.float(), b.grad.float(), **tol)
