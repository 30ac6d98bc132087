"""GPU tier: CP parity on CUDA (one process, several ranks on one GPU over gloo, NCCL on 2 GPUs).

Skipped without CUDA. Run on a GPU machine with ``python3 -m pytest tests/gpu`` (or the whole
GPU check, ``bash benchmarks/gpu_check.sh``).
"""

from __future__ import annotations

import pytest
import torch
from _gpu_fns import CALL_TIMEOUT_S, PG_TIMEOUT_S, cp_case, gloo_one_gpu_rank, nccl_rank

from cpshard.attention import cp_sdpa
from cpshard.names import METHOD_NAMES as METHODS
from cpshard.sharding.meta import TokenMeta
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


@pytest.mark.parametrize("method", METHODS)
def test_cuda_autocast_casts_like_sdpa(method: str) -> None:
    """Under ``torch.autocast("cuda", bf16)`` fp32 q/k with a bf16 v (an HF model after RoPE):
    CP attention (cp=1, the CUDA kernels) answers in bf16 like SDPA, within bf16 rounding (8
    bits of mantissa, another summation order: 2e-2), and ``backward()`` inside the autocast
    region gives the gradients it gives outside (the methods switch autocast off)."""
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k = (torch.randn(2, 4 * i, 64, 32, device="cuda", generator=g) for i in (2, 1))
    v = torch.randn(2, 4, 64, 32, device="cuda", generator=g).bfloat16()
    go = torch.randn(2, 8, 64, 32, device="cuda", generator=g)
    pos = torch.arange(64).view(1, -1)
    meta = TokenMeta(0, 1, pos, torch.zeros_like(pos))
    tol = {"atol": 2e-2, "rtol": 2e-2}
    grads = []
    for inside in (False, True):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = cp_sdpa(*leaves, group=None, meta=meta, method=method)
            want = torch.nn.functional.scaled_dot_product_attention(
                q, k, v, is_causal=True, enable_gqa=True
            )
            if inside:
                (out.float() * go).sum().backward()
        if not inside:
            (out.float() * go).sum().backward()
        assert out.dtype == want.dtype == torch.bfloat16
        torch.testing.assert_close(out.float(), want.float(), **tol)
        grads.append([t.grad for t in leaves])
        assert [t.grad.dtype for t in leaves] == [q.dtype, k.dtype, v.dtype]  # type: ignore[union-attr]
    for outside, inside_grad in zip(*grads, strict=True):
        torch.testing.assert_close(outside, inside_grad)
