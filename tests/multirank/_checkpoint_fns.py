"""Rank functions for activation checkpointing under CP (the recomputation runs in backward)."""

from __future__ import annotations

import gc
from typing import Any

import pytest
import torch
import torch.utils.checkpoint as ckpt
from _attention_fns import tiny_hf_model
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
    """Parameter gradients of the global mean loss on ``_batch()``, CP-synced (TinyDecoder or HF:
    an output with ``.logits``). ``backward_inside=False``: the recomputation of a checkpoint
    runs outside ``ctx()`` and must still be CP attention."""
    batch = _batch()
    ctx, local, _ = cpshard.prepare_cp_forward(model, cp_mesh, batch)
    n = count_tokens(batch["labels"])
    with ctx():
        out = model(input_ids=local["input_ids"], position_ids=local["position_ids"])
        logits = out if isinstance(out, torch.Tensor) else out.logits
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
    message = str(info.value)
    # torch < 2.13 does not close a non-reentrant checkpoint's generator when the checkpointed
    # forward raises: its saved-tensors hook stays pushed on this thread (later forwards of this
    # pooled rank process would read as inside a checkpoint) until the generator, held by the
    # traceback's frames, is collected
    del info
    gc.collect()
    return message


def hf_checkpointed(cp_mesh: DeviceMesh, case: str) -> str:
    """HF gradient checkpointing: with checkpoint_context_fn equal to cp=1, else a clear error."""
    pytest.importorskip("transformers")
    model = tiny_hf_model("llama")
    model.train()
    if case == "context_fn":
        want = _grads(tiny_hf_model("llama"), None, False)
        attn = model.config._attn_implementation
        model.gradient_checkpointing_enable(
            gradient_checkpointing_kwargs={
                "use_reentrant": False,
                "context_fn": cpshard.attention.checkpoint_context_fn,
            }
        )
        got = _grads(model, cp_mesh, False)
        assert got.keys() == want.keys()
        for k in want:
            torch.testing.assert_close(got[k], want[k], atol=2e-5, rtol=1e-4)
        assert model.config._attn_implementation == attn  # restored after the recompute
        return "ok"
    kwargs = {"use_reentrant": True} if case == "reentrant" else {"use_reentrant": False}
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    model.eval()  # a log-prob pass in eval mode recomputes nothing: allowed
    cpshard.prepare_cp_forward(model, cp_mesh, _batch())
    model.train()
    with pytest.raises(ValueError, match="gradient_checkpointing_kwargs") as info:
        cpshard.prepare_cp_forward(model, cp_mesh, _batch())
    return str(info.value)
