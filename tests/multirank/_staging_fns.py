"""Rank functions: the collectives of ``cpshard._comm`` staged through host memory vs direct."""

from __future__ import annotations

from typing import Any
from unittest import mock

import torch
from torch.distributed.device_mesh import DeviceMesh

from cpshard import _comm


def _forced_staging() -> Any:
    """Force every collective of ``cpshard._comm`` through host memory (CPU tensors included)."""
    return mock.patch.object(_comm, "_transport", return_value=torch.device("cpu"))


def _collectives(group: object, rank: int, world: int) -> dict[str, torch.Tensor]:
    """Every transport primitive once, on rank-dependent inputs (forward and backward)."""
    gen = torch.Generator().manual_seed(7 + rank)
    x = torch.randn(3, 5, generator=gen, dtype=torch.float64)
    stacked = torch.randn(world, 2, 4, generator=gen)
    res: dict[str, torch.Tensor] = {}
    res["all_gather_stacked"] = _comm.all_gather_stacked(x[:, ::2], group)  # non-contiguous
    res["reduce_scatter_stacked"] = _comm.reduce_scatter_stacked(stacked, group)
    res["all_to_all_stacked"] = _comm.all_to_all_stacked(stacked.bfloat16(), group).float()
    res["all_reduce_sum_"] = _comm.all_reduce_sum_(x.clone(), group)
    pair = [x.clone(), stacked.clone()]  # two dtypes: two buckets
    _comm.all_reduce_sum_coalesced_(pair, group)
    res["all_reduce_sum_coalesced_0"], res["all_reduce_sum_coalesced_1"] = pair
    res["all_gather_stacked_start"] = _comm.all_gather_stacked_start(x[:, ::2], group).wait()[0]
    started = _comm.reduce_scatter_stacked_start(stacked, group)
    res["reduce_scatter_stacked_start"] = started.wait()[0]
    leaf = x.clone().requires_grad_()
    gathered = _comm.all_gather_dim0(leaf, group, "sum")
    (gathered * torch.arange(gathered.numel()).view_as(gathered)).sum().backward()
    assert leaf.grad is not None
    res["all_gather_dim0"], res["all_gather_dim0_grad"] = gathered.detach(), leaf.grad
    if world > 1:
        xfer = _comm.ring_shift_start([x, x[:, 1:] * 2], group, (5, 6))
        got = xfer.wait()
        res["ring_0"], res["ring_1"] = got[0], got[1]
    return res


def staged_matches_direct(cp_mesh: DeviceMesh) -> dict[str, bool]:
    """Run every primitive direct, then forced through host memory; report equality per name."""
    group = cp_mesh.get_group()
    rank, world = cp_mesh.get_local_rank(), cp_mesh.size()
    backend = str(torch.distributed.get_backend(group))
    assert _comm.transport_device_type(backend, "cpu") is None
    x = torch.arange(6.0).view(2, 3) * (rank + 1)
    direct = _collectives(group, rank, world)
    direct["all_reduce_sum_mesh_"] = _comm.all_reduce_sum_mesh_(x.clone(), cp_mesh)
    with _forced_staging():
        staged = _collectives(group, rank, world)
        staged["all_reduce_sum_mesh_"] = _comm.all_reduce_sum_mesh_(x.clone(), cp_mesh)
    same = {name: torch.equal(direct[name], staged[name]) for name in direct}
    for run, res in (("direct", direct), ("staged", staged)):  # async == synchronous
        for name in ("all_gather_stacked", "reduce_scatter_stacked"):
            same[f"{run} {name}_start"] = torch.equal(res[f"{name}_start"], res[name])
    return same


def _cp_sdpa_step(cp_mesh: DeviceMesh, method: str) -> list[torch.Tensor]:
    from cpshard.attention import cp_sdpa
    from cpshard.layouts.closed_form import RoundRobinLayout
    from cpshard.sharding.meta import TokenMeta

    rank, world = cp_mesh.get_local_rank(), cp_mesh.size()
    s = 8 * world
    rmap = RoundRobinLayout().rank_map(world, s)
    stream = rmap.reshape(-1)
    docs = (torch.arange(s) >= s // 3).long()  # two documents
    meta = TokenMeta(rank, world, stream[None], docs[stream][None])
    gen = torch.Generator().manual_seed(3)
    q, k, v, go = (
        torch.randn(1, h, s, 4, generator=gen, dtype=torch.float64) for h in (4, 2, 2, 4)
    )
    idx = rmap[rank]
    local = [t.index_select(2, idx).requires_grad_() for t in (q, k, v)]
    out = cp_sdpa(*local, group=cp_mesh.get_group(), meta=meta, method=method)
    grads = torch.autograd.grad(out, local, go.index_select(2, idx))
    return [out.detach(), *grads]


def staged_cp_sdpa_matches_direct(cp_mesh: DeviceMesh, method: str) -> bool:
    """cp_sdpa forward and backward with every collective forced through host memory."""
    direct = _cp_sdpa_step(cp_mesh, method)
    with _forced_staging():
        staged = _cp_sdpa_step(cp_mesh, method)
    return all(torch.equal(a, b) for a, b in zip(direct, staged, strict=True))
