"""Closed-form layouts copy their local tokens as a few contiguous runs (issue 25): the runs, the
placement built from them and the run copy equal the per-token index path exactly."""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import pytest
import torch

from cpshard.layouts.closed_form import (
    MAX_RUNS,
    ClosedFormLayout,
    ContiguousLayout,
    NoneLayout,
    RoundRobinLayout,
    index_runs,
)
from cpshard.layouts.coordinates import CallerCoordinates
from cpshard.layouts.placement import Placement, pad_document_ids
from cpshard.sharding.batch import pad_tokens, pad_value, shard_batch_dense, take_runs

CPU = torch.device("cpu")


@dataclass(frozen=True)
class _Striped(ClosedFormLayout):
    """Token t on rank t % C: every token its own run (more than MAX_RUNS per rank)."""

    @property
    def name(self) -> str:
        return "striped_test"

    def divisor(self, world_size: int) -> int:
        return world_size

    def local_indices(
        self,
        rank: int,
        world_size: int,
        padded_seq_len: int,
        device: torch.device | str | None = None,
    ) -> torch.Tensor:
        return torch.arange(rank, padded_seq_len, world_size, device=device)


def _layouts(world: int) -> list[ClosedFormLayout]:
    out: list[ClosedFormLayout] = [
        RoundRobinLayout(),
        ContiguousLayout(),
        ContiguousLayout(pad_multiple=3),
        ContiguousLayout(pad_multiple=8),
        _Striped(),
    ]
    return [NoneLayout(), *out] if world == 1 else out


def _arange_of(runs: tuple[tuple[int, int], ...]) -> list[int]:
    return [p for a, n in runs for p in range(a, a + n)]


def _old_document_ids(rows: int, seq: int, padded: int, mask: torch.Tensor | None) -> torch.Tensor:
    """The placement's document ids as they were built before the runs (the reference)."""
    if mask is None and padded == seq:
        return torch.zeros(1, padded, dtype=torch.long)
    pad = torch.ones(rows, padded, dtype=torch.bool)
    pad[:, :seq] = False if mask is None else mask.bool()
    pos = torch.arange(padded).expand(rows, padded)
    return torch.where(pad, -1 - pos, torch.zeros(rows, padded, dtype=torch.long))


@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("seq", [1, 7, 24, 37, 64])
def test_local_runs_are_the_runs_of_the_local_indices(world: int, seq: int) -> None:
    for layout in _layouts(world):
        padded = layout.padded_length(seq, world)
        for rank in range(world):
            idx = layout.local_indices(rank, world, padded)
            runs = layout.local_runs(rank, world, padded)
            assert _arange_of(runs) == idx.tolist(), (layout, rank)
            assert runs == index_runs(idx), (layout, rank)
            if not isinstance(layout, _Striped):
                assert len(runs) <= 2


def test_index_runs_of_any_index() -> None:
    for idx in ([], [5], [0, 1, 2], [3, 4, 0, 1, 9], [2, 1, 0], [7, 7, 8], [0, 2, 4, 5, 6]):
        runs = index_runs(torch.tensor(idx, dtype=torch.long))
        assert _arange_of(runs) == idx
        assert all(n > 0 for _, n in runs)
        assert all(b[0] != a[0] + a[1] for a, b in itertools.pairwise(runs))  # maximal


@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("seq", [5, 24, 37])
@pytest.mark.parametrize("mask_kind", ["none", "rows", "one row"])
def test_placement_from_runs_equals_the_index_placement(
    world: int, seq: int, mask_kind: str
) -> None:
    g = torch.Generator().manual_seed(world * 100 + seq)
    rows = 3
    mask = {
        "none": None,
        "rows": torch.rand(rows, seq, generator=g) < 0.3,
        "one row": torch.rand(1, seq, generator=g) < 0.3,
    }[mask_kind]
    for layout in _layouts(world):
        placement = layout.placement(world, rows, seq, mask, CPU)
        padded = layout.padded_length(seq, world)
        assert torch.equal(placement.rank_map, layout.rank_map(world, padded))
        assert torch.equal(placement.document_ids, _old_document_ids(rows, seq, padded, mask))
        flat = placement.rank_map.reshape(-1)
        want_stream = placement.document_ids.index_select(1, flat)
        assert torch.equal(placement.stream_document_ids(), want_stream)
        if isinstance(layout, _Striped) and padded // world > MAX_RUNS:
            assert placement.stream_runs is None
        else:  # made from its runs (Placement.of_runs): they describe it, as the check says
            assert placement.stream_runs is not None and placement._runs_match()
        for rank in range(world):
            runs = placement.local_runs(rank)
            if runs is not None:
                assert _arange_of(runs) == placement.rank_map[rank].tolist()


def test_placement_rejects_runs_that_are_not_its_rank_map() -> None:
    rank_map = torch.tensor([[0, 1, 6, 7], [2, 3, 4, 5]])
    docs = torch.zeros(1, 8, dtype=torch.long)
    coords = CallerCoordinates(8, 8)
    ok = Placement(rank_map, docs, coords, stream_runs=((0, 2), (6, 2), (2, 4)))
    assert ok.local_runs(0) == ((0, 2), (6, 2)) and ok.local_runs(1) == ((2, 4),)
    for bad in (((0, 2), (6, 2), (2, 3)), ((0, 4), (4, 4)), ((0, 2), (6, 2), (2, 4), (8, 0))):
        with pytest.raises(ValueError, match="stream_runs"):
            Placement(rank_map, docs, coords, stream_runs=bad)


def test_placement_of_runs_rejects_runs_that_do_not_tile_the_stream() -> None:
    docs = torch.zeros(1, 8, dtype=torch.long)
    coords = CallerCoordinates(8, 8)
    ok = Placement.of_runs(((0, 2), (6, 2), (2, 4)), 2, docs, coords, CPU)
    assert ok.rank_map.tolist() == [[0, 1, 6, 7], [2, 3, 4, 5]]
    assert ok.stream_runs == ((0, 2), (6, 2), (2, 4)) and ok._runs_match()
    bad = (
        ((0, 2), (6, 2), (2, 3), (5, 1), (7, 0)),  # an empty run
        ((0, 2), (6, 2), (1, 4)),  # an overlap (and a gap)
        ((0, 2), (3, 5)),  # a gap
        ((0, 4), (4, 3)),  # P = 7 over 2 ranks
        (),
    )
    for runs in bad:
        with pytest.raises(ValueError, match="tile arange"):
            Placement.of_runs(runs, 2, docs, coords, CPU)


def test_pad_document_ids_broadcasts_one_document_per_row() -> None:
    pad = torch.tensor([[False, True, False, True], [True, False, False, False]])
    got = pad_document_ids(torch.zeros((), dtype=torch.long), pad)
    assert got.tolist() == [[0, -2, 0, -4], [-1, 0, 0, 0]]
    docs = torch.tensor([[0, 0, 1, 1], [0, 1, 1, 2]])
    assert pad_document_ids(docs, pad).tolist() == [[0, -2, 1, -4], [-1, 1, 1, 2]]


def _tensors(rows: int, seq: int, g: torch.Generator) -> dict[str, tuple[torch.Tensor, int]]:
    ids = torch.randint(1, 100, (rows, seq), generator=g)
    return {
        "input_ids": (ids, 1),
        "labels": (ids.clone(), 1),
        "loss_mask": (torch.rand(rows, seq, generator=g), 1),
        "padding_mask": (torch.rand(rows, seq, generator=g) < 0.2, 1),
        "position_ids": (torch.arange(seq).expand(rows, seq), 1),
        "mrope": (torch.randint(0, 50, (3, rows, seq), generator=g), 2),
        "inputs_embeds": (torch.randn(rows, seq, 4, generator=g), 1),
        "transposed": (torch.randn(4, rows, seq, generator=g).permute(1, 2, 0), 1),
    }


@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("seq", [1, 7, 24, 37])
def test_take_runs_equals_pad_then_index_select(world: int, seq: int) -> None:
    g = torch.Generator().manual_seed(seq * 10 + world)
    for layout in _layouts(world):
        padded = layout.padded_length(seq, world)
        for rank in range(world):
            idx = layout.local_indices(rank, world, padded)
            runs = layout.local_runs(rank, world, padded)
            for key, (t, dim) in _tensors(2, seq, g).items():
                value = None if key in ("position_ids", "mrope") else pad_value(
                    key if key in ("input_ids", "labels", "loss_mask", "padding_mask") else
                    "inputs_embeds", 7)  # fmt: skip
                want = pad_tokens(t, dim, padded - seq, value).index_select(dim, idx)
                got = take_runs(t, dim, runs, value)
                assert got.dtype == want.dtype and got.is_contiguous()
                torch.testing.assert_close(got, want, rtol=0, atol=0)
                assert got.untyped_storage().data_ptr() != t.untyped_storage().data_ptr()


@pytest.mark.parametrize(
    ("layout", "world", "seq"),
    [(RoundRobinLayout(), 3, 37), (ContiguousLayout(4), 3, 5), (ContiguousLayout(), 4, 1)],
)
def test_take_runs_backward_equals_index_select(
    layout: ClosedFormLayout, world: int, seq: int
) -> None:
    """Forward and backward, including ranks whose tokens are all pads (their result is still
    in the graph, with a zero gradient, as with index_select)."""
    padded = layout.padded_length(seq, world)
    emb = torch.randn(2, seq, 5, requires_grad=True)
    weight = torch.randn(2, padded // world, 5)
    for rank in range(world):
        idx = layout.local_indices(rank, world, padded)
        runs = layout.local_runs(rank, world, padded)
        (take_runs(emb, 1, runs, 0) * weight).sum().backward()
        got = emb.grad.clone()  # type: ignore[union-attr]
        emb.grad = None
        (pad_tokens(emb, 1, padded - seq, 0).index_select(1, idx) * weight).sum().backward()
        torch.testing.assert_close(got, emb.grad)
        emb.grad = None


@pytest.mark.parametrize(
    "layout", [RoundRobinLayout(), ContiguousLayout(3), NoneLayout(), _Striped()]
)
@pytest.mark.parametrize("seq", [6, 37])
def test_shard_batch_dense_equals_the_index_path(layout: ClosedFormLayout, seq: int) -> None:
    """cp=1 (no mesh): the whole batch through shard_batch_dense, against pad + index_select."""
    g = torch.Generator().manual_seed(seq)
    ids = torch.randint(1, 100, (3, seq), generator=g)
    keep = (torch.rand(3, seq, generator=g) > 0.3).long()
    batch = {"input_ids": ids, "labels": ids.clone(), "attention_mask": keep}
    ctx, out = shard_batch_dense(None, None, batch, padding_token_id=5, layout=layout)
    padded = layout.padded_length(seq, 1)
    idx = layout.local_indices(0, 1, padded)
    n = padded - seq
    want = {
        "input_ids": pad_tokens(ids, 1, n, 5).index_select(1, idx),
        "labels": pad_tokens(ids, 1, n, -100).index_select(1, idx),
        "padding_mask": pad_tokens(keep == 0, 1, n, True).index_select(1, idx),
        "position_ids": pad_tokens(torch.arange(seq).expand(3, seq), 1, n, None).index_select(
            1, idx
        ),
    }
    assert set(out) == set(want)
    for key, value in want.items():
        torch.testing.assert_close(out[key], value, rtol=0, atol=0)
    meta = ctx.facts.token_meta
    assert meta is not None
    pad_stream = pad_tokens(keep == 0, 1, n, True).index_select(1, idx)
    want_docs = torch.where(pad_stream, -1 - idx, 0)
    assert torch.equal(meta.document_ids, want_docs)


@pytest.mark.parametrize(
    "dtype", [torch.uint8, torch.int8, torch.int32, torch.int64, torch.float32]
)
def test_2d_keep_mask_values_checked_for_every_dtype(dtype: torch.dtype) -> None:
    """The keep-mask check (one min/max reduction for integers): 0/1 pass, any other value
    raises, wherever it is."""
    from cpshard.sharding.batch import attention_mask_to_padding_mask

    keep = torch.tensor([[1, 1, 0, 1], [0, 1, 1, 1]], dtype=dtype)
    assert attention_mask_to_padding_mask(keep).tolist() == (keep == 0).tolist()
    bad_values = [2] if dtype == torch.uint8 else [2, -1]
    if dtype.is_floating_point:
        bad_values.append(0.5)  # type: ignore[arg-type]
    for bad in bad_values:
        for where in ((0, 0), (1, 3)):
            wrong = keep.clone()
            wrong[where] = bad
            with pytest.raises(ValueError, match="must be a keep mask"):
                attention_mask_to_padding_mask(wrong)


def test_a_layout_of_many_runs_keeps_the_index_path() -> None:
    """More than MAX_RUNS runs per rank: no stream runs (copies go token by token), the same
    rank map and stream document ids."""
    world, seq = 3, 3 * (MAX_RUNS + 5)
    mask = torch.rand(2, seq, generator=torch.Generator().manual_seed(5)) < 0.2
    placement = _Striped().placement(world, 2, seq, mask, CPU)
    assert placement.stream_runs is None
    assert all(placement.local_runs(r) is None for r in range(world))
    assert torch.equal(placement.rank_map, _Striped().rank_map(world, seq))
    want = placement.document_ids.index_select(1, placement.rank_map.reshape(-1))
    assert torch.equal(placement.stream_document_ids(), want)
    few = _Striped().placement(world, 2, 3 * MAX_RUNS, None, CPU)
    assert few.stream_runs is not None and len(few.stream_runs) == 3 * MAX_RUNS
