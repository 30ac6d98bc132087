"""Rank functions of ``test_collectives.py``: every collective counted through ``_comm``."""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.device_mesh import DeviceMesh

import cpshard
from cpshard._comm import CommRecorder, cp_group
from cpshard.attention import cp_sdpa
from cpshard.layouts.closed_form import RoundRobinLayout
from cpshard.sharding.gather import HEADER_BYTES
from cpshard.sharding.meta import TokenMeta


def attention_collectives(cp_mesh: DeviceMesh, method: str) -> dict[str, Any]:
    """One layer of ``method`` (fwd, then bwd) in fp32 under a recorder: what it issued."""
    rank, world = cp_mesh.get_local_rank(), cp_mesh.size()
    group = cp_group(cp_mesh)
    local = 8
    rmap = RoundRobinLayout().rank_map(world, world * local)
    stream = rmap.reshape(1, -1)
    meta = TokenMeta(rank, world, stream, torch.zeros_like(stream))
    b, hq, hkv, d = 2, 2 * world, world, 4
    q = torch.randn(b, hq, local, d, requires_grad=True)
    k = torch.randn(b, hkv, local, d, requires_grad=True)
    v = torch.randn(b, hkv, local, d, requires_grad=True)
    cp_sdpa(q, k, v, group=group, meta=meta, method=method)  # the plan, built once
    with CommRecorder() as fwd:
        out = cp_sdpa(q, k, v, group=group, meta=meta, method=method)
    with CommRecorder() as bwd:
        out.sum().backward()
    return {"fwd": fwd.summary(), "bwd": bwd.summary(), "shape": (b, hq, hkv, local, d)}


def verb_collectives(cp_mesh: DeviceMesh) -> dict[str, Any]:
    """The batch check, a shard, and gathers: the collectives of each, and their bytes."""
    ids = torch.arange(8 * 72).view(8, 72)  # 72: no CP padding at C = 2, 3, 4
    with CommRecorder() as check_on:
        _, local, sharder = cpshard.make_cp_batch_and_ctx(cp_mesh, {"input_ids": ids})
    with CommRecorder() as check_off:
        cpshard.make_cp_batch_and_ctx(cp_mesh, {"input_ids": ids}, check_consistency=False)
    x = torch.arange(8 * 72, dtype=torch.float32).view(8, 72)  # the same on every rank
    with CommRecorder() as shard:
        mine = sharder.shard_token_tensor(x)
    events = {}
    for name, t in (("seeded", mine), ("again", mine), ("wider", mine[..., None].expand(-1, -1, 3)),
                    ("wider again", mine[..., None].expand(-1, -1, 3).contiguous()),
                    ("narrower", mine.to(torch.bfloat16))):  # fmt: skip
        with CommRecorder() as rec:
            full = sharder.gather_token_tensor(t)
        events[name] = (rec.summary(), t.numel() * t.element_size())
        if name == "seeded":
            assert torch.equal(full, x)
    _, _, off = cpshard.make_cp_batch_and_ctx(cp_mesh, {"input_ids": ids}, check_consistency=False)
    with CommRecorder() as unchecked:
        off.gather_token_tensor(off.shard_token_tensor(x))
    return {
        "check_on": check_on.summary(),
        "check_off": check_off.summary(),
        "shard": shard.summary(),
        "gathers": events,
        "unchecked": unchecked.summary(),
        "local": tuple(local["input_ids"].shape),
    }


def gather_mismatch(cp_mesh: DeviceMesh) -> tuple[str, dict[str, tuple[int, int]]]:
    """Rank 0 gathers [B, L], the others [B, L, 3]: the same error on every rank, one collective."""
    ids = torch.arange(4 * 24).view(4, 24)
    _, local, sharder = cpshard.make_cp_batch_and_ctx(cp_mesh, {"input_ids": ids})
    t = torch.randn(*local["input_ids"].shape)
    if cp_mesh.get_local_rank() != 0:
        t = t[..., None].expand(-1, -1, 3)
    with CommRecorder() as rec:
        try:
            sharder.gather_token_tensor(t)
        except ValueError as e:
            return str(e), rec.summary()
    raise AssertionError("no error")


def gather_backward(cp_mesh: DeviceMesh, grad: str) -> torch.Tensor:
    """The gather's payload path is differentiable: the grad of a sum over the gathered tensor."""
    ids = torch.arange(4 * 24).view(4, 24)
    _, local, sharder = cpshard.make_cp_batch_and_ctx(cp_mesh, {"input_ids": ids})
    t = torch.randn(*local["input_ids"].shape, requires_grad=True)
    with CommRecorder() as rec:
        full = sharder.gather_token_tensor(t, grad=grad)
    assert rec.count() == 1, rec.summary()
    weights = torch.arange(full.numel(), dtype=full.dtype).view_as(full)
    (full * weights).sum().backward()
    assert t.grad is not None
    return t.grad


__all__ = ["HEADER_BYTES", "attention_collectives", "gather_backward", "gather_mismatch",
           "verb_collectives"]  # fmt: skip
