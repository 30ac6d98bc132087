"""Rank functions for batch identity (issue 17): a re-sharded sharder in cp_attention, HF
checkpointing enabled after the prepare, and local tensors copied by ``.clone()`` / ``.to()``."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from _attention_fns import tiny_hf_model
from torch.distributed.device_mesh import DeviceMesh

import cpshard
from cpshard.attention import cp_attention

B, S, H, D = 2, 16, 2, 8


def _batch(pad_last: int, seed: int = 1) -> dict[str, Any]:
    ids = torch.randint(1, 64, (B, S), generator=torch.Generator().manual_seed(seed))
    mask = torch.ones(B, S, dtype=torch.long)
    if pad_last:
        mask[1, -pad_last:] = 0
    return {"input_ids": ids, "attention_mask": mask}


def stale_sharder_in_cp_attention(cp_mesh: DeviceMesh) -> str:
    """cp_attention inside batch 1's ctx() after the same sharder sharded batch 2 (same local
    length, other padding): the sharder returned with batch 1 is bound to it and still works
    (it cannot go stale); the template that sharded both (the seed's latest-batch holder) and
    batch 2's sharder raise on every rank."""
    layout = cpshard.RoundRobinLayout() if cp_mesh.size() > 1 else cpshard.NoneLayout()
    template = cpshard.closed_form_sharder(layout)
    ctx1, local1, sharder = cpshard.make_cp_batch_and_ctx(cp_mesh, _batch(0), cp_sharder=template)
    n = local1["input_ids"].shape[1]
    q, k, v = (torch.randn(B, H, n, D) for _ in range(3))
    with ctx1():
        want = cp_attention(q, k, v, sharder=sharder)  # its own batch: fine
    _, _, second = cpshard.make_cp_batch_and_ctx(cp_mesh, _batch(5), cp_sharder=sharder)
    with ctx1():  # re-sharded through it, but bound to batch 1 for good
        torch.testing.assert_close(cp_attention(q, k, v, sharder=sharder), want)
    with ctx1(), pytest.raises(ValueError, match="has sharded another batch since"):
        cp_attention(q, k, v, sharder=second)
    with ctx1(), pytest.raises(ValueError, match="has sharded another batch since") as info:
        cp_attention(q, k, v, sharder=template)
    return str(info.value)


def hf_checkpointing_enabled_after_prepare(cp_mesh: DeviceMesh) -> str:
    """Reentrant HF gradient checkpointing switched on after prepare_cp_forward: the forward
    under ctx() raises on every rank before any collective (its gradients were silently off)."""
    pytest.importorskip("transformers")
    model = tiny_hf_model("llama")
    model.train()
    ctx, local, _ = cpshard.prepare_cp_forward(model, cp_mesh, _batch(3))
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
    with ctx(), pytest.raises(ValueError, match="gradient_checkpointing_kwargs") as info:
        model(input_ids=local["input_ids"], position_ids=local["position_ids"])
    return str(info.value)


def copies_keep_batch_identity(cp_mesh: DeviceMesh, copy: str) -> list[str]:
    """Local tensors copied by .clone() / .to() lose the tag but not the batch identity: a
    forgotten ctx() (cp > 1) and a stale ctx raise; the copy under its own ctx() equals the
    original, also after the local tokens were edited in place before the forward (the record
    is the local tensor as its forward sees it)."""
    from cpshard.models import TinyDecoder, TinyDecoderConfig

    world = cp_mesh.size()
    model = TinyDecoder.from_config(TinyDecoderConfig(vocab_size=64), seed=0)
    ctx1, local1, _ = cpshard.prepare_cp_forward(model, cp_mesh, _batch(0))
    ctx2, local2, _ = cpshard.prepare_cp_forward(model, cp_mesh, _batch(5, seed=2))

    def dup(t: torch.Tensor) -> torch.Tensor:
        return t.clone() if copy == "clone" else t.to(torch.float64).to(t.dtype)

    local2["input_ids"][..., 0] = (local2["input_ids"][..., 0] + 1) % 64  # edited in place
    ids2, pos2 = dup(local2["input_ids"]), dup(local2["position_ids"])
    with ctx2():
        want = model(local2["input_ids"], local2["position_ids"])
        torch.testing.assert_close(model(ids2, pos2), want)  # a copy under its own ctx: fine
    msgs = []
    with ctx1(), pytest.raises(ValueError, match="stale ctx") as info:
        model(ids2, pos2)  # batch 2's copies under batch 1's ctx (same shapes, other tokens)
    msgs.append(str(info.value))
    if world > 1:
        with pytest.raises(ValueError, match=r"outside its ctx\(\) on a copy") as info:
            model(ids2, pos2)
        msgs.append(str(info.value))
    return msgs
