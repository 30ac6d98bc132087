"""The per-batch attention plan: rectangles, grouped tiles, windows, counts, bad input."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from _attention_common import reference_with_grads, visible
from cpshard.attention import cp_sdpa
from cpshard.attention.pieces import PAD_TILE
from cpshard.attention.plan import TILE, AttentionPlan, attention_plan
from cpshard.layouts.closed_form import RoundRobinLayout
from cpshard.names import METHOD_NAMES
from cpshard.sharding.meta import TokenMeta, pad_document_ids

CPU = torch.device("cpu")


def _meta(rmap: torch.Tensor, docs: torch.Tensor, rank: int = 0) -> TokenMeta:
    stream = rmap.reshape(-1)
    pos = stream[None].expand(docs.shape[0], -1).contiguous()
    return TokenMeta(rank, rmap.shape[0], pos, docs[:, stream].contiguous())


def _lognormal_docs(n: int, seed: int, pad: int = 0) -> torch.Tensor:
    """``[1, n + pad]`` ids of log-normal documents incl. 1-token ones, then ``pad`` pads."""
    rng = np.random.default_rng(seed)
    lens = [1, 1, 2]
    while sum(lens) < n:
        lens.append(int(max(1, rng.lognormal(3.0, 1.2))))
    rng.shuffle(lens)
    ids = np.repeat(np.arange(len(lens)), lens)[:n]
    docs = torch.from_numpy(np.concatenate([ids, np.zeros(pad, dtype=ids.dtype)]))[None]
    padm = torch.arange(n + pad)[None] >= n
    return pad_document_ids(docs.long(), padm)


def _visible_pairs(pq: np.ndarray, dq: np.ndarray, pk: np.ndarray, dk: np.ndarray,
                   causal: bool, window: int | None) -> int:  # fmt: skip
    vis = visible(pq, dq, pk, dk, causal, window)
    return int(vis.sum())


def test_round_robin_plan_is_mask_free_rectangles() -> None:
    rmap = RoundRobinLayout().rank_map(2, 256)  # r0 [0-63, 192-255], r1 [64-191]
    plan = AttentionPlan(_meta(rmap, torch.zeros(1, 256, dtype=torch.long)))
    ag = plan.all_gather(True, None, CPU)
    (rows, tasks), = ag.groups  # fmt: skip
    assert rows is None
    got = [(t.q0, t.q1, t.k0, t.k1, t.causal, t.mask is None) for t in tasks]
    assert got == [
        (0, 64, 0, 64, True, True),  # head diagonal
        (64, 128, 0, 64, False, True),  # tail sees the head
        (64, 128, 64, 128, True, True),  # tail diagonal
        (64, 128, 128, 256, False, True),  # tail sees all of rank 1
    ]
    ring = plan.ring(True, None, CPU)
    assert [len(p.groups[0][1]) for p in ring] == [3, 1]
    assert ag.computed == ag.needed  # causal diagonals count their triangle: nothing wasted
    assert plan.ring(False, None, CPU)[1].computed == 128 * 128


@pytest.mark.parametrize("window", [None, 1, 7, 100])
@pytest.mark.parametrize("method", METHOD_NAMES)
def test_needed_pairs_are_exact_and_tiles_bounded(method: str, window: int | None) -> None:
    world, n = 3, 600
    docs = _lognormal_docs(n, 0, pad=6)
    rmap = torch.randperm(n + 6, generator=torch.Generator().manual_seed(1)).view(world, -1)
    rmap = torch.sort(rmap, dim=1).values  # runs of consecutive positions with gaps
    for rank in range(world):
        meta = _meta(rmap, docs, rank)
        plan = AttentionPlan(meta)
        computed, needed = plan.pair_counts(method, True, window)
        pos, doc = meta.positions[0].numpy(), meta.document_ids[0].numpy()
        if method != "ulysses":
            sl = slice(rank * meta.local_len, (rank + 1) * meta.local_len)
            want = _visible_pairs(pos[sl], doc[sl], pos, doc, True, window)
        else:
            want = _visible_pairs(pos, doc, pos, doc, True, window)
        assert needed == want
        assert computed >= needed
        for p in (*plan.ring(True, window, CPU), plan.all_gather(True, window, CPU)):
            for _, tasks in p.groups:
                for t in tasks:
                    if t.mask is None:
                        continue
                    # a pad diagonal's identity mask may be longer (PAD_TILE, one shared mask)
                    eye = torch.eye(t.q1 - t.q0).bool()
                    bound = PAD_TILE if torch.equal(t.mask[0], eye) else TILE
                    assert t.mask.shape[1] <= bound and t.mask.shape[2] <= bound


@pytest.mark.parametrize("window", [None, 7])
def test_all_gather_split_is_own_block_plus_the_rest(window: int | None) -> None:
    """The overlapped all_gather runs ``local`` before its gather completes: it may only read
    this rank's own keys, ``remote`` never reads them, and together they need what the whole
    stream needs."""
    world, n = 3, 600
    docs = _lognormal_docs(n, 4, pad=6)
    rmap = torch.randperm(n + 6, generator=torch.Generator().manual_seed(3)).view(world, -1)
    rmap = torch.sort(rmap, dim=1).values
    for rank in range(world):
        plan = AttentionPlan(_meta(rmap, docs, rank))
        local, remote = plan.all_gather_split(True, window, CPU)
        assert local is plan.ring(True, window, CPU)[rank]
        whole = plan.all_gather(True, window, CPU)
        assert local.needed + remote.needed == whole.needed
        own = range(rank * plan.local_len, (rank + 1) * plan.local_len)
        for _, tasks in remote.groups:
            assert tasks
            assert all(t.k1 <= own.start or t.k0 >= own.stop for t in tasks)
        for _, tasks in local.groups:
            assert all(t.k1 <= plan.local_len for t in tasks)
    one = AttentionPlan(_meta(torch.arange(64)[None], torch.zeros(1, 64, dtype=torch.long)))
    local, remote = one.all_gather_split(True, window, CPU)
    assert remote.empty
    assert local.needed == one.all_gather(True, window, CPU).needed


def test_one_process_lognormal_documents_cost_about_what_the_mask_needs() -> None:
    docs = _lognormal_docs(16384, 3)
    plan = AttentionPlan(_meta(torch.arange(16384)[None], docs))
    computed, needed = plan.pair_counts("all_gather")
    assert computed / needed < 1.3, (computed, needed)
    _, ring_needed = plan.pair_counts("ring", True, 256)
    assert ring_needed < needed


@pytest.mark.parametrize(
    ("causal", "window", "softcap"),
    [(True, None, None), (False, None, None), (True, 3, None), (True, 40, 0.7), (False, None, 2.0)],
)
def test_plan_output_and_grads_match_fp64_reference(
    causal: bool, window: int | None, softcap: float | None
) -> None:
    n = 300
    docs = torch.cat([_lognormal_docs(n, 5, pad=4), _lognormal_docs(n, 6, pad=4)])
    rmap = torch.randperm(n + 4, generator=torch.Generator().manual_seed(2))[None]
    rmap = torch.cat([torch.sort(rmap[0, :200]).values, rmap[0, 200:]])[None]  # runs + scatter
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, n + 4, 8, generator=g, dtype=torch.float64)
    k, v = (torch.randn(2, 2, n + 4, 8, generator=g, dtype=torch.float64) for _ in range(2))
    go = torch.randn_like(q)
    ref = reference_with_grads(q, k, v, go, docs, causal, window=window, softcap=softcap)
    idx = rmap[0]
    ql, kl, vl = (t.index_select(2, idx).requires_grad_() for t in (q, k, v))
    meta = _meta(rmap, docs)
    out = cp_sdpa(ql, kl, vl, group=None, meta=meta, causal=causal, window=window, softcap=softcap)
    (out * go.index_select(2, idx)).sum().backward()
    for got, want in zip((out, ql.grad, kl.grad, vl.grad), ref, strict=True):
        torch.testing.assert_close(got, want.index_select(2, idx))


def test_plan_is_built_once_per_meta_and_reused() -> None:
    meta = _meta(torch.arange(64)[None], torch.zeros(1, 64, dtype=torch.long))
    plan = attention_plan(meta)
    assert attention_plan(meta) is plan
    assert plan.all_gather(True, 5, CPU) is plan.all_gather(True, 5, CPU)


@pytest.mark.parametrize(
    ("window", "causal", "match"),
    [(0, True, "positive int"), (-2, True, "positive int"), (2.5, True, "positive int"),
     (True, True, "positive int"), (4, False, "needs causal attention")],
)  # fmt: skip
def test_bad_window_raises(window: object, causal: bool, match: str) -> None:
    meta = _meta(torch.arange(8)[None], torch.zeros(1, 8, dtype=torch.long))
    q = torch.randn(1, 2, 8, 4)
    with pytest.raises(ValueError, match=match):
        cp_sdpa(q, q, q, group=None, meta=meta, causal=causal, window=window)  # type: ignore[arg-type]


@pytest.mark.parametrize("softcap", [0.0, -1.0, float("inf"), "50"])
def test_bad_softcap_raises(softcap: object) -> None:
    meta = _meta(torch.arange(8)[None], torch.zeros(1, 8, dtype=torch.long))
    q = torch.randn(1, 2, 8, 4)
    with pytest.raises(ValueError, match="softcap must be a positive finite number"):
        cp_sdpa(q, q, q, group=None, meta=meta, softcap=softcap)  # type: ignore[arg-type]


def test_plan_of_another_batch_raises() -> None:
    meta = _meta(torch.arange(8)[None], torch.zeros(1, 8, dtype=torch.long))
    other = _meta(torch.arange(8)[None], torch.zeros(1, 8, dtype=torch.long))
    q = torch.randn(1, 2, 8, 4)
    with pytest.raises(ValueError, match="another batch's token meta"):
        cp_sdpa(q, q, q, group=None, meta=meta, plan=attention_plan(other))
