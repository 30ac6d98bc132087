"""Rank functions: hybrid HF models (Mamba, Mamba2, Gated DeltaNet, short convs) under CP.

Each compares one fp64 training step under CP (logits, loss, every parameter gradient summed
over the CP group) with one process running the model on the whole batch without cpshard; a
packed batch's reference runs each document alone (the only exact one-process reference: HF's
own packed forward carries mixer state across documents).
"""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh
from torch.testing import assert_close

import cpshard
from _mixer_models import tiny_hybrid
from cpshard._comm import cp_group
from cpshard.mixers import CPMixerWarning

__all__ = [
    "hybrid_checkpointed",
    "hybrid_dense",
    "hybrid_packed",
    "hybrid_refusals",
    "mamba_without_prepare",
]

_SEQ_LENS = [5, 1, 4, 3]  # one packed row of 13 tokens: a 1-token document too
_NATIVE = ("mamba2", "granitemoehybrid", "nemotron_h")  # every mixer a Mamba2 copy


def _ids(rows: int, seq: int, seed: int) -> torch.Tensor:
    return torch.randint(1, 64, (rows, seq), generator=torch.Generator().manual_seed(seed))


def _loss(logits: torch.Tensor, labels: torch.Tensor, n: int) -> torch.Tensor:
    flat = logits.reshape(-1, logits.shape[-1])
    return F.cross_entropy(flat, labels.reshape(-1), ignore_index=-100, reduction="sum") / n


def _grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def _cp_step(
    cp_mesh: DeviceMesh,
    arch: str,
    batch: dict[str, Any],
    layout: str,
    method: str,
    n: int,
    checkpointed: bool = False,
) -> tuple[torch.Tensor, float, dict[str, torch.Tensor]]:
    """Gathered logits ``[B, S, V]``, the loss and the grads summed over the CP group."""
    model = tiny_hybrid(arch)
    if checkpointed:  # HF gradient checkpointing: the mixers are recomputed in backward()
        model.train()
        model.gradient_checkpointing_enable(
            gradient_checkpointing_kwargs={
                "use_reentrant": False,
                "context_fn": cpshard.attention.checkpoint_context_fn,
            }
        )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ctx, local, sharder = cpshard.prepare_cp_forward(
            model, cp_mesh, batch, layout=layout, attention=method
        )
    mixer_warnings = [w for w in caught if issubclass(w.category, CPMixerWarning)]
    # Mamba2 mixers on in-order shards run natively (no generic cost, no warning)
    native = arch in _NATIVE and layout in ("contiguous", "auto") and "seq_lens" not in batch
    want = 1 if cp_mesh.size() > 1 and not native else 0
    assert len(mixer_warnings) == want, [str(w) for w in caught]
    with ctx():
        logits = model(input_ids=local["input_ids"], position_ids=local["position_ids"]).logits
    loss = _loss(logits, local["labels"], n)
    loss.backward()
    grads = _grads(model)
    total = loss.detach().clone()
    group = cp_group(cp_mesh)
    if group is not None:
        for g in grads.values():
            dist.all_reduce(g, group=group)
        dist.all_reduce(total, group=group)
    full = sharder.gather_token_tensor(logits.detach(), trim=True, fill=0.0)
    # No hook outlives the ctx: the model runs as itself again.
    for site in cpshard.mixers.find_token_mixers(model):
        assert not site.module._forward_pre_hooks and not site.module._forward_hooks
    return full, float(total), grads


def _compare(
    got: tuple[torch.Tensor, float, dict[str, torch.Tensor]],
    want: tuple[torch.Tensor, float, dict[str, torch.Tensor]],
    what: str,
    real: torch.Tensor | None = None,
) -> None:
    logits, loss, grads = got
    ref_logits, ref_loss, ref_grads = want
    if real is not None:
        logits, ref_logits = logits[real], ref_logits[real]
    assert_close(logits, ref_logits, msg=lambda m: f"{what} logits: {m}")
    # rounding of the fp32 logits some models return (Mamba casts them): 1e-6 relative
    assert abs(loss - ref_loss) <= 1e-6 * abs(ref_loss), (what, loss, ref_loss)
    assert grads.keys() == ref_grads.keys(), what
    for name, g in ref_grads.items():
        assert_close(grads[name], g, msg=lambda m, k=name: f"{what} grad {k}: {m}")


def hybrid_dense(
    cp_mesh: DeviceMesh, arch: str, layout: str, method: str, checkpointed: bool = False
) -> None:
    """Dense ``[2, 13]`` batch: CP == one process, forward and backward, in fp64."""
    ids = _ids(2, 13, 7)
    labels = cpshard.shift_labels(ids)
    n = int((labels != -100).sum())
    ref = tiny_hybrid(arch)
    ref_logits = ref(input_ids=ids).logits
    ref_loss = _loss(ref_logits, labels, n)
    ref_loss.backward()
    want = (ref_logits.detach(), float(ref_loss), _grads(ref))
    batch = {"input_ids": ids, "labels": labels}
    got = _cp_step(cp_mesh, arch, batch, layout, method, n, checkpointed)
    _compare(got, want, f"{arch} {layout} {method}")


def hybrid_checkpointed(cp_mesh: DeviceMesh, arch: str) -> None:
    """HF gradient checkpointing: the recomputation in backward() runs the mixers exactly."""
    hybrid_dense(cp_mesh, arch, "round_robin", "all_gather", checkpointed=True)


def hybrid_packed(cp_mesh: DeviceMesh, arch: str, layout: str) -> None:
    """One packed row of 4 documents: CP == each document alone, forward and backward."""
    total = sum(_SEQ_LENS)
    ids = _ids(1, total, 9)
    labels = torch.full_like(ids, -100)
    ref = tiny_hybrid(arch)
    pieces, start = [], 0
    for length in _SEQ_LENS:
        doc = ids[:, start : start + length]
        labels[:, start : start + length - 1] = doc[:, 1:]
        pieces.append(ref(input_ids=doc).logits)
        start += length
    ref_logits = torch.cat(pieces, dim=1)
    n = int((labels != -100).sum())
    ref_loss = _loss(ref_logits, labels, n)
    ref_loss.backward()
    want = (ref_logits.detach(), float(ref_loss), _grads(ref))
    batch = {"input_ids": ids, "labels": labels, "seq_lens": [list(_SEQ_LENS)]}
    got = _cp_step(cp_mesh, arch, batch, layout, "all_gather", n)
    _compare(got, want, f"{arch} packed {layout}")


def hybrid_refusals(cp_mesh: DeviceMesh, arch: str) -> list[str]:
    """``strict=True`` refuses on every rank before any collective; the messages."""
    model = tiny_hybrid(arch)
    ids = _ids(1, 12, 3)
    messages = []
    batches: list[dict[str, Any]] = [{"input_ids": ids}]
    if cp_mesh.size() == 1:  # at cp=1 only a packed batch needs the mixers to change
        batches = [{"input_ids": ids, "seq_lens": [[5, 7]]}]
    for batch in batches:
        try:
            cpshard.prepare_cp_forward(model, cp_mesh, batch, strict=True)
        except ValueError as e:
            messages.append(str(e))
        else:
            raise AssertionError("strict=True accepted a hybrid model")
    if cp_mesh.size() == 1:  # a dense batch at cp=1 is left alone, even under strict
        ctx, local, _ = cpshard.prepare_cp_forward(model, cp_mesh, {"input_ids": ids}, strict=True)
        with ctx():
            got = model(input_ids=local["input_ids"], position_ids=local["position_ids"]).logits
        assert_close(got, model(input_ids=ids).logits)
    return messages


def mamba_without_prepare(cp_mesh: DeviceMesh) -> None:
    """``make_cp_batch_and_ctx(model=...)`` runs a pure SSM exactly (no attention to switch)."""
    ids = _ids(2, 11, 4)
    ref = tiny_hybrid("mamba")
    want = ref(input_ids=ids).logits
    want.sum().backward()
    model = tiny_hybrid("mamba")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", CPMixerWarning)
        ctx, local, sharder = cpshard.make_cp_batch_and_ctx(
            cp_mesh, {"input_ids": ids}, model=model, layout="contiguous"
        )
    with ctx():
        logits = model(input_ids=local["input_ids"]).logits
    (logits * (local["input_ids"] != 0)[..., None]).sum().backward()  # pads carry no loss
    assert_close(sharder.gather_token_tensor(logits.detach(), trim=True), want.detach())
    group = cp_group(cp_mesh)
    for name, p in model.named_parameters():
        assert p.grad is not None, name
        g = p.grad.clone()
        if group is not None:
            dist.all_reduce(g, group=group)
        ref_grad = dict(ref.named_parameters())[name].grad
        assert_close(g, ref_grad, rtol=1e-5, atol=1e-6, msg=lambda m, k=name: f"{k}: {m}")
    with pytest.raises(ValueError, match="strict=True"):
        cpshard.make_cp_batch_and_ctx(cp_mesh, {"input_ids": ids}, model=model, strict=True)
