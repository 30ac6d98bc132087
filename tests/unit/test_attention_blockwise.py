"""The NaN guard of :mod:`cpshard.attention.blockwise` shared by the key blocks of one call.

One :class:`BadQueries` serves every key block of an attention call (the ring's hops, the
local and remote keys): its query rows are found once, and every block's result is exactly what
that block gives with its own guard. Packed rows of several documents (masked tiles), per-row
groups and a slot order (Ulysses' stream) are covered; the other documents stay clean.
"""

from __future__ import annotations

import pytest
import torch

from _attention_common import inputs, make_case, make_meta
from cpshard.attention.blockwise import BadQueries, attend, attend_backward_into
from cpshard.attention.plan import AttentionPlan, PairPlan

CPU = torch.device("cpu")


def _exact(got: torch.Tensor, want: torch.Tensor) -> None:
    torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True)


def _blocks(which: str) -> tuple[list[PairPlan], torch.Tensor, list[torch.Tensor]]:
    """``(plans, query slots, key slots per plan)`` of rank 0 of a random 2-rank layout: the
    ring's two hops (one group per batch row), or Ulysses' stream (a slot order per row)."""
    rmap, docs = make_case("random", 2, 45, 2, 6, 0, 2)
    plan = AttentionPlan(make_meta(rmap, docs, 0))
    if which == "ring":
        return list(plan.ring(True, None, CPU)), rmap[0], [rmap[0], rmap[1]]
    stream = rmap.reshape(-1)
    return [plan.ulysses(True, None, CPU)], stream, [stream]


@pytest.mark.parametrize("which", ["ring", "ulysses"])
@pytest.mark.parametrize("bad", ["none", "q", "k", "v", "go"])
def test_one_guard_per_call_gives_each_block_its_own_result(which: str, bad: str) -> None:
    plans, qi, kis = _blocks(which)
    q, k, v, go = inputs(2, 4, 2, 48, 8, 0)
    if bad != "none":
        {"q": q, "k": k, "v": v, "go": go}[bad][0, 1, 20, 3] = float("nan")
    ql, gl = q.index_select(2, qi), go.index_select(2, qi)
    fwd = BadQueries.forward(ql)
    outs = []
    for plan, ki in zip(plans, kis, strict=True):
        kb, vb = k.index_select(2, ki), v.index_select(2, ki)
        shared = attend(ql, kb, vb, plan, scale=0.3, bad_q=fwd)
        own = attend(ql, kb, vb, plan, scale=0.3)
        for got, want in zip(shared, own, strict=True):
            _exact(got, want)
        outs.append(own)
    assert fwd.get() is fwd.get()  # found once, then reused
    out, lse = outs[0]
    for o, l_ in outs[1:]:  # the merged output and lse over the blocks
        w = torch.logaddexp(lse, l_)
        out = out * (lse - w).exp().unsqueeze(-1) + o * (l_ - w).exp().unsqueeze(-1)
        lse = w
    bwd = BadQueries.backward(gl, ql, out, lse)
    for plan, ki in zip(plans, kis, strict=True):
        kb, vb = k.index_select(2, ki), v.index_select(2, ki)
        grads = []
        for guard in (bwd, None):
            dq, dk, dv = torch.zeros_like(ql), torch.zeros_like(kb), torch.zeros_like(vb)
            attend_backward_into(gl, ql, kb, vb, out, lse, plan, dq, dk, dv, scale=0.3,
                                 bad_q=guard)  # fmt: skip
            grads.append((dq, dk, dv))
        for got, want in zip(*grads, strict=True):
            _exact(got, want)
        if bad == "none":
            assert all(not g.isnan().any() for g in grads[0])
        else:  # one document is NaN, the others are not
            assert any(g.isnan().any() for g in grads[0])
            assert any(not g.isnan().all() for g in grads[0])
