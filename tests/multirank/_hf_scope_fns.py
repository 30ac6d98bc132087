"""Rank functions: HF models keep their own attention outside ctx() (generation in between)."""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.testing import assert_close

import cpshard


def _tiny(impl: str) -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, attn_implementation=impl,
    )  # fmt: skip
    torch.manual_seed(0)
    return LlamaForCausalLM(cfg).double().eval()


def _generate(model: Any, prompt: torch.Tensor) -> torch.Tensor:
    out: torch.Tensor = model.generate(
        prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=4, do_sample=False,
        pad_token_id=0,
    )  # fmt: skip
    return out


def generation_between_cp_forwards(cp_mesh: DeviceMesh, impl: str) -> None:
    """generate (own attention) -> CP forward in ctx() -> generate -> CP forward: all exact."""
    ref = _tiny(impl)
    prompt = torch.randint(1, 64, (2, 5), generator=torch.Generator().manual_seed(1))
    want_tokens = _generate(ref, prompt)
    ids = torch.randint(1, 64, (1, 13), generator=torch.Generator().manual_seed(2))
    want_logits = ref(input_ids=ids).logits

    model = _tiny(impl)
    batch = {"input_ids": ids, "labels": cpshard.shift_labels(ids)}
    for _ in range(2):
        ctx, local, sharder = cpshard.prepare_cp_forward(model, cp_mesh, batch)
        assert model.config._attn_implementation == impl  # not switched by prepare
        assert torch.equal(_generate(model, prompt), want_tokens)
        with ctx():
            assert model.config._attn_implementation == "cpshard"
            logits = model(input_ids=local["input_ids"], position_ids=local["position_ids"]).logits
        assert model.config._attn_implementation == impl  # restored on exit
        assert_close(sharder.gather_token_tensor(logits, trim=True), want_logits)
        assert torch.equal(_generate(model, prompt), want_tokens)
    # restored even when the forward raises inside ctx()
    ctx, local, _ = cpshard.prepare_cp_forward(model, cp_mesh, batch)
    try:
        with ctx():
            raise KeyError("boom")
    except KeyError:
        pass
    assert model.config._attn_implementation == impl


def configured_implementation_is_kept(cp_mesh: DeviceMesh) -> None:
    """flex_attention (too slow to run on CPU here) stays selected outside ctx()."""
    model = _tiny("sdpa")
    model.config._attn_implementation_internal = "flex_attention"  # as if configured so
    ids = torch.randint(1, 64, (1, 9))
    ctx, _, _ = cpshard.prepare_cp_forward(model, cp_mesh, {"input_ids": ids})
    assert model.config._attn_implementation == "flex_attention"
    with ctx():
        assert model.config._attn_implementation == "cpshard"
    assert model.config._attn_implementation == "flex_attention"
