"""The run-length routes of the prepare's attention host work against the routes they replace.

One pass over the tokens finds every row's runs (``host_rows``); the rows' grouping, the merge
verdict, the stream's run table and the selective plan's query and key runs come from them, and
several row groups are answered at once (:class:`~cpshard.attention.grouped_runs.GroupedRuns`).
Each is compared here, on random metas (several rows, pads on the right, on the left and in
holes, negative ids that are not pads, pads at repeated positions, one row of positions for
every row or one per row, world 1 to 4, windows), with the token-by-token route.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from _attention_common import same_plan
from cpshard.attention.cost import _pairs
from cpshard.attention.grouped_runs import GroupedRuns
from cpshard.attention.pieces import run_table
from cpshard.attention.plan import (
    _host_by_tokens,
    _row_groups,
    host_rows,
    join_runs,
    stream_table,
    take_spans,
)
from cpshard.attention.selective_plan import (
    _pair_plans,
    _union_sums,
    meta_arrays,
    needed_slots,
    needed_spans,
    selective_plan,
    wanted_of,
)
from cpshard.sharding.meta import TokenMeta

CPU = torch.device("cpu")
MASKS = ((True, None), (True, 1), (True, 3), (False, None))
PADS = ("none", "right", "left", "holes", "negative", "repeats")


def _meta(rng: np.random.Generator, pads: str, rank: int | None = None) -> TokenMeta:
    """A random rank-major meta of 1-4 rows (some equal), world 1-4, with padding ``pads``."""
    world, local, rows = int(rng.integers(1, 5)), int(rng.integers(1, 12)), int(rng.integers(1, 5))
    s = world * local
    shared = rng.random() < 0.5  # one row of positions for every row (the built-in layouts)
    perm = rng.permutation(s) if rng.random() < 0.7 else np.arange(s)
    pos_rows, doc_rows = [], []
    for b in range(rows):
        if b and rng.random() < 0.3:  # a row equal to an earlier one
            k = int(rng.integers(0, b))
            pos_rows.append(pos_rows[k])
            doc_rows.append(doc_rows[k])
            continue
        doc = np.cumsum(rng.random(s) < 0.15).astype(np.int64) * int(rng.integers(1, 4))
        pos = np.arange(s)
        if pads == "repeats":  # pads by the convention at repeated positions see each other
            pos = pos // 2
        n_pad = int(rng.integers(0, s // 2 + 1))
        where = {
            "right": np.arange(s - n_pad, s),
            "left": np.arange(n_pad),
            "holes": rng.choice(s, size=n_pad, replace=False),
            "repeats": np.arange(s - n_pad, s),
            "negative": np.arange(s - n_pad, s),
        }.get(pads, np.arange(0))
        doc[where] = -1 - pos[where]
        if pads == "negative" and where.size:  # one id that is not a pad of the convention
            doc[where[0]] = -7 if doc[where[0]] != -7 else -8
        p = perm if shared else rng.permutation(s)
        pos_rows.append(pos[p])
        doc_rows.append(doc[p])
    pos_t = torch.from_numpy(np.stack(pos_rows))
    if shared and pads != "repeats" and all((p == pos_rows[0]).all() for p in pos_rows):
        pos_t = pos_t[:1].expand(rows, -1)  # the built-in layouts' one row, expanded
    doc_t = torch.from_numpy(np.stack(doc_rows))
    r = int(rng.integers(0, world)) if rank is None else rank
    return TokenMeta(r, world, pos_t, doc_t)


@pytest.mark.parametrize("pads", PADS)
def test_rows_grouped_by_their_runs_equal_rows_compared_token_by_token(pads: str) -> None:
    rng = np.random.default_rng(PADS.index(pads))
    for _ in range(80):
        meta = _meta(rng, pads)
        host = host_rows(meta)
        pos, doc = np.broadcast_arrays(meta.positions.numpy(), meta.document_ids.numpy())
        same_pos = bool((pos == pos[:1]).all())
        want = _host_by_tokens(pos, doc, False, same_pos)
        assert host.merge == want.merge
        assert (host.table is None) == (not want.merge)  # no table where pads break the rule
        groups = _row_groups(None if same_pos else pos, doc)
        assert host.rows == (None if len(groups) == 1 else groups)
        np.testing.assert_array_equal(host.weights, [len(g) for g in groups])
        np.testing.assert_array_equal(host.pos, pos[[g[0] for g in groups]])
        np.testing.assert_array_equal(host.doc, doc[[g[0] for g in groups]])
        n = meta.local_len
        if host.table is not None:
            assert host.cut == n
            table = run_table(np.ascontiguousarray(host.pos), host.doc, True, breaks=n)
            for g, w in zip(host.table, table, strict=True):
                np.testing.assert_array_equal(g, w)
        for merge in (True, False):
            got = stream_table(meta, merge)
            table = run_table(np.ascontiguousarray(host.pos), host.doc, merge, breaks=max(n, 1))
            for g, w in zip(got, table, strict=True):
                np.testing.assert_array_equal(g, w)


def test_runs_cut_finer_join_into_the_coarser_cut() -> None:
    """A 2-D mesh's merged meta shares its meta's rows: the table cut at ``L`` joined at ``U * L``
    equals the table cut at ``U * L``."""
    rng = np.random.default_rng(11)
    for _ in range(150):
        meta = _meta(rng, str(rng.choice(["none", "right", "left", "holes"])))
        host = host_rows(meta)
        if host.table is None:
            continue
        n, width = meta.local_len, host.pos.shape[1]
        for u in (d for d in range(1, meta.world_size + 1) if meta.world_size % d == 0):
            got = join_runs(host.table, width, u * n)
            want = run_table(np.ascontiguousarray(host.pos), host.doc, True, breaks=u * n)
            for g, w in zip(got, want, strict=True):
                np.testing.assert_array_equal(g, w)
        got = join_runs(host.table, width)
        want = run_table(np.ascontiguousarray(host.pos), host.doc, True)
        for g, w in zip(got, want, strict=True):
            np.testing.assert_array_equal(g, w)


def test_runs_of_taken_slots_equal_the_runs_of_the_taken_tokens() -> None:
    rng = np.random.default_rng(12)
    for _ in range(200):
        meta = _meta(rng, str(rng.choice(["none", "right", "left", "holes"])))
        host = host_rows(meta)
        assert host.table is not None
        width = host.pos.shape[1]
        take = np.flatnonzero(rng.random(width) < rng.random())
        head = np.ones(take.size, dtype=bool)
        head[1:] = take[1:] != take[:-1] + 1
        first = np.flatnonzero(head)
        lo = take[first]
        hi = take[np.append(first[1:], take.size).astype(np.int64) - 1] + 1 if take.size else lo
        got = take_spans(host.table, width, lo, hi)
        pos, doc = np.ascontiguousarray(host.pos[:, take]), host.doc[:, take]
        for g, w in zip(got, run_table(pos, doc, True), strict=True):
            np.testing.assert_array_equal(g, w)


@pytest.mark.parametrize("pads", PADS)
def test_selective_plan_from_runs_equals_the_plan_from_tokens(pads: str) -> None:
    rng = np.random.default_rng(20 + PADS.index(pads))
    for _ in range(30):
        meta = _meta(rng, pads)
        host = host_rows(meta)
        a = meta_arrays(meta)
        for causal, window in MASKS:
            plan = selective_plan(meta, causal, window, CPU)
            recv = needed_slots(a, meta.rank, causal, window)
            np.testing.assert_array_equal(plan.recv_slots, recv)
            n = meta.local_len
            splits = np.bincount(recv // max(n, 1), minlength=meta.world_size)
            assert plan.recv_splits == tuple(int(x) for x in splits)
            own = a.rank_slice(meta.rank)
            # the remote plan reads the received keys in its own order (stream order where
            # that joins their runs): the token pass of the same keys in that order
            keys = plan.key_slots
            np.testing.assert_array_equal(np.sort(keys), recv)
            local, remote = _pair_plans(a, own, keys, host.merge, causal, window, CPU)
            same_plan(plan.local, local)
            same_plan(plan.remote, remote)


@pytest.mark.parametrize("pads", PADS)
def test_every_row_group_at_once_equals_group_by_group(pads: str) -> None:
    rng = np.random.default_rng(40 + PADS.index(pads))
    checked = 0
    for _ in range(60):
        meta = _meta(rng, pads)
        a = meta_arrays(meta)
        if a.every_group() is None:
            assert len(a.runs) == 1
            continue
        checked += 1
        assert a.grouped is not None  # every group's pad tokens at once, as group by group
        np.testing.assert_array_equal(
            a.grouped.pad_tokens, np.stack([r.pad_tokens for r in a.runs])
        )
        apart = dataclasses.replace(a, grouped=None)
        for causal, window in MASKS:
            for got, want in zip(
                (*_pairs(a, causal, window), *_union_sums(a, causal, window)),
                (*_pairs(apart, causal, window), *_union_sums(apart, causal, window)),
                strict=True,
            ):
                np.testing.assert_array_equal(got, want)
            for r in range(a.world):
                for got, want in zip(
                    needed_spans(a, r, causal, window),
                    needed_spans(apart, r, causal, window),
                    strict=True,
                ):
                    np.testing.assert_array_equal(got, want)
                for got, want in zip(
                    wanted_of(a, r, causal, window),
                    wanted_of(apart, r, causal, window),
                    strict=True,
                ):
                    np.testing.assert_array_equal(got, want)
    assert checked > 10


def test_grouped_runs_answer_only_for_the_runs_they_were_made_of() -> None:
    """Codes that would not fit int64 twice over, or runs replaced after the fact: the facts
    are asked group by group (and agree)."""
    rng = np.random.default_rng(60)
    done = 0
    while done < 5:
        meta = _meta(rng, "right")
        a = meta_arrays(meta)
        if a.every_group() is None:
            continue
        done += 1
        assert a.grouped is not None
        too_wide = GroupedRuns(a.runs)
        too_wide.fits = False
        other = dataclasses.replace(a, runs=tuple(list(a.runs)))  # equal runs, another tuple
        for b in (dataclasses.replace(a, grouped=too_wide), other):
            assert b.every_group() is None
            for got, want in zip(_pairs(a, True, 3), _pairs(b, True, 3), strict=True):
                np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("window", [None, 2])
def test_pair_runs_stays_exact_where_position_codes_would_overflow(window: int | None) -> None:
    """Positions spanning ~2**58 (a hand-built meta): the (class, position) keys of pair_runs
    would overflow int64, so it pairs by the ranks of the positions instead; the pairs equal
    those of the same runs at small positions (same order, no two slots one run in either).
    Found by review: the overflowed
    keys dropped visible pairs silently."""
    from cpshard.attention.pieces import pair_runs

    rng = np.random.default_rng(5)
    for _ in range(20):
        size = int(rng.integers(2, 9))
        small = 2 * np.sort(rng.choice(40, size=size, replace=False))[None]  # a run per slot
        doc = rng.integers(0, 3, size=(1, size)) * 20
        doc[0, rng.random(size) < 0.2] = -1  # some pads (-1 - position, below)
        doc = np.where(doc < 0, -1 - small, doc)
        huge = small * (1 << 52)  # same order, span ~2**57
        for causal in (True, False):
            want = pair_runs(run_table(small, doc, False), run_table(small, doc, False), causal,
                             window if causal else None)  # fmt: skip
            big_doc = np.where(doc < 0, -1 - huge, doc)
            t = run_table(huge, big_doc, False)
            got = pair_runs(t, t, causal, (window << 52) if causal and window else None)
            assert sorted(zip(*map(list, got), strict=True)) == sorted(
                zip(*map(list, want), strict=True)
            )
