"""The attention host rows of a closed-form placement from its pads against the token pass.

A closed-form placement gives its documents by their pads (:class:`~cpshard.layouts.placement.
PaddedRows`) and its stream by runs; :func:`~cpshard.attention.plan.host_rows` then finds the row
groups and the run table from the pads' changes (:mod:`cpshard.attention.pad_runs`) and makes the
document ids only if read. Each is compared here with the token pass over the same meta's ids
(a meta built from those ids, without the placement), on random pads (none, right, left, holes,
whole rows, repeated rows, one mask row for every row), every closed-form layout, world 1 to 8,
lengths that need CP pads.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from cpshard.attention.pad_runs import (
    blocked_runs,
    pad_table,
    rank_map_runs,
    row_groups_by_pads,
)
from cpshard.attention.plan import HostRows, host_rows
from cpshard.attention.selective_plan import selective_plan
from cpshard.layouts.balanced import plan_balanced
from cpshard.layouts.closed_form import ContiguousLayout, NoneLayout, RoundRobinLayout
from cpshard.layouts.documents import PackSpec
from cpshard.layouts.index import _PASS_CHUNK, run_starts
from cpshard.layouts.packed import plan_packed
from cpshard.layouts.placement import (
    _IN_ORDER_MIN_RUN,
    DocumentRuns,
    PaddedRows,
    Placement,
    pad_document_ids,
)
from cpshard.sharding.meta import TokenMeta

CPU = torch.device("cpu")
PADS = ("none", "right", "left", "holes", "whole", "repeats", "broadcast")


def _mask(rng: np.random.Generator, kind: str, rows: int, seq: int) -> torch.Tensor | None:
    if kind == "none":
        return None
    if kind == "broadcast":  # one mask row for every row
        return torch.from_numpy(rng.random((1, seq)) < 0.3)
    out = np.zeros((rows, seq), dtype=bool)
    for r in range(rows):
        cut = int(rng.integers(0, seq + 1))
        if kind == "right":
            out[r, cut:] = True
        elif kind == "left":
            out[r, :cut] = True
        elif kind == "whole":
            out[r] = rng.random() < 0.5
        else:  # holes, repeats
            out[r] = rng.random(seq) < 0.2
        if kind == "repeats" and r and rng.random() < 0.5:
            out[r] = out[int(rng.integers(0, r))]
    return torch.from_numpy(out)


def _placement(rng: np.random.Generator, kind: str) -> Placement:
    world = int(rng.choice([1, 2, 3, 4, 8]))
    seq, rows = int(rng.integers(1, 40)), int(rng.integers(1, 5))
    layouts = [RoundRobinLayout(), ContiguousLayout(int(rng.integers(1, 4)))]
    layout = NoneLayout() if world == 1 and rng.random() < 0.5 else layouts[int(rng.integers(2))]
    return layout.placement(world, rows, seq, _mask(rng, kind, rows, seq), CPU)


def _token_host(place: Placement, rank: int) -> HostRows:
    """The token pass over the same meta's ids (no placement: the route of any meta)."""
    meta = TokenMeta(
        rank, place.world_size, place.stream_positions(), place.stream_document_ids().clone()
    )
    return host_rows(meta)


def _same(got: HostRows, want: HostRows) -> None:
    assert got.rows == want.rows
    assert got.merge is want.merge is True
    assert got.cut == want.cut
    np.testing.assert_array_equal(got.weights, want.weights)
    assert got.table is not None and want.table is not None
    for a, b in zip(got.table, want.table, strict=True):
        np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(got.pos, want.pos)
    np.testing.assert_array_equal(got.doc, want.doc)


@pytest.mark.parametrize("kind", PADS)
def test_host_rows_from_pads_equal_the_token_pass(kind: str) -> None:
    rng = np.random.default_rng(PADS.index(kind))
    for _ in range(60):
        place = _placement(rng, kind)
        assert isinstance(place.documents, PaddedRows)
        for rank in range(place.world_size):
            meta = TokenMeta.of(place, rank)
            got = host_rows(meta)
            assert meta._ids == []  # the groups and the table without the ids
            _same(got, _token_host(place, rank))


def test_selective_plans_from_pads_equal_the_token_pass() -> None:
    """The plan that reads only the table is the same as the one of the token pass, and
    never makes the ids."""
    rng = np.random.default_rng(7)
    for _ in range(40):
        place = _placement(rng, PADS[int(rng.integers(len(PADS)))])
        for rank in range(place.world_size):
            meta = TokenMeta.of(place, rank)
            by_tokens = TokenMeta(
                rank, place.world_size, place.stream_positions(), place.stream_document_ids()
            )
            for window in (None, 3):
                got = selective_plan(meta, True, window, CPU)
                want = selective_plan(by_tokens, True, window, CPU)
                assert got.send_splits == want.send_splits
                assert got.recv_splits == want.recv_splits
                assert torch.equal(got.send_index, want.send_index)
                np.testing.assert_array_equal(got.recv_slots, want.recv_slots)
                assert got.local.needed == want.local.needed
                assert got.remote.needed == want.remote.needed
                assert got.remote.computed == want.remote.computed
            assert meta._ids == []


def test_pad_table_joins_runs_that_continue_across_stream_runs() -> None:
    """Stream runs that continue each other in position and slot (inside one rank block) are one
    run; at a rank block's border they stay two."""
    pad = np.zeros((1, 8), dtype=bool)
    pad[0, 5:] = True
    groups, changes = row_groups_by_pads(pad)
    assert groups == [[0]] and changes[0].tolist() == [5]
    table = pad_table(pad, [0], changes, blocked_runs(((0, 2), (2, 2), (4, 4)), 4), cut=4)
    assert table.start.tolist() == [0, 4, 5]
    assert table.n.tolist() == [4, 1, 3]
    assert table.pos.tolist() == [0, 4, 5]
    assert table.cls[1] == 0 and table.cls[2] != 0


def test_document_ids_are_made_on_first_read_and_kept() -> None:
    pad = torch.tensor([[False, False, True, True]])
    place = RoundRobinLayout().placement(2, 1, 4, pad, CPU)
    meta = TokenMeta.of(place, 0)
    assert place._ids == [] and meta._ids == []
    ids = meta.document_ids
    assert meta.document_ids is ids and len(place._ids) == 1
    assert torch.equal(place.document_ids, torch.tensor([[0, 0, -3, -4]]))
    assert torch.equal(ids, place.stream_document_ids())


def test_padded_rows_are_a_private_copy_of_the_callers_mask() -> None:
    """A caller who reuses the mask's buffer after the shard does not change its documents."""
    mask = torch.tensor([[False, False, True, True]])
    place = RoundRobinLayout().placement(2, 1, 4, mask, CPU)
    mask.fill_(False)
    assert torch.equal(place.document_ids, torch.tensor([[0, 0, -3, -4]]))


def test_padded_rows_and_placement_shapes_are_checked() -> None:
    with pytest.raises(ValueError, match="bool padding_mask"):
        PaddedRows(torch.zeros(1, 4, dtype=torch.long))
    with pytest.raises(ValueError, match="must all be P"):
        Placement(torch.arange(4).view(2, 2), PaddedRows(torch.zeros(1, 3, dtype=torch.bool)),
                  RoundRobinLayout().placement(2, 1, 4, None, CPU).coordinates)  # fmt: skip
    with pytest.raises(ValueError, match="needs its document_ids, or the placement"):
        TokenMeta(0, 2, torch.arange(4).view(1, 4))


def _packed_placements(rng: np.random.Generator) -> list[Placement]:
    """Placements of a random packed batch (1-4 rows, documents of 1-9 tokens, rows without
    documents, row-end pads) under the balanced and packed plans, world 1-4."""
    rows = [[int(x) for x in rng.integers(1, 10, size=int(rng.integers(0, 5)))]
            for _ in range(int(rng.integers(1, 5)))]  # fmt: skip
    if not any(rows):
        rows[0] = [3]
    world = int(rng.integers(1, min(4, sum(map(sum, rows))) + 1))
    seq = max(sum(r) for r in rows) + int(rng.integers(0, 3))
    spec = PackSpec.from_seq_lens(rows, seq)
    return [plan.placement(CPU) for plan in (plan_balanced(spec, world), plan_packed(spec, world))]


@pytest.mark.parametrize("runs_per_token", [0, 64])
def test_packed_documents_as_runs_equal_the_token_pass(
    runs_per_token: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A packed plan's placement describes its documents as runs; the host rows (the stream's
    runs cut at the document runs, or the token pass where the stream is cut finer than one run
    per ``_RUNS_PER_TOKEN`` tokens) and the selective plans equal the token pass over the ids,
    and the runs' route never makes the ids."""
    from cpshard.attention import plan as plan_module

    monkeypatch.setattr(plan_module, "_RUNS_PER_TOKEN", runs_per_token)
    rng = np.random.default_rng(11)
    for _ in range(40):
        for place in _packed_placements(rng):
            assert isinstance(place.documents, DocumentRuns)
            flat = place.rank_map.reshape(-1).numpy()
            fine = run_starts(flat, place.local_len).size * runs_per_token > flat.size
            for rank in range(place.world_size):
                meta = TokenMeta.of(place, rank)
                got_host = host_rows(meta)
                by_tokens = TokenMeta(
                    rank, place.world_size, place.stream_positions(), place.stream_document_ids()
                )
                for window in (None, 2):
                    got = selective_plan(meta, True, window, CPU)
                    want = selective_plan(by_tokens, True, window, CPU)
                    assert torch.equal(got.send_index, want.send_index)
                    np.testing.assert_array_equal(got.recv_slots, want.recv_slots)
                    assert got.remote.computed == want.remote.computed
                assert (meta._ids == []) != fine  # the runs' route: ids unmade
                _same(got_host, _token_host(place, rank))  # (reads the ids)


def test_document_runs_make_the_plans_ids() -> None:
    rng = np.random.default_rng(12)
    for _ in range(20):
        rows = [[int(x) for x in rng.integers(1, 8, size=int(rng.integers(1, 4)))]
                for _ in range(3)]  # fmt: skip
        spec = PackSpec.from_seq_lens(rows, max(map(sum, rows)) + 2)
        plan = plan_balanced(spec, 2)
        want = pad_document_ids(plan.stream_document_ids[None], plan.stream_padding_mask[None])
        assert torch.equal(plan.placement(CPU).document_ids, want)
        docs = plan.placement(CPU).documents
        assert isinstance(docs, DocumentRuns)
        from_runs = DocumentRuns(docs.starts, docs.ids, docs.length, CPU)  # no per-position ids
        assert torch.equal(from_runs.make_ids(), want)
        assert torch.equal(plan.placement(CPU, plan.stream_padding_mask).document_ids, want)


def test_document_runs_in_any_order() -> None:
    """The ids in the rank-major stream made from the runs (no global ids) equal the global ids
    indexed by the rank map, pads' ``-1 - position`` included, for TE's packed and balanced plans
    at several CP sizes; an order cut finer than the threshold says so (``None``)."""
    rng = np.random.default_rng(21)
    for _ in range(30):
        rows = [[int(x) for x in rng.integers(1, 30, size=int(rng.integers(1, 6)))]
                for _ in range(int(rng.integers(1, 4)))]  # fmt: skip
        spec = PackSpec.from_seq_lens(rows, max(map(sum, rows)) + int(rng.integers(0, 4)))
        world = int(rng.integers(1, 5))
        for plan in (plan_balanced(spec, world), plan_packed(spec, world)):
            place = plan.placement(CPU)
            docs = place.documents
            assert isinstance(docs, DocumentRuns)
            want = place.document_ids[0]  # made here; the placement below is a fresh one
            for order in (place.rank_map.reshape(-1), torch.arange(plan.padded_len)):
                got = docs.in_order(order)
                if got is None:  # finer than one run per _IN_ORDER_MIN_RUN positions
                    assert run_starts(order.numpy()).size * _IN_ORDER_MIN_RUN > order.numel()
                    continue
                assert torch.equal(got, want[order])
            fresh = plan.placement(CPU)
            flat = place.rank_map.reshape(-1)
            assert torch.equal(fresh.stream_document_ids()[0], want[flat])
            fine = run_starts(flat.numpy()).size * _IN_ORDER_MIN_RUN > flat.numel()
            assert (fresh._ids == []) != fine  # the runs' route leaves the global ids unmade
    docs = DocumentRuns(torch.tensor([0, 3]), torch.tensor([0, -1]), 16, CPU)
    assert docs.in_order(torch.arange(15, -1, -1)) is None  # runs of one position each
    got = docs.in_order(torch.tensor([*range(3, 16), 0, 1, 2]))  # pads first, then document 0
    assert got is not None and got.tolist() == [-1 - p for p in range(3, 16)] + [0, 0, 0]
    for outside in ([*range(8, 17)], [-1, *range(0, 8)]):  # past P, before 0: never wrapped
        with pytest.raises(ValueError, match=r"positions must lie in \[0, 16\)"):
            docs.in_order(torch.tensor(outside))


def test_rank_map_runs_cut_at_the_rank_blocks() -> None:
    slot, pos = rank_map_runs(np.array([0, 1, 2, 3, 8, 9, 4, 5, 6, 7], dtype=np.int64), 5)
    assert slot.tolist() == [0, 4, 5, 6] and pos.tolist() == [0, 8, 9, 4]


def test_rank_map_runs_across_pass_chunks() -> None:
    """The chunked pass finds the same runs as a plain one, breaks at chunk seams included."""
    rng = np.random.default_rng(5)
    n = 2 * _PASS_CHUNK + 77
    for cut in (n, _PASS_CHUNK, 1000):
        pieces = np.split(np.arange(n, dtype=np.int64), np.sort(rng.choice(n, 40, replace=False)))
        rng.shuffle(pieces)
        stream = np.concatenate(pieces)
        for seam in (_PASS_CHUNK, 2 * _PASS_CHUNK):  # a break exactly at a chunk seam
            stream[seam:] = np.roll(stream[seam:], 1) if seam == _PASS_CHUNK else stream[seam:]
        brk = np.ones(n, dtype=bool)
        brk[1:] = stream[1:] != stream[:-1] + 1
        brk[::cut] = True
        slot, pos = rank_map_runs(stream, cut)
        assert slot.tolist() == np.flatnonzero(brk).tolist()
        assert pos.tolist() == stream[brk].tolist()
    assert [x.tolist() for x in rank_map_runs(np.array([7], dtype=np.int64), 1)] == [[0], [7]]


def test_document_runs_are_checked() -> None:
    with pytest.raises(ValueError, match="strictly increasing"):
        DocumentRuns(torch.tensor([0, 3, 3]), torch.tensor([0, 1, -1]), 6, CPU)
    with pytest.raises(ValueError, match="strictly increasing"):
        DocumentRuns(torch.tensor([1]), torch.tensor([0]), 6, CPU)


@pytest.mark.parametrize("long_runs", [1, 2048, 1 << 40])
def test_arange_runs_equals_its_definition(long_runs: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """``concat(first[i] + step[i] * arange(counts[i]))`` whichever way it is written: runs as
    slices (long on average; those of ``_RAMP`` values or more by ``torch.arange``) or a repeat
    and a cumsum; empty runs, negative and zero steps, a scalar step and ``out``."""
    from cpshard.layouts import index

    monkeypatch.setattr(index, "_LONG_RUNS", long_runs)
    monkeypatch.setattr(index, "_RAMP", 64)
    rng = np.random.default_rng(5)
    for trial in range(200):
        k = int(rng.integers(1, 7))
        counts = rng.integers(0, 300 if trial % 2 else 4, size=k)
        first = rng.integers(-(10**6), 10**6, size=k)
        step: np.ndarray | int = rng.integers(-3, 4, size=k)
        if trial % 3 == 0:
            step = int(rng.integers(-2, 3))
        steps = [step] * k if isinstance(step, int) else step.tolist()
        runs = zip(first.tolist(), counts.tolist(), steps, strict=True)
        want = [f + s * i for f, n, s in runs for i in range(n)]
        assert index.arange_runs(first, counts, step).tolist() == want
        if isinstance(step, int):
            out = np.full(len(want), 7, dtype=np.int64)
            assert index.arange_runs(first, counts, step, out=out) is out
            assert out.tolist() == want
