"""The vectorized paths of the scale work (issue 25) against the paths they replace.

Every rank at once (rank blocks) vs rank by rank for several row groups; a rank's query runs cut
from the stream's table vs its own run table; every rank's keys joined where they touch vs one
interval per run; masks and task lists vs the rule; the collector pause; the fingerprint's shared
position keys vs keys made per tensor.
"""

from __future__ import annotations

import dataclasses
import gc

import numpy as np
import pytest
import torch

from _attention_common import visible
from cpshard.attention.pieces import _gc_paused, run_table
from cpshard.attention.plan import attention_plan, block_table, host_rows, stream_table
from cpshard.attention.selective_plan import exchange_counts, exchange_sums, meta_arrays, wanted_of
from cpshard.attention.visibility import KeyCounts, RankRuns, _joined
from cpshard.sharding.consistency import _content_hash, batch_fingerprint
from cpshard.sharding.meta import TokenMeta

CPU = torch.device("cpu")
MASKS = ((True, None), (True, 1), (True, 3), (False, None))


def _rows(rng: np.random.Generator) -> tuple[int, np.ndarray, np.ndarray]:
    """``(C, pos [B, C*L], doc [B, C*L])``: rows of documents and pads, permuted rank-major."""
    world, local, rows = int(rng.integers(1, 6)), int(rng.integers(1, 14)), int(rng.integers(2, 5))
    s = world * local
    pos_rows, doc_rows = [], []
    for _ in range(rows):
        doc = np.cumsum(rng.random(s) < 0.2).astype(np.int64)
        pos = np.arange(s)
        pads = int(rng.integers(0, s // 2 + 1))
        doc[s - pads :] = -1 - pos[s - pads :]
        perm = rng.permutation(s) if rng.random() < 0.5 else np.arange(s)
        pos_rows.append(pos[perm])
        doc_rows.append(doc[perm])
    return world, np.stack(pos_rows), np.stack(doc_rows)


@pytest.mark.parametrize("seed", range(6))
def test_rank_blocks_of_several_row_groups_answer_as_rank_by_rank(seed: int) -> None:
    rng = np.random.default_rng(seed)
    for _ in range(25):
        world, pos, doc = _rows(rng)
        meta = TokenMeta(0, world, torch.from_numpy(pos), torch.from_numpy(doc))
        a = meta_arrays(meta)
        assert all(r.blocked for r in a.runs)
        loops = dataclasses.replace(
            a, runs=tuple(RankRuns(r.runs, world, a.frame, blocked=False) for r in a.runs)
        )
        for causal, window in MASKS:
            np.testing.assert_array_equal(
                exchange_counts(a, causal, window), exchange_counts(loops, causal, window)
            )
            for got, want in zip(
                exchange_sums(a, causal, window), exchange_sums(loops, causal, window), strict=True
            ):
                np.testing.assert_array_equal(got, want)
            for r in range(world):
                got, want = wanted_of(a, r, causal, window), wanted_of(loops, r, causal, window)
                assert len(got) == len(want) == world
                for g, w in zip(got, want, strict=True):
                    np.testing.assert_array_equal(g, w)


@pytest.mark.parametrize("seed", range(4))
def test_a_ranks_runs_from_the_stream_table_equal_its_own_table(seed: int) -> None:
    rng = np.random.default_rng(100 + seed)
    for _ in range(25):
        world, pos, doc = _rows(rng)
        meta = TokenMeta(0, world, torch.from_numpy(pos), torch.from_numpy(doc))
        host = host_rows(meta)
        n = meta.local_len
        for merge in (True, False):
            stream = stream_table(meta, merge)
            for r in range(world):
                sl = slice(r * n, (r + 1) * n)
                want = run_table(host.pos[:, sl], host.doc[:, sl], merge)
                got = block_table(stream, host.pos.shape[1], n, r)
                for g, w in zip(got, want, strict=True):
                    np.testing.assert_array_equal(g, w)


def test_joined_keys_count_like_the_runs() -> None:
    rng = np.random.default_rng(7)
    for _ in range(200):
        k = int(rng.integers(1, 12))
        lo = np.sort(rng.integers(0, 40, size=k))
        n = rng.integers(1, 6, size=k)
        # touching chains, overlaps and duplicates
        lo = np.where(rng.random(k) < 0.4, np.concatenate([[lo[0]], (lo + n)[:-1]]), lo)
        order = np.argsort(lo, kind="stable")
        lo, n = lo[order], n[order]
        runs = dataclasses.make_dataclass("R", ["code", "n"])(lo, n)
        jlo, jhi = _joined(runs)  # type: ignore[arg-type]
        assert jlo.size <= lo.size
        whole, joined = KeyCounts(lo, lo + n), KeyCounts(jlo, jhi)
        x = np.arange(-2, 50)
        np.testing.assert_array_equal(whole.below(x), joined.below(x))
        u = rng.integers(-2, 50, size=30)
        v = u + rng.integers(0, 20, size=30)
        np.testing.assert_array_equal(whole.range_sum(u, v), joined.range_sum(u, v))


@pytest.mark.parametrize("window", [None, 2, 5])
def test_masks_and_tasks_cover_exactly_the_visible_pairs(window: int | None) -> None:
    """Every task of every method's plan, masks included, against the rule: the union of the
    tasks' visible cells is the visible set, and no cell is computed twice."""
    rng = np.random.default_rng(3 if window is None else window)
    for _ in range(15):
        world, pos, doc = _rows(rng)
        n = pos.shape[1] // world
        for r in range(world):
            meta = TokenMeta(r, world, torch.from_numpy(pos), torch.from_numpy(doc))
            plans = attention_plan(meta).ring(True, window, CPU)
            for b, plan in enumerate(plans):
                ks = slice(b * n, (b + 1) * n)
                qs = slice(r * n, (r + 1) * n)
                for rows, tasks in plan.groups:
                    for row in range(pos.shape[0]) if rows is None else rows.tolist():
                        want = visible(pos[row, qs], doc[row, qs], pos[row, ks], doc[row, ks],
                                       True, window)  # fmt: skip
                        got = np.zeros_like(want, dtype=np.int64)
                        for t in tasks:
                            cell = np.ones((t.q1 - t.q0, t.k1 - t.k0), dtype=bool)
                            if t.causal:
                                cell = np.tril(cell)
                            if t.mask is not None:
                                assert tuple(t.mask.shape) == (1, *cell.shape)
                                cell = t.mask[0].numpy()
                            got[t.q0 : t.q1, t.k0 : t.k1] += cell
                        assert got.max(initial=0) <= 1
                        np.testing.assert_array_equal(got.astype(bool), want)


def test_gc_pause_restores_the_collector() -> None:
    assert gc.isenabled()
    with _gc_paused():
        assert not gc.isenabled()
    assert gc.isenabled()
    with pytest.raises(RuntimeError, match="inside"), _gc_paused():
        raise RuntimeError("inside")
    assert gc.isenabled()
    gc.disable()
    try:
        with _gc_paused():
            pass
        assert not gc.isenabled()  # was off: left off
    finally:
        gc.enable()


def test_shared_position_keys_hash_like_keys_per_tensor() -> None:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 1000, (4, 64), generator=g)
    tensors = [
        ids, ids.clone(), torch.rand(4, 64, generator=g), torch.ones(4, 64, dtype=torch.bool),
        torch.rand(3, 7, generator=g),
    ]  # fmt: skip
    keys: dict[object, torch.Tensor] = {}
    for t in tensors:
        assert int(_content_hash(t, keys)) == int(_content_hash(t))
    batch = {"input_ids": ids, "labels": ids.flip(1), "attention_mask": torch.ones(4, 64).long()}
    one = batch_fingerprint(batch, layout="auto", attention="auto", padding_token_id=0)
    changed = dict(batch, labels=batch["labels"].clone())
    changed["labels"][2, 5] += 1
    two = batch_fingerprint(changed, layout="auto", attention="auto", padding_token_id=0)
    assert not torch.equal(one, two)
