"""Shared GPU-tier helpers: one CP case on CUDA, and spawned rank workers.

Every wait is bounded by at most 60 s (``tests/unit/test_gpu_check.py`` checks it), so the short
GPU run of ``benchmarks/gpu_check.sh`` can afford a hang: a process-group timeout, a call timeout
for the launcher's pools and a timeout for the parity subprocess.

Rank workers are *spawned* (never forked: a parent that has used CUDA cannot fork a child that
uses it), so they live in this importable module. The gloo ranks come from the launcher
(``LocalRanks(start_method="spawn")``), the NCCL ranks too (``backend="nccl"``, one GPU per rank).
"""

from __future__ import annotations

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.testing import assert_close

from _attention_common import WINDOW_LAYOUTS, inputs, make_case, make_meta, reference_with_grads
from cpshard.attention import cp_sdpa

PG_TIMEOUT_S = 45.0  # a rank blocked this long in a collective raises
CALL_TIMEOUT_S = 60.0  # a pool's call that has not finished by then fails, naming the ranks
PARITY_TIMEOUT_S = 60.0  # the torchrun parity subprocess

TOL = {
    torch.float32: (2e-4, 2e-4),
    torch.bfloat16: (3e-2, 3e-2),
    torch.float16: (1e-2, 1e-2),
}


def cp_case(
    world: int, rank: int, dtype: torch.dtype, method: str, device: str, layout: str = "round_robin"
) -> None:
    """cp_sdpa on ``device`` for this rank's shard, forward and backward vs an fp64 reference."""
    rmap, docs = make_case(layout, world, 61, 2, 3, 0, 1)
    q, k, v, go = inputs(2, 8, 4, rmap.numel(), 16, 0)
    ref = reference_with_grads(q, k, v, go, docs, True)
    idx = rmap[rank]
    local = [t.index_select(2, idx).to(device, dtype).requires_grad_() for t in (q, k, v)]
    group = torch.distributed.group.WORLD if world > 1 else None
    out = cp_sdpa(*local, group=group, meta=make_meta(rmap, docs, rank).to(device), method=method)
    out.backward(go.index_select(2, idx).to(device, dtype))
    rtol, atol = TOL[dtype]
    got = [out, *(t.grad for t in local)]
    for name, g, r in zip(("out", "dq", "dk", "dv"), got, ref, strict=True):
        assert g is not None
        assert_close(
            g.double().cpu(), r.index_select(2, idx), rtol=rtol, atol=atol,
            msg=lambda m, name=name: f"rank {rank}/{world} {method} {dtype} {name}: {m}",
        )  # fmt: skip


def gloo_one_gpu_rank(cp_mesh: DeviceMesh, dtype_name: str, methods: list[str]) -> None:
    """Several CP ranks sharing ``cuda:0`` over gloo (collectives staged through host memory)."""
    torch.cuda.set_device(0)
    for method in methods:
        for layout in WINDOW_LAYOUTS:  # as the CPU window tests
            cp_case(
                cp_mesh.size(), cp_mesh.get_local_rank(), getattr(torch, dtype_name), method,
                "cuda:0", layout,
            )  # fmt: skip


def nccl_rank(cp_mesh: DeviceMesh, method: str) -> None:
    """One rank per GPU over NCCL (the launcher made ``cuda:<rank>`` this rank's device)."""
    rank = cp_mesh.get_local_rank()
    cp_case(cp_mesh.size(), rank, torch.float32, method, f"cuda:{rank}")
