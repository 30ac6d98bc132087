"""Rank functions for activation checkpointing under CP (the recomputation runs in backward)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.utils.checkpoint as ckpt
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

import cpshard
from cpshard.loss import count_tokens, cp_cross_entropy
from cpshard.models import TinyDecoder, TinyDecoderConfig

B, S = 2, 16


def _batch() -> dict[str, Any]:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(1, 64, (B, S), generator=g)
    mask = torch.ones(B, S, dtype=torch.long)
    mask[1, -5:] = 0
    labels = cpshard.shift_labels(ids, padding_mask=mask == 0)
    return {"input_ids": ids, "labels": labels, "attention_mask": mask}


class _Checkpointed(nn.Module):
    """Runs each block of a TinyDecoder through ``torch.utils.checkpoint``."""

    def __init__(self, block: nn.Module, kwargs: dict[str, Any]) -> None:
        super().__init__()
        self.block = block
        self.kwargs = kwargs

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return ckpt.checkpoint(self.block, *args, **self.kwargs, **kwargs)


def _tiny(ckpt_kwargs: dict[str, Any] | None) -> TinyDecoder:
    model = TinyDecoder.from_config(TinyDecoderConfig(vocab_size=64), seed=0)
    if ckpt_kwargs is not None:
        model.blocks = nn.ModuleList(_Checkpointed(b, ckpt_kwargs) for b in model.blocks)
    return model


def _grads(model: nn.Module, cp_mesh: DeviceMesh | None, backward_inside: bool) -> dict[str, Any]:
    batch = _batch()
    ctx, local, _ = cpshard.prepare_cp_forward(model, cp_mesh, batch)
    n = count_tokens(batch["labels"])
    with ctx():
        logits = model(local["input_ids"], local["position_ids"])
        loss = cp_cross_entropy(logits, local["labels"], num_tokens=n)
        if backward_inside:
            loss.backward()
    if not backward_inside:
        loss.backward()
    cpshard.sync_grads(model, cp_mesh)
    return {k: p.grad for k, p in model.named_parameters() if p.grad is not None}


def tiny_checkpointed(cp_mesh: DeviceMesh, backward_inside: bool) -> None:
    """Non-reentrant checkpoint with checkpoint_context_fn: gradients equal cp=1 without it."""
    want = _grads(_tiny(None), None, False)
    kwargs = {"use_reentrant": False, "context_fn": cpshard.attention.checkpoint_context_fn}
    got = _grads(_tiny(kwargs), cp_mesh, backward_inside)
    assert want.keys() == {k.replace(".block", "") for k in got}
    for k, g in got.items():
        torch.testing.assert_close(g, want[k.replace(".block", "")], atol=2e-5, rtol=1e-4)


def tiny_checkpointed_without_context(cp_mesh: DeviceMesh) -> str:
    """A checkpoint without checkpoint_context_fn raises in the forward on every rank."""
    model = _tiny({"use_reentrant": False})
    with pytest.raises(ValueError, match="checkpoint_context_fn") as info:
        _grads(model, cp_mesh, False)
    return str(info.value)


def _llama() -> Any:
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(
        vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=2, use_cache=False,
        attn_implementation="eager",
    )  # fmt: skip
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg)


def _hf_grads(model: nn.Module, cp_mesh: DeviceMesh | None) -> dict[str, Any]:
    batch = _batch()
    ctx, local, _ = cpshard.prepare_cp_forward(model, cp_mesh, batch)
    with ctx():
        logits = model(input_ids=local["input_ids"], position_ids=local["position_ids"]).logits
    loss = cp_cross_entropy(logits, local["labels"], num_tokens=count_tokens(batch["labels"]))
    loss.backward()  # outside ctx(): the recomputation must still be CP attention
    cpshard.sync_grads(model, cp_mesh)
    return {k: p.grad for k, p in model.named_parameters() if p.grad is not None}


def hf_checkpointed(cp_mesh: DeviceMesh, case: str) -> str:
    """HF gradient checkpointing: with checkpoint_context_fn equal to cp=1, else a clear error."""
    model = _llama()
    model.train()
    if case == "context_fn":
        want = _hf_grads(_llama(), None)
        model.gradient_checkpointing_enable(
            gradient_checkpointing_kwargs={
                "use_reentrant": False,
                "context_fn": cpshard.attention.checkpoint_context_fn,
            }
        )
        got = _hf_grads(model, cp_mesh)
        assert got.keys() == want.keys()
        for k in want:
            torch.testing.assert_close(got[k], want[k], atol=2e-5, rtol=1e-4)
        assert model.config._attn_implementation == "eager"  # restored after the recompute
        return "ok"
    kwargs = {"use_reentrant": True} if case == "reentrant" else {"use_reentrant": False}
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    model.eval()  # a log-prob pass in eval mode recomputes nothing: allowed
    cpshard.prepare_cp_forward(model, cp_mesh, _batch())
    model.train()
    with pytest.raises(ValueError, match="gradient_checkpointing_kwargs") as info:
        cpshard.prepare_cp_forward(model, cp_mesh, _batch())
    return str(info.value)
