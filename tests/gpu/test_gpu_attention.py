"""GPU tier: CP parity on CUDA (one process, several ranks on one GPU over gloo, NCCL on 2 GPUs).

Skipped without CUDA. Run on a GPU machine with ``python3 -m pytest tests/gpu`` (or the whole
GPU check, ``bash benchmarks/gpu_check.sh``).
"""

from __future__ import annotations

import pytest
import torch
from _gpu_fns import CALL_TIMEOUT_S, PG_TIMEOUT_S, cp_case, gloo_one_gpu_rank, nccl_rank

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
def test_several_ranks_on_one_gpu_over_gloo(world: int) -> None:
    """NCCL refuses two ranks per GPU: gloo with host-staged collectives must work instead (one
    pool per world size: a spawned rank takes seconds to start)."""
    methods = [m for m in METHODS if m != "ulysses" or 4 % world == 0]  # ulysses splits 4 kv heads
    with LocalRanks(world, pg_timeout_s=PG_TIMEOUT_S, start_method="spawn") as ranks:
        for dtype in ("float32", "bfloat16"):
            ranks.run(gloo_one_gpu_rank, dtype, methods, timeout_s=CALL_TIMEOUT_S)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
@pytest.mark.parametrize("method", METHODS)
def test_nccl_two_gpus_match_reference(method: str) -> None:
    with LocalRanks(2, backend="nccl", start_method="spawn", pg_timeout_s=PG_TIMEOUT_S) as ranks:
        ranks.run(nccl_rank, method, timeout_s=CALL_TIMEOUT_S)
