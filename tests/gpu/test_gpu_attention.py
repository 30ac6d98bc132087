"""GPU tier: CP parity on CUDA (one process, several ranks on one GPU over gloo, NCCL on 2 GPUs).

Skipped without CUDA. Run on a GPU machine with ``PYTHONPATH=src pytest -m gpu tests/gpu``.
"""

from __future__ import annotations

import pytest
import torch
from _gpu_fns import cp_case, gloo_one_gpu_rank, nccl_rank

from cpshard.names import METHOD_NAMES as METHODS
from cpshard.tools.launch import LocalRanks

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("method", METHODS)
def test_single_gpu_matches_reference(dtype: torch.dtype, method: str) -> None:
    cp_case(1, 0, dtype, method, "cuda")


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_several_ranks_on_one_gpu_over_gloo(world: int, dtype: str) -> None:
    """NCCL refuses two ranks per GPU: gloo with host-staged collectives must work instead."""
    methods = [m for m in METHODS if m != "ulysses" or 4 % world == 0]  # ulysses splits 4 kv heads
    with LocalRanks(world, pg_timeout_s=120.0, start_method="spawn") as ranks:
        ranks.run(gloo_one_gpu_rank, dtype, methods)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
@pytest.mark.parametrize("method", METHODS)
def test_nccl_two_gpus_match_reference(method: str) -> None:
    with LocalRanks(2, backend="nccl", start_method="spawn", pg_timeout_s=120.0) as ranks:
        ranks.run(nccl_rank, method)
