"""GPU tier: the same parity checks on CUDA (single GPU) and with NCCL (when >= 2 GPUs).

Skipped without CUDA. Run on a GPU machine with ``pytest -m gpu tests/gpu``.
"""

from __future__ import annotations

import os
import socket

import pytest
import torch
import torch.multiprocessing as mp
from torch.testing import assert_close

from _attention_common import inputs, make_case, make_meta, reference_with_grads
from cpshard.attention import cp_sdpa

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]
TOL = {torch.float32: (2e-4, 2e-4), torch.bfloat16: (3e-2, 3e-2)}


def _case(world: int, rank: int, dtype: torch.dtype, method: str, device: str) -> None:
    rmap, docs = make_case("round_robin", world, 61, 2, 3, 0, 1)
    q, k, v, go = inputs(2, 8, 4, rmap.numel(), 16, 0)
    ref = reference_with_grads(q, k, v, go, docs, True)
    idx = rmap[rank]
    local = [t.index_select(2, idx).to(device, dtype).requires_grad_() for t in (q, k, v)]
    group = torch.distributed.group.WORLD if world > 1 else None
    out = cp_sdpa(*local, group=group, meta=make_meta(rmap, docs, rank).to(device), method=method)
    out.backward(go.index_select(2, idx).to(device, dtype))
    rtol, atol = TOL[dtype]
    got = [out, *(t.grad for t in local)]
    for g, r in zip(got, ref, strict=True):
        assert g is not None
        assert_close(g.double().cpu(), r.index_select(2, idx), rtol=rtol, atol=atol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_single_gpu_matches_reference(dtype: torch.dtype) -> None:
    _case(1, 0, dtype, "all_gather", "cuda")


def _nccl_worker(rank: int, world: int, port: int, method: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.cuda.set_device(rank)
    torch.distributed.init_process_group("nccl", rank=rank, world_size=world)
    try:
        _case(world, rank, torch.float32, method, f"cuda:{rank}")
    finally:
        torch.distributed.destroy_process_group()


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
@pytest.mark.parametrize("method", ["all_gather", "ring", "ulysses"])
def test_nccl_two_gpus_match_reference(method: str) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_nccl_worker, args=(2, port, method), nprocs=2, join=True)
