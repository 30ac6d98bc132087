"""GPU tier: every fused CUDA backend and flash varlen against an fp64 reference, fwd + bwd.

Skipped without CUDA. Covers GQA (Hq = 2 * Hkv), a head dim that needs padding (12), causal square
tiles, masked tiles with a query that sees nothing, backward from an LSE merged over two key
blocks (how ring / all_gather call it), and varlen runs with Lq < Lk, Lq > Lk, empty runs.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from torch.testing import assert_close

from _varlen import varlen_attention, varlen_attention_backward
from cpshard.attention.kernels import block_attention, block_attention_backward, pick_backend
from cpshard.attention.merge import merge

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]
TOL = {torch.float32: 2e-3, torch.bfloat16: 4e-2, torch.float16: 1e-2}
CASES = [  # backend, dtype
    ("cuda_flash", torch.bfloat16),
    ("cuda_flash", torch.float16),
    ("cuda_efficient", torch.float32),
    ("cuda_efficient", torch.bfloat16),
    ("cudnn", torch.bfloat16),
    ("math", torch.float32),
]


def _qkv(lq: int, lk: int, d: int, seed: int = 0) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(2, 4, lq, d, generator=g, dtype=torch.float64)
    k = torch.randn(2, 2, lk, d, generator=g, dtype=torch.float64)
    v = torch.randn(2, 2, lk, d, generator=g, dtype=torch.float64)
    go = torch.randn(2, 4, lq, d, generator=g, dtype=torch.float64)
    return q, k, v, go


def _ref(q, k, v, vis, scale):  # type: ignore[no-untyped-def]
    """fp64 ``out [B, Hq, Lq, D]`` and ``lse [B, Hq, Lq]``; ``vis`` bool ``[Lq, Lk]``."""
    g = q.shape[1] // k.shape[1]
    s = (q @ k.repeat_interleave(g, 1).transpose(-1, -2)) * scale
    s = s.masked_fill(~vis, float("-inf"))
    lse = torch.logsumexp(s, -1)
    p = torch.exp(s - torch.where(torch.isneginf(lse), 0.0, lse)[..., None])
    return p @ v.repeat_interleave(g, 1), lse


def _close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype, what: str) -> None:
    tol = TOL[dtype]
    assert_close(got.double().cpu(), want, rtol=tol, atol=tol, msg=lambda m: f"{what}: {m}")


@pytest.mark.parametrize(("backend", "dtype"), CASES)
@pytest.mark.parametrize("head_dim", [64, 12])
@pytest.mark.parametrize("kind", ["full", "causal", "masked"])
def test_block_matches_fp64(backend: str, dtype: torch.dtype, head_dim: int, kind: str) -> None:
    lq, lk = (40, 40) if kind == "causal" else (40, 56)
    q, k, v, go = _qkv(lq, lk, head_dim)
    vis = torch.ones(lq, lk, dtype=torch.bool)
    mask = None
    if kind == "causal":
        vis = vis.tril()
    if kind == "masked":
        vis = torch.rand(lq, lk, generator=torch.Generator().manual_seed(1)) > 0.5
        vis[3] = False  # a query that sees nothing in this block
        mask = vis[None].cuda()
    qr, kr, vr = (t.clone().requires_grad_() for t in (q, k, v))
    ref_out, ref_lse = _ref(qr, kr, vr, vis, 0.3)
    keep = vis.any(-1)
    want = torch.autograd.grad(ref_out[:, :, keep], (qr, kr, vr), go[:, :, keep])
    qc, kc, vc = (t.to("cuda", dtype) for t in (q, k, v))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # math on CUDA warns by design
        out, lse = block_attention(
            qc,
            kc,
            vc,
            mask=mask,
            is_causal=kind == "causal",
            scale=0.3,
            backend=backend,  # type: ignore[arg-type]
        )
        assert out.shape == q.shape
        assert out.dtype == dtype
        assert lse.shape == (2, 4, lq)
        assert lse.dtype == torch.float32
        _close(out[:, :, keep], ref_out.detach()[:, :, keep], dtype, "out")
        _close(lse[:, :, keep], ref_lse.detach()[:, :, keep], dtype, "lse")
        if not keep.all():
            assert torch.isneginf(lse[:, :, ~keep.cuda()]).all()
            assert (out[:, :, ~keep.cuda()] == 0).all()
        grads = block_attention_backward(
            go.to("cuda", dtype), qc, kc, vc, out, lse, mask=mask, is_causal=kind == "causal",
            scale=0.3, backend=backend,  # type: ignore[arg-type]
        )  # fmt: skip
    for name, g, w in zip(("dq", "dk", "dv"), grads, want, strict=True):
        _close(g, w, dtype, f"{backend} {dtype} {kind} {name}")


@pytest.mark.parametrize(("backend", "dtype"), CASES[:4])
def test_backward_from_merged_lse(backend: str, dtype: torch.dtype) -> None:
    """Two key blocks (a causal diagonal + a fully visible one) merged; grads add up exactly."""
    q, k, v, go = _qkv(32, 64, 64, seed=3)
    vis = torch.cat([torch.ones(32, 32, dtype=torch.bool), torch.ones(32, 32).tril().bool()], 1)
    qr, kr, vr = (t.clone().requires_grad_() for t in (q, k, v))
    ref_out, _ = _ref(qr, kr, vr, vis, 0.125)
    want = torch.autograd.grad(ref_out, (qr, kr, vr), go)
    qc, kc, vc, gc = (t.to("cuda", dtype) for t in (q, k, v, go))
    parts = [(slice(0, 32), False), (slice(32, 64), True)]
    res = [
        block_attention(qc, kc[:, :, s], vc[:, :, s], mask=None, is_causal=c, scale=0.125,
                        backend=backend)  # type: ignore[arg-type]
        for s, c in parts
    ]  # fmt: skip
    out, lse = merge(res[0][0], res[0][1], res[1][0], res[1][1])
    _close(out, ref_out.detach(), dtype, "merged out")
    dq = torch.zeros(q.shape, device="cuda")
    dk = torch.zeros(k.shape, device="cuda")
    dv = torch.zeros(v.shape, device="cuda")
    for s, c in parts:
        gq, gk, gv = block_attention_backward(
            gc, qc, kc[:, :, s], vc[:, :, s], out.to(dtype), lse, mask=None, is_causal=c,
            scale=0.125, backend=backend,  # type: ignore[arg-type]
        )  # fmt: skip
        dq += gq
        dk[:, :, s] += gk
        dv[:, :, s] += gv
    for name, g, w in zip(("dq", "dk", "dv"), (dq, dk, dv), want, strict=True):
        _close(g, w, dtype, f"{backend} {name}")


def test_auto_picks_fused_kernels() -> None:
    q16 = torch.zeros(1, 2, 8, 64, device="cuda", dtype=torch.bfloat16)
    major = torch.cuda.get_device_capability()[0]
    assert pick_backend(q16) == ("cuda_flash" if major >= 8 else "math")
    assert pick_backend(q16.float()) == "cuda_efficient"
    assert pick_backend(q16.float(), masked=True) == "cuda_efficient"
    with pytest.warns(RuntimeWarning, match="fp32/fp16/bf16"):
        assert pick_backend(q16.double()) == "math"


RUNS = [(30, 50), (40, 20), (64, 64), (1, 1), (0, 7), (5, 0), (3, 90)]


def _cu(lens: list[int]) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)


def _varlen_case(
    runs: list[tuple[int, int]], dtype: torch.dtype, causal: bool, head_dim: int
) -> None:
    """CUDA varlen vs the exact CPU varlen (fp64) on packed runs ``(Lq, Lk)``, GQA 4/2."""
    g = torch.Generator().manual_seed(5)
    tq, tk = sum(r[0] for r in runs), sum(r[1] for r in runs)
    q = torch.randn(tq, 4, head_dim, generator=g, dtype=torch.float64)
    k = torch.randn(tk, 2, head_dim, generator=g, dtype=torch.float64)
    v = torch.randn(tk, 2, head_dim, generator=g, dtype=torch.float64)
    go = torch.randn(tq, 4, head_dim, generator=g, dtype=torch.float64)
    cu_q, cu_k = _cu([r[0] for r in runs]), _cu([r[1] for r in runs])
    mq, mk = max(r[0] for r in runs), max(r[1] for r in runs)
    kw = {"causal": causal, "scale": 0.2}
    ref_out, ref_lse = varlen_attention(q, k, v, cu_q, cu_k, mq, mk, **kw)  # type: ignore[arg-type]
    ref_grads = varlen_attention_backward(go, q, k, v, ref_out, ref_lse, cu_q, cu_k, mq, mk, **kw)  # type: ignore[arg-type]
    qc, kc, vc, gc = (t.to("cuda", dtype) for t in (q, k, v, go))
    cq, ckk = cu_q.cuda(), cu_k.cuda()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # fp32 varlen on CUDA warns that it loops per run
        out, lse = varlen_attention(qc, kc, vc, cq, ckk, mq, mk, **kw)  # type: ignore[arg-type]
        grads = varlen_attention_backward(gc, qc, kc, vc, out, lse, cq, ckk, mq, mk, **kw)  # type: ignore[arg-type]
    assert out.shape == q.shape
    assert lse.shape == (4, tq)
    assert lse.dtype == torch.float32
    empty = torch.isneginf(ref_lse)
    assert torch.equal(torch.isneginf(lse).cpu(), empty)
    _close(out, ref_out, dtype, "varlen out")
    _close(lse.masked_fill(empty.cuda(), 0.0), ref_lse.masked_fill(empty, 0.0), dtype, "lse")
    for name, gg, w in zip(("dq", "dk", "dv"), grads, ref_grads, strict=True):
        _close(gg, w, dtype, f"varlen {dtype} {name}")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("head_dim", [64, 12])
def test_varlen_matches_cpu_reference(dtype: torch.dtype, causal: bool, head_dim: int) -> None:
    """CUDA varlen (flash for fp16/bf16, the per-run loop for fp32) vs the exact CPU varlen."""
    assert any(r[0] > r[1] > 0 for r in RUNS)  # causal rows that see nothing (bottom-right)
    _varlen_case(RUNS, dtype, causal, head_dim)


@pytest.mark.parametrize("causal", [True, False])
def test_varlen_single_query_runs_with_gqa(causal: bool) -> None:
    """max_q == 1, GQA and a run without queries: flash's single-query GQA path must not run.

    (torch's mha_varlen_fwd reshapes q to [n_runs, Hkv, G, D] when max_q == 1, which fails with
    Tq < n_runs; cuda_kernels passes a bound of 2 instead.)
    """
    _varlen_case([(1, 5), (0, 3), (1, 1), (1, 0), (1, 9)], torch.bfloat16, causal, 64)


@pytest.mark.parametrize("lk", [1, 17])
def test_flash_single_query_block_with_gqa(lk: int) -> None:
    """Lq == 1 with GQA takes flash's swapped-heads path (and drops causal when Lk == 1)."""
    q, k, v, go = _qkv(1, lk, 64, seed=9)
    vis = torch.ones(1, lk, dtype=torch.bool)
    qr, kr, vr = (t.clone().requires_grad_() for t in (q, k, v))
    ref_out, ref_lse = _ref(qr, kr, vr, vis, 0.125)
    want = torch.autograd.grad(ref_out, (qr, kr, vr), go)
    qc, kc, vc, gc = (t.to("cuda", torch.bfloat16) for t in (q, k, v, go))
    out, lse = block_attention(
        qc, kc, vc, mask=None, is_causal=lk == 1, scale=0.125, backend="cuda_flash"
    )
    assert lse.shape == (2, 4, 1)
    _close(out, ref_out.detach(), torch.bfloat16, "out")
    _close(lse, ref_lse.detach(), torch.bfloat16, "lse")
    grads = block_attention_backward(
        gc, qc, kc, vc, out, lse, mask=None, is_causal=lk == 1, scale=0.125, backend="cuda_flash"
    )
    for name, g, w in zip(("dq", "dk", "dv"), grads, want, strict=True):
        _close(g, w, torch.bfloat16, f"Lq=1 {name}")
