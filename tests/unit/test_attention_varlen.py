"""Packed document runs (varlen) on CPU against an fp64 dense reference, forward and backward."""

from __future__ import annotations

import pytest
import torch

from _varlen import varlen_attention, varlen_attention_backward
from cpshard.attention.kernels import block_attention, block_attention_backward
from cpshard.attention.merge import merge

BACKENDS = ("cpu_flash", "math")
# (Lq, Lk) per run: Lq < Lk, Lq > Lk, square, 1-token, empty queries, empty keys.
RUNS = [(3, 5), (4, 2), (4, 4), (1, 1), (0, 3), (2, 0), (1, 6)]


def _cu(lens: list[int]) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)


def _visible(runs: list[tuple[int, int]], causal: bool) -> torch.Tensor:
    """Dense bool [Tq, Tk]: same run and (causal) bottom-right ``j <= i + Lk - Lq``."""
    tq, tk = sum(r[0] for r in runs), sum(r[1] for r in runs)
    vis = torch.zeros(tq, tk, dtype=torch.bool)
    qa = ka = 0
    for lq, lk in runs:
        i = torch.arange(lq)[:, None]
        j = torch.arange(lk)[None, :]
        block = (j <= i + lk - lq) if causal else torch.ones(lq, lk, dtype=torch.bool)
        vis[qa : qa + lq, ka : ka + lk] = block
        qa, ka = qa + lq, ka + lk
    return vis


def _reference(q, k, v, vis, scale):  # type: ignore[no-untyped-def]
    """fp64 out [Tq, Hq, D] and lse [Hq, Tq] by explicit softmax (rows without keys: 0, -inf)."""
    g = q.shape[1] // k.shape[1]
    kr, vr = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    s = torch.einsum("qhd,khd->hqk", q, kr) * scale
    s = s.masked_fill(~vis, float("-inf"))
    lse = torch.logsumexp(s, -1)
    p = torch.exp(s - torch.where(torch.isneginf(lse), 0.0, lse)[..., None])
    return torch.einsum("hqk,khd->qhd", p, vr), lse


def _inputs(runs: list[tuple[int, int]], seed: int = 0) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    tq, tk = sum(r[0] for r in runs), sum(r[1] for r in runs)
    q = torch.randn(tq, 4, 6, generator=gen, dtype=torch.float64)
    k = torch.randn(tk, 2, 6, generator=gen, dtype=torch.float64)
    v = torch.randn(tk, 2, 6, generator=gen, dtype=torch.float64)
    go = torch.randn(tq, 4, 6, generator=gen, dtype=torch.float64)
    return q, k, v, go


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("causal", [True, False])
def test_varlen_matches_dense_reference(backend: str, causal: bool) -> None:
    q, k, v, go = _inputs(RUNS)
    cu_q, cu_k = _cu([r[0] for r in RUNS]), _cu([r[1] for r in RUNS])
    vis = _visible(RUNS, causal)
    qr, kr, vr = (t.clone().requires_grad_() for t in (q, k, v))
    ref_out, ref_lse = _reference(qr, kr, vr, vis, 0.4)
    want = torch.autograd.grad(ref_out, (qr, kr, vr), go)
    out, lse = varlen_attention(
        q, k, v, cu_q, cu_k, 4, 6, causal=causal, scale=0.4, backend=backend,  # type: ignore[arg-type]
    )  # fmt: skip
    assert out.shape == q.shape
    assert lse.shape == (4, q.shape[0])
    assert lse.dtype == torch.float64
    torch.testing.assert_close(out, ref_out.detach())
    torch.testing.assert_close(lse, ref_lse.detach())  # -inf rows compare equal
    empty = ~vis.any(-1)
    assert empty.any()  # the case covers queries without keys
    assert torch.equal(out[empty], torch.zeros_like(out[empty]))
    grads = varlen_attention_backward(
        go, q, k, v, out, lse, cu_q, cu_k, 4, 6, causal=causal, scale=0.4,
        backend=backend,  # type: ignore[arg-type]
    )  # fmt: skip
    for got, ref in zip(grads, want, strict=True):
        torch.testing.assert_close(got.double(), ref)


@pytest.mark.parametrize("backend", BACKENDS)
def test_varlen_backward_with_lse_merged_over_more_keys(backend: str) -> None:
    """As CP uses it: runs merged with another key block; per-part grads add up to full."""
    runs = [(3, 5), (2, 2), (4, 4)]
    q, k, v, go = _inputs(runs, seed=1)
    gen = torch.Generator().manual_seed(2)
    k2 = torch.randn(1, 2, 3, 6, generator=gen, dtype=torch.float64)  # seen by every query
    v2 = torch.randn(1, 2, 3, 6, generator=gen, dtype=torch.float64)
    cu_q, cu_k = _cu([r[0] for r in runs]), _cu([r[1] for r in runs])
    vis = torch.cat([_visible(runs, True), torch.ones(q.shape[0], 3, dtype=torch.bool)], 1)
    qr, kr, vr, k2r, v2r = (t.clone().requires_grad_() for t in (q, k, v, k2, v2))
    kall = torch.cat([kr, k2r[0].transpose(0, 1)], 0)
    vall = torch.cat([vr, v2r[0].transpose(0, 1)], 0)
    ref_out, _ = _reference(qr, kall, vall, vis, 0.3)
    want = torch.autograd.grad(ref_out, (qr, kr, vr, k2r, v2r), go)

    o1, l1 = varlen_attention(q, k, v, cu_q, cu_k, 4, 5, causal=True, scale=0.3, backend=backend)  # type: ignore[arg-type]
    qb = q.transpose(0, 1)[None]
    o2, l2 = block_attention(qb, k2, v2, mask=None, is_causal=False, scale=0.3, backend=backend)  # type: ignore[arg-type]
    out_b, lse_b = merge(o1.transpose(0, 1)[None], l1[None], o2, l2)
    out, lse = out_b[0].transpose(0, 1), lse_b[0]
    torch.testing.assert_close(out, ref_out.detach())
    dq, dk, dv = varlen_attention_backward(
        go, q, k, v, out, lse, cu_q, cu_k, 4, 5, causal=True, scale=0.3,
        backend=backend,  # type: ignore[arg-type]
    )  # fmt: skip
    dq2, dk2, dv2 = block_attention_backward(
        go.transpose(0, 1)[None], qb, k2, v2, out_b, lse_b, mask=None, is_causal=False,
        scale=0.3, backend=backend,  # type: ignore[arg-type]
    )  # fmt: skip
    got = (dq + dq2[0].transpose(0, 1), dk, dv, dk2, dv2)
    for g_, r in zip(got, want, strict=True):
        torch.testing.assert_close(g_.double(), r)


def test_varlen_bf16_matches_fp64() -> None:
    q, k, v, _ = _inputs(RUNS)
    cu_q, cu_k = _cu([r[0] for r in RUNS]), _cu([r[1] for r in RUNS])
    out, lse = varlen_attention(
        q.bfloat16(), k.bfloat16(), v.bfloat16(), cu_q, cu_k, 4, 6, causal=True, scale=0.4
    )
    ref_out, ref_lse = _reference(q, k, v, _visible(RUNS, True), 0.4)
    assert out.dtype == torch.bfloat16
    assert lse.dtype == torch.float32
    torch.testing.assert_close(out.double(), ref_out, atol=3e-2, rtol=3e-2)
    torch.testing.assert_close(lse.double(), ref_lse, atol=3e-2, rtol=3e-2)


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"cu_q": torch.tensor([0, 3, 5])}, "int32"),
        ({"cu_q": torch.tensor([0, 3, 6], dtype=torch.int32)}, "rise from 0"),
        ({"cu_k": torch.tensor([0, 4, 2], dtype=torch.int32)}, "rise from 0"),
        ({"cu_k": torch.tensor([0, 2], dtype=torch.int32)}, "n \\+ 1"),
        ({"max_q": 2}, "longest run"),
        ({"q": torch.zeros(5, 3, 6, dtype=torch.float64)}, "multiple of key/value heads"),
        ({"q": torch.zeros(5, 4, 4, dtype=torch.float64)}, "same D"),
    ],
)
def test_varlen_rejects_bad_input(change: dict[str, object], match: str) -> None:
    q, k, v, _ = _inputs([(3, 2), (2, 2)])
    args: dict[str, object] = {
        "q": q, "k": k, "v": v, "cu_q": _cu([3, 2]), "cu_k": _cu([2, 2]), "max_q": 3, "max_k": 2,
    }  # fmt: skip
    args.update(change)
    with pytest.raises(ValueError, match=match):
        varlen_attention(**args, causal=True, scale=0.5)  # type: ignore[arg-type]
