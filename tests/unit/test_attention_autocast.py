"""CP attention under ``torch.autocast`` does what SDPA does (one process, every method).

Under CPU autocast SDPA casts q, k, v to the autocast dtype and answers in it (torch 2.13; HF
models hand it fp32 q/k after RoPE and a bf16 v); outside autocast it refuses mixed dtypes.
Tolerances: both sides compute in bf16 (8 bits of mantissa, unit roundoff 2^-8 ~ 3.9e-3) but
accumulate in different orders (SDPA's CPU flash kernel vs cpshard's blockwise kernels with an
fp32 merge), so they agree to a few bf16 ulps of values of order 1: atol = rtol = 2e-2.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.testing import assert_close

from _attention_common import inputs, make_case, make_meta
from cpshard.attention import cp_attention_context, cp_sdpa
from cpshard.attention.autocast import autocast_inputs, autocast_off
from cpshard.names import METHOD_NAMES

BF16_TOL = {"atol": 2e-2, "rtol": 2e-2}


def _mixed() -> tuple[torch.Tensor, ...]:
    """fp32 q/k and a bf16 v (an HF model under autocast), an fp32 upstream gradient."""
    q, k, v, go = inputs(2, 4, 2, 16, 8, 0)
    return q.float(), k.float(), v.bfloat16(), go.float()


def _meta() -> object:
    rmap, docs = make_case("contiguous", 1, 16, 1, 1, 0, 1)
    return make_meta(rmap, docs, 0)


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("method", METHOD_NAMES)
def test_autocast_casts_inputs_like_sdpa(method: str, dtype: torch.dtype) -> None:
    q, k, v, go = _mixed()
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    refs = [t.clone().requires_grad_() for t in (q, k, v)]
    with torch.autocast("cpu", dtype=dtype):
        out = cp_sdpa(*leaves, group=None, meta=_meta(), method=method)
        want = _sdpa(*refs)
    assert out.dtype == want.dtype == dtype  # the compute dtype, as SDPA answers
    assert_close(out.float(), want.float(), **BF16_TOL)
    (out.float() * go).sum().backward()
    (want.float() * go).sum().backward()
    for got, ref in zip(leaves, refs, strict=True):
        assert got.grad is not None and ref.grad is not None
        assert got.grad.dtype == ref.grad.dtype == got.dtype  # back through the casts
        assert_close(got.grad.float(), ref.grad.float(), **BF16_TOL)


@pytest.mark.parametrize("backend", ["math", "cpu_flash"])
@pytest.mark.parametrize("method", METHOD_NAMES)
def test_backward_inside_autocast_equals_outside(method: str, backend: str) -> None:
    """The methods' backward keeps its fp32 accumulation when backward() runs in autocast."""
    q, k, v, go = _mixed()
    grads = []
    for inside in (False, True):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = cp_sdpa(*leaves, group=None, meta=_meta(), method=method, backend=backend)
            if inside:
                (out.float() * go).sum().backward()
        if not inside:
            (out.float() * go).sum().backward()
        grads.append([t.grad for t in leaves])
    for outside, inside in zip(*grads, strict=True):
        assert torch.equal(outside, inside)


def test_sdpa_interception_under_autocast() -> None:
    """A plain model's SDPA call in ctx() under autocast: the same dtype and values as SDPA."""
    q, k, v, _ = _mixed()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want = _sdpa(q, k, v)
        with cp_attention_context(None, _meta(), "all_gather"):
            out = _sdpa(q, k, v)
    assert out.dtype == want.dtype == torch.bfloat16
    assert_close(out.float(), want.float(), **BF16_TOL)


def test_mixed_dtypes_outside_autocast_raise_like_sdpa() -> None:
    q, k, v, _ = _mixed()
    with pytest.raises(RuntimeError, match="same dtype"):
        _sdpa(q, k, v)
    with pytest.raises(ValueError, match=r"must share a dtype.*under torch.autocast"):
        cp_sdpa(q, k, v, group=None, meta=_meta())
    # fp64 is not autocast-eligible (autocast leaves it alone, as for SDPA): still mixed
    with torch.autocast("cpu", dtype=torch.bfloat16), pytest.raises(ValueError, match="share"):
        cp_sdpa(q.double(), k, v, group=None, meta=_meta())


def test_meta_tensors_have_no_autocast() -> None:
    """torch has no autocast state for ``meta`` (its query raises): left alone, not an error."""
    q, k, v = (t.to("meta") for t in _mixed()[:3])
    assert autocast_inputs(q, k, v) == (q, k, v)
    with torch.autocast("cpu", dtype=torch.bfloat16), autocast_off(q.device):
        pass


def test_hf_model_under_autocast_at_cp1() -> None:
    """cp=1 (prepare_cp_forward without a mesh): a tiny HF Llama under autocast, forward and
    backward, gives the stock model's logits and gradients within bf16 rounding (it raised
    "q, k, v must share a dtype" before: RoPE hands SDPA fp32 q/k and a bf16 v)."""
    transformers = pytest.importorskip("transformers")
    import cpshard

    cfg = transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, use_cache=False, attn_implementation="sdpa",
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg)
    ids = torch.randint(3, 64, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want = model(input_ids=ids).logits
    want.float().square().mean().backward()
    ref = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    ctx, local, _ = cpshard.prepare_cp_forward(model, None, {"input_ids": ids})
    with torch.autocast("cpu", dtype=torch.bfloat16), ctx():
        got = model(input_ids=local["input_ids"], position_ids=local["position_ids"]).logits
    got.float().square().mean().backward()
    assert got.dtype == want.dtype == torch.bfloat16
    assert_close(got.float(), want.float(), **BF16_TOL)
    for name, grad in ref.items():
        assert_close(dict(model.named_parameters())[name].grad, grad, **BF16_TOL, msg=name)
