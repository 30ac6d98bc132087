"""Layouts of packed batches: worked examples and properties of every layout."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from test_packing import random_spec

from cpshard.layouts.balanced import plan_balanced
from cpshard.layouts.closed_form import ContiguousLayout, RoundRobinLayout
from cpshard.layouts.documents import PackSpec
from cpshard.layouts.index import check_rank_map
from cpshard.layouts.packed import PackedPlan, plan_closed_form, plan_packed
from cpshard.names import DENSE_LAYOUTS, PACKED_LAYOUTS
from cpshard.tools.balance import all_plans


@pytest.mark.parametrize(
    ("cu", "expect"),
    [
        ([0, 8, 16], [[0, 1, 6, 7, 8, 9, 14, 15], [2, 3, 4, 5, 10, 11, 12, 13]]),
        ([0, 4, 12], [[0, 3, 4, 5, 10, 11], [1, 2, 6, 7, 8, 9]]),
    ],
)
def test_packed_worked_examples(cu: list[int], expect: list[list[int]]) -> None:
    spec = PackSpec.from_cu_seqlens(torch.tensor(cu), cu[-1])
    plan = plan_packed(spec, 2)
    assert plan.rank_map.tolist() == expect
    assert plan.padded_len == cu[-1]


def test_packed_pads_every_document() -> None:
    spec = PackSpec.from_seq_lens([[3, 2], [5]], 6)  # C=2: docs padded to 4, 4, 8
    plan = plan_packed(spec, 2)
    assert plan.padded_len == 16
    assert plan.stream_document_ids.tolist() == [0, 0, 0, -1, 1, 1, -1, -1] + [2] * 5 + [-1] * 3
    assert plan.stream_position_ids.tolist() == [0, 1, 2, 3, 0, 1, 2, 3, *range(8)]
    expect = [[0, 1, 2, 4, 5, -1], [8, 9, 10, 11, 12, -1]]
    assert plan.input_token_stream_positions.tolist() == expect
    assert plan.rank_map.tolist() == [[0, 3, 4, 7, 8, 9, 14, 15], [1, 2, 5, 6, 10, 11, 12, 13]]


def test_balanced_small_example() -> None:
    spec = PackSpec.from_seq_lens([[3, 2], [6, 1]], 7)
    plan = plan_balanced(spec, 3)
    assert plan.padded_len == 12  # 12 real tokens, no padding needed
    work = plan.token_work()[plan.rank_map].sum(1)
    # total work 6 + 3 + 21 + 1 = 31 over 3 ranks: the best split of integer work is 11/10/10
    assert sorted(work.tolist()) == [10, 10, 11]
    assert torch.equal(plan.rank_map, plan.rank_map.sort(dim=1).values)  # stream order locally


def _check_plan(spec: PackSpec, plan: PackedPlan, world: int) -> None:
    check_rank_map(plan.rank_map, plan.padded_len)
    assert plan.rank_map.shape == (world, plan.padded_len // world)
    pos = plan.input_token_stream_positions
    assert pos.shape == (spec.num_rows, spec.row_len)
    valid = pos >= 0
    assert torch.equal(valid, ~spec.padding_mask())  # exactly the row-end pads are dropped
    kept = pos[valid]
    assert kept.unique().numel() == kept.numel()  # injective
    assert torch.equal(plan.stream_document_ids[kept], spec.document_ids()[valid])
    assert torch.equal(plan.stream_position_ids[kept], spec.position_ids()[valid])
    assert int((plan.stream_document_ids >= 0).sum()) == spec.real_tokens
    # stream -> shard -> unshard, in caller coordinates, for [B, S] and [B, S, F]
    for x, fill in (
        (torch.randint(1, 100, (spec.num_rows, spec.row_len)), -5),
        (torch.randn(spec.num_rows, spec.row_len, 3), 0.5),
    ):
        stream = plan.to_stream(x, fill)
        shards = [stream[plan.rank_map[r]] for r in range(world)]
        back = torch.empty_like(stream)
        back[plan.rank_map.reshape(-1)] = torch.cat(shards)
        expect = x.clone()
        expect[~valid] = fill
        assert torch.equal(plan.from_stream(back, fill), expect)


@pytest.mark.parametrize("seed", range(8))
def test_every_layout_is_a_consistent_bijection(seed: int) -> None:
    rng = random.Random(seed)
    world = 3 if seed % 2 == 0 else rng.randint(1, 8)
    spec = random_spec(rng, rows=rng.randint(1, 3), row_len=rng.randint(8, 60))
    if spec.real_tokens < world:
        spec = PackSpec.from_seq_lens([[1] * world], world)
    plans = all_plans(spec, world)
    assert {p.layout for p in plans} >= {*DENSE_LAYOUTS, *PACKED_LAYOUTS}
    for plan in plans:
        _check_plan(spec, plan, world)


@pytest.mark.parametrize("seed", range(6))
def test_balanced_properties(seed: int) -> None:
    rng = random.Random(100 + seed)
    world = [1, 2, 3, 4, 5, 8][seed]
    spec = random_spec(rng, rows=2, row_len=rng.randint(20, 200))
    plan = plan_balanced(spec, world)
    assert plan.padded_len == -(-spec.real_tokens // world) * world  # minimal padding
    again = plan_balanced(PackSpec.from_seq_lens(spec.doc_lens, spec.row_len), world)
    assert torch.equal(plan.rank_map, again.rank_map)  # deterministic
    assert torch.equal(plan.rank_map, plan.rank_map.sort(dim=1).values)
    work = plan.token_work()[plan.rank_map].sum(1).double()
    lengths = spec.lengths()
    # one token's work (the longest document) bounds the deviation from the mean
    assert float(work.max() - work.mean()) <= float(lengths.max()) + 1e-3 * float(work.mean())


def test_packed_rank_takes_two_chunks_of_every_document() -> None:
    rng = random.Random(7)
    spec = random_spec(rng, rows=2, row_len=50)
    world = 3
    plan = plan_packed(spec, world)
    doc = plan.stream_document_ids
    seg_start = torch.arange(plan.padded_len) - plan.stream_position_ids
    for r in range(world):
        local = plan.rank_map[r]
        starts = seg_start[local].unique()
        assert starts.numel() == spec.num_docs  # every document contributes
        for s in starts.tolist():
            mine = local[seg_start[local] == s] - s
            padded = int((seg_start == s).sum())
            c = padded // (2 * world)
            assert padded % (2 * world) == 0
            head = torch.arange(r * c, (r + 1) * c)
            assert torch.equal(mine, torch.cat([head, (2 * world - 1 - r) * c + head - r * c]))
    assert int((doc >= 0).sum()) == spec.real_tokens


@pytest.mark.parametrize(
    "build",
    [
        lambda s, w: plan_packed(s, w),
        lambda s, w: plan_balanced(s, w),
        lambda s, w: plan_closed_form(s, w, RoundRobinLayout()),
        lambda s, w: plan_closed_form(s, w, ContiguousLayout()),
    ],
)
def test_more_ranks_than_tokens(build: object) -> None:
    spec = PackSpec.from_seq_lens([[2, 1], []], 4)
    with pytest.raises(ValueError, match=r"cannot shard 3 real tokens over world_size=4"):
        build(spec, 4)  # type: ignore[operator]


def test_plan_argument_errors() -> None:
    spec = PackSpec.from_seq_lens([[4]], 4)
    with pytest.raises(ValueError, match=r"work_tolerance must be >= 0"):
        plan_balanced(spec, 2, work_tolerance=-1.0)
    with pytest.raises(ValueError, match=r"world_size must be >= 1"):
        plan_balanced(spec, 0)
    plan = plan_balanced(spec, 2)
    with pytest.raises(ValueError, match=r"\(B, S\) = \(1, 4\)"):
        plan.to_stream(torch.zeros(1, 5), 0)
    with pytest.raises(ValueError, match=r"stream \[P, ...\] with P=4"):
        plan.from_stream(torch.zeros(5), 0)


def _reference_balanced(spec: PackSpec, world: int, tol: float) -> tuple[list[list[int]], ...]:
    """The balanced layout spelled out token by token (the solver's first, slow version):
    every pool token's rank from the same cut search, then each rank's stream positions."""
    lens = spec.lengths().tolist()
    real = sum(lens)
    padded = -(-real // world) * world
    local = padded // world
    starts = [sum(lens[:d]) for d in range(len(lens))]
    pool: list[int] = []  # stream position of each pool token
    work: list[int] = []
    bound = {0, *range(real, padded + 1)}
    for d in sorted(range(len(lens)), key=lambda d: -lens[d]):  # stable: longest first
        n = lens[d]
        for j in range(n):
            p = j // 2 if j % 2 == 0 else n - 1 - j // 2  # outside-in
            pool.append(starts[d] + p)
            work.append(p + 1)
        bound.add(len(pool))
    pool += range(real, padded)
    work += [0] * (padded - real)
    cum = np.concatenate([[0], np.cumsum(work)]).astype(np.int64)
    boundary = np.array([i in bound for i in range(padded + 1)], dtype=np.int8)
    owner = [world - 1] * padded
    lo, hi = 0, padded
    for r in range(world - 1):
        target = (cum[hi] - cum[lo]) / (world - r)
        err = np.abs(
            cum[lo : lo + local + 1] - cum[lo] + cum[hi] - cum[hi - local : hi + 1] - target
        )
        cuts = boundary[lo : lo + local + 1] + boundary[hi - local : hi + 1]
        score = np.where(err <= err.min() + tol * target, cuts, -1)
        cand = np.flatnonzero(score == score.max())
        k = int(cand[np.argmin(err[cand])])
        for i in [*range(lo, lo + k), *range(hi - local + k, hi)]:
            owner[i] = r
        lo, hi = lo + k, hi - local + k
    rank_of_stream = [0] * padded
    for i, s in enumerate(pool):
        rank_of_stream[s] = owner[i]
    rows = tuple([s for s in range(padded) if rank_of_stream[s] == r] for r in range(world))
    return rows


@pytest.mark.parametrize("seed", range(12))
def test_balanced_matches_token_by_token_reference(
    seed: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Also with the cut search's blocks a third, a half and all of a rank's cuts wide (blocks
    skipped and searched, cuts on both sides of their edges)."""
    from cpshard.layouts import balanced

    monkeypatch.setattr(balanced, "_SEARCH_BLOCKS", (256, 1, 2, 3)[seed % 4])
    rng = random.Random(300 + seed)
    for _ in range(15):
        spec = random_spec(rng, rows=rng.randint(1, 4), row_len=rng.randint(1, 120))
        world = rng.randint(1, min(12, spec.real_tokens) or 1)
        if spec.real_tokens < world:
            continue
        tol = rng.choice([0.0, 1e-3, 0.05])
        plan = plan_balanced(spec, world, tol)
        assert tuple(plan.rank_map.tolist()) == _reference_balanced(spec, world, tol)


@pytest.mark.parametrize("world", [2, 3, 8, 16])
def test_balanced_matches_the_reference_on_realistic_mixes(world: int) -> None:
    """Thousands of tokens of log-normal documents (a few long, many short, some of one
    token): the blocks of the cut search are wide, most are skipped, and the cuts are still the
    ones a search of every cut makes, for every tolerance."""
    rng = np.random.default_rng(world)
    for tol in (0.0, 1e-3, 0.05):
        rows = []
        for _ in range(int(rng.integers(1, 4))):
            lens = np.maximum(1, rng.lognormal(4.5, 1.3, size=int(rng.integers(5, 60))))
            rows.append([int(n) for n in lens])
        spec = PackSpec.from_seq_lens(rows, max(sum(r) for r in rows) + 3)
        plan = plan_balanced(spec, world, tol)
        assert tuple(plan.rank_map.tolist()) == _reference_balanced(spec, world, tol)


@pytest.mark.parametrize("world", [1, 2, 3])
def test_stream_runs_invert_the_input_map(world: int) -> None:
    """The plan's stream -> caller index map is the inverse of its caller -> stream map, -1
    where no caller token fills a slot; dropped caller tokens (row-end pads, stream position -1)
    fill nothing; rows without documents included. One rank's slots made from the runs
    (:meth:`StreamRuns.at`) equal the whole arrays at those slots, for every rank and for
    positions in any order."""
    rng = random.Random(world)
    for i in range(12):
        rows = [[rng.randint(1, 9) for _ in range(rng.randint(0 if i % 3 else 1, 4))]
                for _ in range(rng.randint(1, 4))]  # fmt: skip
        if not any(rows) or sum(map(sum, rows)) < world:
            continue
        seq = max(sum(r) for r in rows) + rng.randint(0, 3)  # row-end pads dropped
        spec = PackSpec.from_seq_lens(rows, seq)
        for plan in (plan_balanced(spec, world), plan_packed(spec, world)):
            want = [-1] * plan.padded_len
            for i, p in enumerate(plan.input_token_stream_positions.reshape(-1).tolist()):
                if p >= 0:
                    want[p] = i
            assert (plan.input_token_stream_positions < 0).any() == any(sum(r) < seq for r in rows)
            assert plan.stream_input_sources.tolist() == want
            assert plan.stream.length == plan.padded_len
            blocks = list(torch.arange(plan.padded_len).split(16))  # runs of 16, out of order
            rng.shuffle(blocks)
            shuffled = torch.cat(blocks)
            for local in [*plan.rank_map, torch.randperm(plan.padded_len), shuffled]:
                got = plan.stream.at(local.numpy())
                if got is None:  # cut finer than one run per 8 slots
                    assert local.numel() < 8 * (local.diff() != 1).sum() + 8
                    continue
                src, pos, pad = (torch.from_numpy(x) for x in got)
                assert torch.equal(src, plan.stream_input_sources[local])
                assert torch.equal(pos, plan.stream_position_ids[local])
                assert torch.equal(pad, plan.stream_padding_mask[local])
            with pytest.raises(ValueError, match="positions must lie in"):
                plan.stream.at(np.arange(plan.padded_len - 7, plan.padded_len + 9))


def test_check_map_runs_accepts_a_tiling_and_names_what_breaks_it() -> None:
    from cpshard.layouts.index import check_map_runs

    first, count = np.array([0, 6, 2]), np.array([2, 2, 4])  # rows [0, 1, 6, 7] [2, 3, 4, 5]
    check_map_runs(first, count, 8, 2)
    bad = {
        "gap or overlap at position 2": (np.array([0, 2]), np.array([4, 4])),  # 2, 3 twice
        "gap or overlap at position 5": (np.array([0, 5]), np.array([4, 4])),  # 4 missing
        "non-empty": (np.array([0, 4, 4]), np.array([4, 0, 4])),
        "crosses a rank's row": (np.array([0, 3, 6]), np.array([3, 3, 2])),
        "divisible": (np.array([0]), np.array([7])),
    }
    for what, (f, c) in bad.items():
        with pytest.raises(ValueError, match=what):
            check_map_runs(f, c, int(c.sum()), 2)


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_plans_made_from_runs_keep_them(world: int) -> None:
    """balanced and TE packed make their maps from runs: the runs make the map, each rank's
    runs are its row, the plan equals the one checked token by token, and a placement carries
    coarse runs (``Placement.stream_runs``, equal to its map) without reading the map again;
    a rank's slots from its runs equal those found in its row."""
    from cpshard.layouts.index import arange_runs
    from cpshard.layouts.packed import plan_from_stream

    rng = random.Random(40 + world)
    for _ in range(10):
        spec = random_spec(rng, rows=rng.randint(1, 4), row_len=rng.randint(8, 120))
        if spec.real_tokens < world:
            continue
        for plan in (plan_balanced(spec, world), plan_packed(spec, world)):
            assert plan.map_runs is not None
            first, count = plan.map_runs
            assert arange_runs(first, count, 1).tolist() == plan.rank_map.reshape(-1).tolist()
            doc_padded = None if plan.layout == "balanced" else _te_padded(spec, world)
            whole = plan_from_stream(spec, plan.layout, plan.rank_map, doc_padded)
            assert torch.equal(
                whole.input_token_stream_positions, plan.input_token_stream_positions
            )
            assert torch.equal(whole.stream_input_sources, plan.stream_input_sources)
            for r in range(world):
                mine = plan.local_map_runs(r)
                assert mine is not None
                local = plan.rank_map[r]
                assert arange_runs(*mine, 1).tolist() == local.tolist()
                got, want = plan.stream.at(local.numpy(), mine), plan.stream.at(local.numpy())
                assert (got is None) == (want is None)
                for a, b in zip(got or (), want or (), strict=True):
                    np.testing.assert_array_equal(a, b)
            place = plan.placement(torch.device("cpu"))
            coarse = first.size * 64 <= plan.padded_len
            assert (place.stream_runs is not None) == coarse
            if coarse:
                assert place._runs_match()
                assert torch.equal(
                    place.stream_document_ids(),
                    place.document_ids.index_select(1, place.rank_map.reshape(-1)),
                )


def _te_padded(spec: PackSpec, world: int) -> torch.Tensor:
    two_c = 2 * world
    return (spec.lengths() + two_c - 1) // two_c * two_c


def test_runs_over_given_runs_equals_finding_them() -> None:
    from cpshard.layouts.index import arange_runs, run_starts, runs_over

    rng = np.random.default_rng(3)
    for _ in range(50):
        counts = rng.integers(1, 9, size=int(rng.integers(1, 12)))
        order = rng.permutation(counts.size)  # the runs of a tiling, shuffled
        first, count = (np.cumsum(counts) - counts)[order], counts[order]
        values = arange_runs(first, count, 1)
        tiling = np.unique(np.concatenate([[0], rng.integers(0, values.size, size=4)]))
        for cut in (None, 5):
            slot = run_starts(values, cut)
            found = (values[slot], np.diff(slot, append=values.size))
            want = runs_over(values, tiling, values.size, 1, cut)
            got = runs_over(None, tiling, values.size, 1, cut, found)
            assert want is not None and got is not None
            for a, b in zip(got, want, strict=True):
                np.testing.assert_array_equal(a, b)
        with pytest.raises(ValueError, match="positions must lie in"):
            runs_over(None, tiling + 1, values.size, 1, None, (first, count))


def test_attach_stream_runs_checks_the_tiling() -> None:
    from cpshard.layouts.placement import attach_stream_runs

    spec = PackSpec.from_seq_lens([[5, 3]], 8)
    place = plan_balanced(spec, 2).placement(torch.device("cpu"))
    for runs in (((0, 4), (5, 4)), ((0, 4), (4, 0), (4, 4)), ((0, 4),), ()):
        with pytest.raises(ValueError, match="must tile arange"):
            attach_stream_runs(place, runs)


def test_plan_from_runs_rejects_bad_runs_coarse_or_fine() -> None:
    """Runs that do not make a bijection raise whether they are checked by sorting (coarse) or
    on the map made from them (fine: more than one run per 64 positions), and so does a run
    across two ranks' rows (its rank's slots would be read from the wrong runs)."""
    from cpshard.layouts.packed import plan_from_runs

    spec = PackSpec.from_seq_lens([[100, 28]], 128)
    coarse = (np.array([0, 64]), np.array([64, 64]))
    plan = plan_from_runs(spec, "custom", 2, *coarse)
    assert plan.rank_map.tolist() == [list(range(64)), list(range(64, 128))]
    fine_first = np.arange(0, 128, 2)[::-1].copy()  # 64 runs of 2, in reverse order
    plan = plan_from_runs(spec, "custom", 2, fine_first, np.full(64, 2))
    assert plan.rank_map.reshape(-1).tolist() == [p for a in fine_first for p in (a, a + 1)]
    bad = {
        "crosses a rank's row": (np.array([0, 96]), np.array([96, 32])),
        "exactly once": (np.array([0, 60]), np.array([64, 64])),
    }
    for what, (f, c) in bad.items():
        with pytest.raises(ValueError, match=what):
            plan_from_runs(spec, "custom", 2, f, c)
    overlap = np.concatenate([np.arange(0, 126, 2), [0]])  # fine, position 0 twice, 126 never
    with pytest.raises(ValueError, match="exactly once"):
        plan_from_runs(spec, "custom", 2, overlap, np.full(64, 2))
