"""2-D CP attention (Ulysses inside cp_inner x ring / selective / all_gather across cp_outer)
against one process on the full sequence: cp=4 as 2 x 2, forward and backward."""

from __future__ import annotations

import math

import pytest
import torch
from _cp2d_fns import (
    compiled_2d_case,
    cp2d_case,
    cp2d_error,
    dp_grid_case,
    grid_checks_per_ctx,
    grid_on_some_ranks_only,
    hf_cp2d_case,
    one_process_logits,
    prepare_2d_refusals,
    training_2d_case,
    u1_grid_auto_case,
)

from _attention_common import inputs, make_case, reference_with_grads
from _ranks import Ranks
from cpshard.attention.kernels import COMPILE_BEFORE_2_13

pytestmark = pytest.mark.multirank

OUTER = ("ring", "selective", "all_gather")
TOL = {"fp64": {}, "fp32": {"atol": 2e-5, "rtol": 2e-5}}
# (Hq, Hkv) -> whether the 2 x 2 grid splits the heads (Ulysses all-to-alls run) at U = 2:
# MHA, GQA with U | Hkv, GQA with Hkv < U... (kv heads repeated), MQA, and 3 query heads (no
# split: the method runs over all four ranks)
HEADS = {(4, 4): True, (4, 2): True, (6, 3): True, (4, 1): True, (3, 3): False, (3, 1): False}


def _check(
    ranks: Ranks,
    method: str,
    heads: tuple[int, int],
    layout: str = "random",
    dtype: str = "fp64",
    window: int | None = None,
    sinks: bool = False,
    meta_batch: int = 1,
    world: int = 4,
    inner: int = 2,
    causal: bool = True,
) -> None:
    seq_len = 8 * world - 3  # odd: the layout pads it (pads are their own documents)
    res = ranks(
        world, cp2d_case, inner, method, layout, seq_len, heads, dtype, 3, window, sinks,
        meta_batch, causal,
    )  # fmt: skip
    rmap, docs = make_case(layout, world, seq_len, 2, 3, 0, meta_batch)
    q, k, v, go = inputs(2, heads[0], heads[1], rmap.numel(), 8, 0)
    s = torch.linspace(-1.0, 1.0, heads[0], dtype=torch.float64) if sinks else None
    ref = _reference(q, k, v, go, docs, window, s, causal)
    split = heads[0] % inner == 0
    for r, got in enumerate(res):
        assert torch.equal(got["idx"], rmap[r])
        if method != "auto":  # Ulysses' all-to-alls (selective runs one each way of its own)
            own = 2 if method == "selective" else 0
            assert got["all_to_all"] - own == (4 if split and inner > 1 else 0), got["all_to_all"]
        for name, want in ref.items():
            want = want if name == "dsinks" else want.index_select(2, rmap[r])
            torch.testing.assert_close(
                got[name].double(), want, **TOL[dtype],
                msg=lambda m, r=r, name=name: f"rank {r} {name}: {m}",
            )  # fmt: skip


def _reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    go: torch.Tensor,
    docs: torch.Tensor,
    window: int | None,
    sinks: torch.Tensor | None,
    causal: bool,
) -> dict[str, torch.Tensor]:
    if sinks is None:
        out, dq, dk, dv = reference_with_grads(q, k, v, go, docs, causal, window=window)
        return {"out": out, "dq": dq, "dk": dk, "dv": dv}
    assert causal, "the sink reference below is causal"
    return _sink_reference(q, k, v, go, docs, window, sinks)


def _sink_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    go: torch.Tensor,
    docs: torch.Tensor,
    window: int | None,
    sinks: torch.Tensor,
) -> dict[str, torch.Tensor]:
    """Sinks: one extra logit per head (zero value row) in every query's softmax, in fp64."""
    q, k, v, s = (t.detach().clone().requires_grad_() for t in (q, k, v, sinks))
    p, g = q.shape[-2], q.shape[1] // k.shape[1]
    kk, vv = k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)
    vis = (docs[:, :, None] == docs[:, None, :]) & torch.ones(p, p, dtype=torch.bool).tril()
    if window is not None:
        pos = torch.arange(p)
        vis = vis & (pos[:, None] - pos[None, :] < window)
    sc = (q @ kk.transpose(-1, -2)) / math.sqrt(q.shape[-1])
    sc = sc.masked_fill(~vis[:, None], float("-inf"))
    sink_col = s.view(1, -1, 1, 1).expand(sc.shape[0], -1, p, 1)
    w = torch.softmax(torch.cat([sc, sink_col], dim=-1), dim=-1)[..., :p]
    out = w @ vv
    out.backward(go)
    assert q.grad is not None and k.grad is not None and v.grad is not None
    assert s.grad is not None
    return {"out": out.detach(), "dq": q.grad, "dk": k.grad, "dv": v.grad, "dsinks": s.grad}


@pytest.mark.parametrize("heads", list(HEADS))
@pytest.mark.parametrize("method", OUTER)
def test_2x2_documents_and_padding_fp64(ranks: Ranks, method: str, heads: tuple[int, int]) -> None:
    """Packed documents (a random permutation of the padded stream stands in for the packed
    layouts) and padding; every head shape, the outer method ring / selective / all_gather."""
    _check(ranks, method, heads)


@pytest.mark.parametrize("method", OUTER)
def test_2x2_round_robin_per_row_meta_fp32(ranks: Ranks, method: str) -> None:
    _check(ranks, method, (4, 2), layout="round_robin", dtype="fp32", meta_batch=2)


@pytest.mark.parametrize("method", OUTER)
def test_2x2_bidirectional_fp64(ranks: Ranks, method: str) -> None:
    _check(ranks, method, (4, 2), causal=False)


@pytest.mark.parametrize("method", ["ring", "selective"])
def test_2x2_window_and_sinks_fp64(ranks: Ranks, method: str) -> None:
    _check(ranks, method, (4, 1), window=5, sinks=True)


def test_4x1_and_1x4_grids_fp64(ranks: Ranks) -> None:
    """The degenerate grids: U = 1 is the method alone, R = 1 is Ulysses alone (GQA 4/2 and
    4 kv heads... at U = 4 one kv head per rank after repeating)."""
    _check(ranks, "ring", (4, 2), inner=1)
    _check(ranks, "ring", (4, 2), inner=4)


@pytest.mark.parametrize("heads", [(6, 2), (3, 1), (4, 2)])
def test_3_ranks_as_1x3_fp64(ranks: Ranks, heads: tuple[int, int]) -> None:
    """cp=3 as 1 x 3 (Ulysses alone over three ranks, with GQA 6/2 and MQA 3/1 whose kv heads
    it repeats); 4 query heads do not split in three: the ring over all three ranks."""
    _check(ranks, "ring", heads, world=3, inner=3)


def test_2x2_auto_picks_an_outer_method(ranks: Ranks) -> None:
    _check(ranks, "auto", (4, 2))


@pytest.mark.parametrize(
    ("method", "transpose", "match"),
    [("ulysses", False, "names the outer method"),
     ("ring", True, "row-major factoring of the CP group")],
)  # fmt: skip
def test_2x2_refusals_on_every_rank(ranks: Ranks, method: str, transpose: bool, match: str) -> None:
    msgs = ranks(4, cp2d_error, 2, method, transpose)
    assert all(match in m for m in msgs), msgs


@pytest.mark.parametrize(
    ("method", "heads", "checkpoint"),
    [("ring", 4, False), ("selective", 3, False), ("auto", 4, False), ("all_gather", 4, True)],
)
def test_hf_llama_2x2_prepare_cp_forward(
    ranks: Ranks, method: str, heads: int, checkpoint: bool
) -> None:
    """A tiny Llama (GQA 4/2; 3/1 takes the fallback) with an attention_mask batch (mixed
    padding) through prepare_cp_forward on a 2 x 2 CP mesh, against one process; once with
    gradient checkpointing (the backward's recomputation runs the 2-D attention again)."""
    want = hf_cp2d_case(None, 2, method, heads, checkpoint)
    res = ranks(4, hf_cp2d_case, 2, method, heads, checkpoint)
    for got in res:
        if method != "auto":
            own = 2 if method == "selective" else 0  # selective's own exchange, one per layer
            assert got["all_to_all"] - own == (4 if heads % 2 == 0 else 0)  # 2 layers x in, out
            # the backward's two per layer, and with checkpointing the recomputed forward's
            assert got["bwd_all_to_all"] - own == (8 if checkpoint else 4) * (heads % 2 == 0)
        torch.testing.assert_close(got["logits"], want["logits"])
        assert got["loss"] == pytest.approx(want["loss"], rel=1e-10)
    for name, g in want["grads"].items():
        torch.testing.assert_close(res[0]["grads"][name], g, msg=lambda m, n=name: f"{n}: {m}")


def test_prepare_refuses_ulysses_and_other_2d_meshes_on_every_rank(ranks: Ranks) -> None:
    for ulysses, other, sync in ranks(4, prepare_2d_refusals):
        assert "attention='ulysses' with a 2-D cp_mesh" in ulysses, ulysses
        assert "or a 2-D CP mesh with dims ('cp_outer', 'cp_inner')" in other, other
        assert "or a 2-D CP mesh with dims ('cp_outer', 'cp_inner')" in sync, sync


def test_a_grid_on_some_ranks_only_raises_on_every_rank(ranks: Ranks) -> None:
    msgs = ranks(4, grid_on_some_ranks_only)
    assert len(set(msgs)) == 1, msgs
    assert "options (ranks [0, 1] vs ranks [2, 3])" in msgs[0], msgs[0]
    assert "the same kind of cp_mesh" in msgs[0], msgs[0]


def test_the_grid_is_checked_once_per_ctx_entry(ranks: Ranks) -> None:
    """The 2-D grid's group lookups run when ctx() is entered, not in every attention call of
    it (a direct cp_sdpa call with a grid still checks it: test_2x2_refusals_on_every_rank)."""
    for at_entry, per_call in ranks(4, grid_checks_per_ctx):
        assert (at_entry, per_call) == (2, 0)


@pytest.mark.parametrize("method", ["ring", "all_gather"])
def test_2x2_training_loop_with_the_2d_mesh_in_sync_grads(ranks: Ranks, method: str) -> None:
    """prepare_cp_forward and sync_grads both given the 2 x 2 CP mesh: 3 SGD steps of a tiny
    decoder equal one process (losses and final weights)."""
    ranks(4, training_2d_case, method)


def test_auto_on_a_1_wide_cp_inner_is_1d_auto(ranks: Ranks) -> None:
    """A 4 x 1 grid is 1-D CP over the whole group (Ulysses inside a 1-wide cp_inner is the
    identity, and an explicit 'ulysses' is accepted there): 'auto' chooses as without a grid,
    Ulysses included (this call's choice: the same collectives as 1-D, all-to-alls), and the
    output and grads equal one process."""
    rmap, docs = make_case("random", 4, 200, 1, 1, 0, 1)
    q, k, v, go = inputs(1, 16, 16, rmap.numel(), 128, 0)
    want = reference_with_grads(q, k, v, go, docs, True)
    for flat, u1 in ranks(4, u1_grid_auto_case):
        assert u1["events"] == flat["events"]
        # the agreement header, then Ulysses' exchanges (q/k/v in, out; the backward's)
        assert {kind for kind, _ in flat["events"][1:]} == {"all_to_all"}
        for name, ref in zip(("out", "dq", "dk", "dv"), want, strict=True):
            torch.testing.assert_close(u1[name], ref.index_select(2, u1["idx"]), msg=name)


def test_dp_times_2d_cp_submesh(ranks: Ranks) -> None:
    """The CP sub-mesh of a (dp, cp_outer, cp_inner) mesh: each replica's CP group is two ranks
    (global ranks 0-1 and 2-3), Ulysses over both (R = 1), logits as one process."""
    want = one_process_logits("right")
    for got in ranks(4, dp_grid_case, "ring"):
        assert got["all_to_all"] == 4
        torch.testing.assert_close(got["logits"], want)


def test_2x2_compiles(ranks: Ranks) -> None:
    """torch.compile of a module under the 2 x 2 ctx(): the Ulysses exchanges trace (fullgraph
    with the all-gather outer method; torch < 2.13 refuses compiled gathering methods, so the
    ring there, which breaks the graph at its P2P calls); output and grads equal eager."""
    method, fullgraph = ("ring", False) if COMPILE_BEFORE_2_13 else ("all_gather", True)
    for (y, grads), (yc, grads_c) in ranks(4, compiled_2d_case, method, fullgraph):
        torch.testing.assert_close(yc, y)
        for name, g in grads.items():
            torch.testing.assert_close(grads_c[name], g, msg=lambda m, n=name: f"{n}: {m}")
