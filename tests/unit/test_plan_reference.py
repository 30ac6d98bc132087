"""The plan builder against a brute-force dense mask: every visible pair exactly once, nothing else.

Random document layouts (1-token documents, padding stretches inside and at the end of rows,
rows of one batch that differ), random rank maps (sorted runs with gaps, head-tail, contiguous),
windows and causal / bidirectional attention, C = 1..5, every method's plans of every rank.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from _attention_common import visible
from cpshard.attention.pieces import PAD_TILE
from cpshard.attention.plan import AttentionPlan, PairPlan
from cpshard.layouts.closed_form import ContiguousLayout, RoundRobinLayout
from cpshard.sharding.meta import TokenMeta, pad_document_ids

CPU = torch.device("cpu")


def _docs(rng: np.random.Generator, n: int) -> torch.Tensor:
    """``[n]`` document ids (>= 0) with pad stretches marked ``-1`` (made unique below)."""
    ids = np.empty(n, dtype=np.int64)
    i = doc = 0
    while i < n:
        length = int(rng.choice([1, 1, 2, 3, int(rng.integers(1, 40)), int(rng.integers(1, 200))]))
        pad = rng.random() < 0.25
        ids[i : i + length] = -1 if pad else doc
        doc += 0 if pad else 1
        i += length
    return torch.from_numpy(ids)


def _rank_map(rng: np.random.Generator, kind: str, world: int, n: int) -> torch.Tensor:
    if kind == "round_robin":
        return RoundRobinLayout().rank_map(world, n)
    if kind == "contiguous":
        return ContiguousLayout().rank_map(world, n)
    perm = torch.from_numpy(rng.permutation(n)).view(world, -1)
    return torch.sort(perm, dim=1).values  # runs of consecutive positions with gaps


def _meta(rng: np.random.Generator, world: int, rank: int, kind: str, rows: int) -> TokenMeta:
    n = 2 * world * int(rng.integers(5, 60))
    rmap = _rank_map(rng, kind, world, n)
    raw = torch.stack([_docs(rng, n) for _ in range(rows)])
    docs = pad_document_ids(raw.clamp(min=0), raw < 0)
    stream = rmap.reshape(-1)
    pos = stream[None].expand(rows, -1).contiguous()
    return TokenMeta(rank, world, pos, docs[:, stream].contiguous())


def _coverage(plan: PairPlan, row: int, nq: int, nk: int) -> torch.Tensor:
    """How often the plan's kernels compute each (query slot, key slot) pair of batch row
    ``row``, in the tensors' own slot order."""
    cover = torch.zeros(nq, nk, dtype=torch.long)
    for g, (rows, tasks) in enumerate(plan.groups):
        if rows is not None and row not in rows.tolist():
            continue
        order = plan.order_of(g)
        qs = torch.arange(nq) if order is None else order
        ks = torch.arange(nk) if order is None else order
        for t in tasks:
            n_q, n_k = t.q1 - t.q0, t.k1 - t.k0
            if t.mask is not None:
                tile = t.mask[0].long()
            elif t.causal:
                tile = torch.ones(n_q, n_k, dtype=torch.long).tril()
            else:
                tile = torch.ones(n_q, n_k, dtype=torch.long)
            sub = torch.zeros(nq, nk, dtype=torch.long)
            sub[t.q0 : t.q1, t.k0 : t.k1] = tile
            cover[qs[:, None], ks[None, :]] += sub
    return cover


def _check(meta: TokenMeta, causal: bool, window: int | None) -> None:
    plan = AttentionPlan(meta)
    n, r, c = meta.local_len, meta.rank, meta.world_size
    for row in range(meta.positions.shape[0]):
        pos, doc = meta.positions[row], meta.document_ids[row]
        lq = slice(r * n, (r + 1) * n)
        want_stream = visible(pos[lq], doc[lq], pos, doc, causal, window).long()
        ring = plan.ring(causal, window, CPU)
        got = torch.cat([_coverage(p, row, n, n) for p in ring], dim=1)
        assert torch.equal(got, want_stream), ("ring", row)
        local, remote = plan.all_gather_split(causal, window, CPU)
        assert local is ring[r]
        split = _coverage(remote, row, n, c * n)
        split[:, lq] += _coverage(local, row, n, n)
        assert torch.equal(split, want_stream), ("all_gather_split", row)
        whole = plan.all_gather(causal, window, CPU)
        assert torch.equal(_coverage(whole, row, n, c * n), want_stream), ("all_gather", row)
        want_all = visible(pos, doc, pos, doc, causal, window).long()
        uly = plan.ulysses(causal, window, CPU)
        assert torch.equal(_coverage(uly, row, c * n, c * n), want_all), ("ulysses", row)
    rows = meta.positions.shape[0]
    pos, doc = meta.positions, meta.document_ids
    needed = sum(
        int(visible(pos[b, lq], doc[b, lq], pos[b], doc[b], causal, window).sum())
        for b in range(rows)
    )
    assert whole.needed == needed
    assert sum(p.needed for p in ring) == needed
    assert local.needed + remote.needed == needed
    for p in (*ring, remote, whole, uly):
        assert p.computed >= p.needed
        assert p.empty == all(not t for _, t in p.groups)


@pytest.mark.parametrize("world", [1, 2, 3, 4, 5])
@pytest.mark.parametrize("kind", ["runs", "round_robin", "contiguous"])
def test_plan_matches_dense_reference(world: int, kind: str) -> None:
    rng = np.random.default_rng(world * 10 + len(kind))
    for trial in range(2):
        rank = int(rng.integers(world))
        meta = _meta(rng, world, rank, kind, rows=1 + trial % 2)
        for causal, window in [(True, None), (False, None), (True, 1), (True, 37)]:
            _check(meta, causal, window)


def test_pad_stretch_is_one_run_not_one_document_per_token() -> None:
    """4096 pads against themselves: 16 identity tiles sharing one mask, not 4096 documents."""
    n = 8192
    docs = pad_document_ids(torch.zeros(1, n, dtype=torch.long), torch.arange(n)[None] >= 4096)
    plan = AttentionPlan(TokenMeta(0, 1, torch.arange(n)[None], docs))
    (_, tasks), = plan.all_gather(True, None, CPU).groups  # fmt: skip
    masked = [t for t in tasks if t.mask is not None]
    assert len(tasks) == 1 + 4096 // PAD_TILE and len(masked) == 4096 // PAD_TILE
    assert len({t.mask.untyped_storage().data_ptr() for t in masked if t.mask is not None}) == 1


def test_negative_ids_that_are_not_pads_stay_documents() -> None:
    """A negative id that is not ``-1 - position`` is an ordinary document (here two tokens of
    document -7 that see each other)."""
    pos = torch.arange(6)[None]
    docs = torch.tensor([[0, 0, -7, -7, -5, -6]])  # -6 at position 5 is a pad, -5 at 4 too
    meta = TokenMeta(0, 1, pos, docs)
    _check(meta, True, None)
    _check(meta, False, None)
