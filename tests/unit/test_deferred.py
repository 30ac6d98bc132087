"""Fields made on first read (:mod:`cpshard.layouts.deferred`): a packed plan's input map is made
only when something reads it, once, and reads the same as one made at once."""

from __future__ import annotations

import copy
import dataclasses
import pickle

import pytest
import torch
from test_packed_shard_pieces import _RankOf

from cpshard.layouts.deferred import Deferred, DeferredField, raw, replace
from cpshard.layouts.documents import PackSpec
from cpshard.layouts.packed import plan_packed
from cpshard.sharding import packed as packed_shard


@dataclasses.dataclass(frozen=True)
class _Base:
    a: int
    b: list[int] | None = DeferredField(default=None)  # type: ignore[assignment]  # noqa: RUF009


@dataclasses.dataclass(frozen=True)
class _Child(_Base):
    c: int = 0


@dataclasses.dataclass(frozen=True)
class _Required:
    r: int = DeferredField()  # type: ignore[assignment]


def test_made_once_on_first_read_and_handed_on_unmade() -> None:
    made: list[int] = []

    def make() -> list[int]:
        made.append(1)
        return [4, 5]

    x = _Child(1, Deferred(make), c=2)  # type: ignore[arg-type]
    y = replace(x, c=3)  # the maker handed on, not made
    assert isinstance(raw(x, "b"), Deferred) and raw(y, "b") is raw(x, "b") and not made
    assert raw(x, "a") == 1  # a plain field reads as itself
    assert x.b == [4, 5] and y.b == [4, 5] and made == [1]  # one maker, made once
    assert raw(x, "b") == [4, 5]  # kept in the instance
    assert x == replace(y, c=2) and x != y
    assert "b=[4, 5]" in repr(x)
    assert _Child(1).b is None  # the default
    with pytest.raises(dataclasses.FrozenInstanceError):
        x.b = [1]  # type: ignore[misc]
    with pytest.raises(TypeError, match="missing 1 required positional argument"):
        _Required()  # type: ignore[call-arg]
    assert _Required(7).r == 7
    for copied in (
        pickle.loads(pickle.dumps(_Child(1, Deferred(make)))),  # type: ignore[arg-type]
        copy.deepcopy(_Child(1, Deferred(make))),  # type: ignore[arg-type]
    ):
        assert copied.b == [4, 5] and not isinstance(raw(copied, "b"), Deferred)


def test_a_packed_shard_leaves_the_input_map_unmade_until_read() -> None:
    """The shard's facts carry the map's maker; read, it equals the map spelled out token by
    token; the plan's own map reads the same."""

    rows = [[3, 9], [], [1, 1, 6]]
    spec = PackSpec.from_seq_lens(rows, 12)
    ids = torch.arange(1, 37).reshape(3, 12)
    mesh: object = _RankOf(0, 2)
    ctx, _ = packed_shard.shard_batch_packed(
        mesh,  # type: ignore[arg-type]
        None,
        {"input_ids": ids, "seq_lens": rows},
        layout="packed",
    )
    facts = ctx.facts
    assert isinstance(raw(facts, "input_token_stream_positions"), Deferred)
    plan = plan_packed(spec, 2)  # TE: every document padded to a multiple of 4
    want = torch.full((3, 12), -1)
    at = 0
    for r, lens in enumerate(rows):
        col = 0
        for n in lens:
            want[r, col : col + n] = torch.arange(at, at + n)
            col += n
            at += -(-n // 4) * 4
    made = facts.input_token_stream_positions
    assert made is not None and torch.equal(made, want)
    assert torch.equal(plan.input_token_stream_positions, want)
    assert facts.placement is not None
    coordinates = facts.placement.coordinates.input_token_stream_positions
    assert coordinates is not None and torch.equal(coordinates, want)
