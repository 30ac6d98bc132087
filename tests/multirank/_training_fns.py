"""Rank functions: training loops as they are written (FSDP2 on dp x cp, RL, accumulation)."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from torch.testing import assert_close

import cpshard
from cpshard.corpus import PAD_ID, VOCAB_SIZE, dense_batch
from cpshard.loss import (
    count_tokens,
    cp_cross_entropy,
    grad_mean_scale,
    reduce_for_logging,
)
from cpshard.models import TinyDecoder, TinyDecoderConfig

_CFG = TinyDecoderConfig(vocab_size=VOCAB_SIZE, hidden_size=32, num_layers=2, intermediate_size=64)


def _model() -> TinyDecoder:
    return TinyDecoder.from_config(_CFG, seed=0).double()


def _full_grads(model: nn.Module) -> dict[str, torch.Tensor]:
    out = {}
    for name, p in model.named_parameters():
        assert p.grad is not None, name
        g = p.grad
        out[name] = g.full_tensor() if isinstance(g, DTensor) else g
    return out


def fsdp2_dp_cp(world_mesh: DeviceMesh, recipe: str) -> None:
    """dp=2 x cp=2 on 4 ranks: both FSDP2 recipes equal one process on the global batch."""
    assert world_mesh.size() == 4
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "cp"))
    dp = mesh["dp"].get_local_rank()
    glob = dense_batch(4, 22, seed=7)
    # one process: the global per-token mean over all 4 rows
    ref = _model()
    n_all = count_tokens(glob["labels"])
    logits = ref(glob["input_ids"])
    ref_loss = cp_cross_entropy(logits, glob["labels"], num_tokens=n_all)
    ref_loss.backward()

    model = _model()
    if recipe == "dp_shard+sync_grads":
        shard_mesh, scale = mesh["dp"], grad_mean_scale(mesh["dp"])
    else:  # fully_shard over the flattened dp x cp ranks (here: the whole world)
        shard_mesh, scale = world_mesh, grad_mean_scale(mesh)
    for block in model.blocks:
        fully_shard(block, mesh=shard_mesh)
    fully_shard(model, mesh=shard_mesh)

    batch = {k: v[2 * dp : 2 * dp + 2] for k, v in glob.items()}  # this dp replica's rows
    ctx, local, _ = cpshard.prepare_cp_forward(model, mesh["cp"], batch, padding_token_id=PAD_ID)
    with ctx():
        out = model(local["input_ids"], local["position_ids"])
    n = count_tokens(local["labels"], group=mesh)  # real tokens of the whole dp x cp step
    assert n == n_all
    loss = cp_cross_entropy(out, local["labels"], num_tokens=n, scale=scale)
    loss.backward()
    if recipe == "dp_shard+sync_grads":
        cpshard.sync_grads(model, mesh["cp"])
    assert_close(reduce_for_logging(loss, mesh, scale=scale), ref_loss.detach())
    want = {k: v for k, v in ((n_, p.grad) for n_, p in ref.named_parameters())}
    got = _full_grads(model)
    for name, g in want.items():
        assert g is not None
        assert_close(got[name], g, msg=name)


def fsdp2_forgotten_sync_is_wrong(world_mesh: DeviceMesh) -> float:
    """Without sync_grads the FSDP2-over-dp gradients are wrong (the test must be able to fail)."""
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "cp"))
    glob = dense_batch(4, 22, seed=7)
    ref = _model()
    cp_cross_entropy(
        ref(glob["input_ids"]), glob["labels"], num_tokens=count_tokens(glob["labels"])
    ).backward()
    model = _model()
    fully_shard(model, mesh=mesh["dp"])
    dp = mesh["dp"].get_local_rank()
    batch = {k: v[2 * dp : 2 * dp + 2] for k, v in glob.items()}
    ctx, local, _ = cpshard.prepare_cp_forward(model, mesh["cp"], batch, padding_token_id=PAD_ID)
    with ctx():
        out = model(local["input_ids"], local["position_ids"])
    n = count_tokens(local["labels"], group=mesh)
    cp_cross_entropy(
        out, local["labels"], num_tokens=n, scale=grad_mean_scale(mesh["dp"])
    ).backward()
    got = _full_grads(model)
    return max(
        float((got[k] - p.grad).abs().max())
        for k, p in ref.named_parameters()
        if p.grad is not None
    )


def sync_grads_errors(world_mesh: DeviceMesh) -> None:
    """A 2-D mesh, a mesh without this rank: clear errors on every rank, before any collective."""
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "cp"))
    model = _model()
    with pytest.raises(ValueError, match="cp_mesh must be 1-D"):
        cpshard.sync_grads(model, mesh)
    rank = world_mesh.get_local_rank()
    other = DeviceMesh("cpu", [r for r in range(4) if r // 2 != rank // 2], _init_backend=False)
    with pytest.raises(ValueError, match="does not contain this rank"):
        cpshard.sync_grads(model, other)
    with pytest.raises(ValueError, match="does not contain this rank"):
        count_tokens(torch.zeros(1, 3), group=other)
    cpshard.sync_grads(model, None)  # no CP: a no-op
    assert all(p.grad is None for p in model.parameters())
