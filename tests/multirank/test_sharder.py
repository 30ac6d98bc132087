"""CPSharder on real gloo ranks: round trips, pad table, gradients, errors (world sizes 1-4)."""

from __future__ import annotations

import pytest
from _sharder_fns import (
    bad_gather_raises_everywhere,
    embeds_grad,
    facts_replaced_per_shard,
    grads,
    mesh_2d_rejected,
    original_len_needs_fill,
    pad_table,
    round_trip,
    third_party_sharders,
)

from _ranks import Ranks
from cpshard.names import DENSE_LAYOUTS, PACKED_LAYOUTS

pytestmark = pytest.mark.multirank
WORLDS = [1, 2, 3, 4]


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize(
    ("layout", "pad_mult"), [("round_robin", 1), ("contiguous", 1), ("contiguous", 3)]
)
@pytest.mark.parametrize("seq_len", [1, 13, 24])
def test_round_trip_layouts_and_lengths(
    ranks: Ranks, world: int, layout: str, pad_mult: int, seq_len: int
) -> None:
    out = ranks(world, round_trip, layout, seq_len, "bs", "float32", pad_mult)
    assert len(set(out)) == 1


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("shape_kind", ["bks", "sk"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "int64", "bool"])
def test_round_trip_seq_dims_and_dtypes(
    ranks: Ranks, world: int, shape_kind: str, dtype: str
) -> None:
    ranks(world, round_trip, "round_robin", 13, shape_kind, dtype, 1)


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("layout", DENSE_LAYOUTS)
def test_pad_table_and_no_mutation(ranks: Ranks, world: int, layout: str) -> None:
    ranks(world, pad_table, layout)


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("mode", ["sum", "replicated"])
@pytest.mark.parametrize("trim", [True, False])
def test_gather_gradients_match_single_process(
    ranks: Ranks, world: int, mode: str, trim: bool
) -> None:
    ranks(world, grads, mode, trim)


@pytest.mark.parametrize("world", [1, 3])
def test_inputs_embeds_gradients_flow(ranks: Ranks, world: int) -> None:
    ranks(world, embeds_grad)


def test_two_d_mesh_rejected(ranks: Ranks) -> None:
    msgs = ranks(4, mesh_2d_rejected)
    assert len(set(msgs)) == 1


@pytest.mark.parametrize("world", [2, 4])
def test_bad_lengths_raise_on_every_rank(ranks: Ranks, world: int) -> None:
    msgs = ranks(world, bad_gather_raises_everywhere)
    assert len(set(msgs)) == 1


@pytest.mark.parametrize("world", [2, 3])
def test_original_length_needs_fill(ranks: Ranks, world: int) -> None:
    ranks(world, original_len_needs_fill)


@pytest.mark.parametrize("world", WORLDS)
def test_third_party_sharders(ranks: Ranks, world: int) -> None:
    ranks(world, third_party_sharders)


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("layout", [*DENSE_LAYOUTS, *PACKED_LAYOUTS])
def test_facts_replaced_per_shard(ranks: Ranks, world: int, layout: str) -> None:
    ranks(world, facts_replaced_per_shard, layout)
