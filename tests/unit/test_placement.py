"""The one frozen Placement every layout ends in, and the custom sharder's public toolkit."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch.testing import assert_close

import cpshard
from cpshard.layouts.packed import plan_packed
from cpshard.sharding import (
    CallerCoordinates,
    TokenMeta,
    facts_from_placement,
    pad_tokens,
    pad_value,
)

CPU = torch.device("cpu")


def test_closed_form_placement_worked_example() -> None:
    """DESIGN.md: round_robin C=2, P=8: r0 [0,1,6,7], r1 [2,3,4,5]; CP pads are documents of
    their own (negative, unique), the real tokens of a row one document."""
    pad = torch.tensor([[False] * 7, [False] * 5 + [True] * 2])
    place = cpshard.RoundRobinLayout().placement(2, 2, 7, pad, CPU)
    assert place.rank_map.tolist() == [[0, 1, 6, 7], [2, 3, 4, 5]]
    assert (place.world_size, place.padded_len, place.local_len) == (2, 8, 4)
    assert place.document_ids.tolist() == [[0] * 7 + [-8], [0] * 5 + [-6, -7, -8]]
    coords = place.coordinates
    assert (coords.original_seq_len, coords.padded_seq_len) == (7, 8)
    unpadded = cpshard.NoneLayout().placement(1, 3, 5, None, CPU)
    assert unpadded.document_ids.tolist() == [[0] * 5]  # one row stands for all


def test_packed_placement_worked_example() -> None:
    """DESIGN.md: packed cu=[0,8,16], C=2: r0 [0,1,6,7,8,9,14,15], r1 [2,3,4,5,10,11,12,13]."""
    spec = cpshard.PackSpec.from_cu_seqlens(torch.tensor([0, 8, 16]), 16)
    plan = plan_packed(spec, 2)
    place = plan.placement(CPU)
    assert place.rank_map.tolist() == [[0, 1, 6, 7, 8, 9, 14, 15], [2, 3, 4, 5, 10, 11, 12, 13]]
    assert place.document_ids.tolist() == [[0] * 8 + [1] * 8]
    assert place.coordinates.input_row_shape == (1, 16)
    assert_close(place.coordinates.input_token_stream_positions, torch.arange(16).view(1, 16))
    caller_pad = torch.zeros(16, dtype=torch.bool)
    caller_pad[3] = True  # a caller pad inside a document sees only itself
    assert place.document_ids[0, 3] == 0 and plan.placement(CPU, caller_pad).document_ids[0, 3] < 0


def test_token_meta_and_facts_derive_from_the_placement() -> None:
    place = cpshard.RoundRobinLayout().placement(2, 1, 6, None, CPU)
    for rank in (0, 1):
        meta = TokenMeta.of(place, rank)
        assert meta.placement is place and (meta.rank, meta.world_size) == (rank, 2)
        assert_close(meta.positions, place.rank_map.reshape(1, -1))
        assert_close(meta.local()[0][0], place.rank_map[rank])
        facts = cpshard.ShardFacts.of(place, rank)
        assert facts.rank_map is place.rank_map and facts.placement is place
        assert (facts.original_seq_len, facts.padded_seq_len) == (6, 8)
    assert facts_from_placement(cpshard.NoneLayout().placement(1, 1, 3, None, CPU), None).token_meta
    with pytest.raises(ValueError, match="spreads the batch over 2 ranks, but the CP mesh has 1"):
        facts_from_placement(place, None)


def test_placement_is_frozen_and_checked() -> None:
    place = cpshard.NoneLayout().placement(1, 1, 4, None, CPU)
    with pytest.raises(dataclasses.FrozenInstanceError):
        place.document_ids = place.document_ids  # type: ignore[misc]
    assert place != cpshard.NoneLayout().placement(1, 1, 4, None, CPU)  # identity: a cache key
    with pytest.raises(ValueError, match="needs rank_map \\[C, L\\]"):
        cpshard.Placement(torch.arange(4), place.document_ids, place.coordinates)
    with pytest.raises(ValueError, match="coordinates.padded_seq_len is 5"):
        cpshard.Placement(place.rank_map, place.document_ids, CallerCoordinates(4, 5))


def test_pad_table_toolkit() -> None:
    ids = torch.tensor([[3, 4, 5]])
    assert pad_tokens(ids, 1, 2, pad_value("input_ids", 9)).tolist() == [[3, 4, 5, 9, 9]]
    assert pad_tokens(ids, 1, 2, pad_value("labels", 9)).tolist() == [[3, 4, 5, -100, -100]]
    pos = torch.tensor([[0, 1, 2]])
    assert pad_tokens(pos, 1, 2, pad_value("position_ids", 0)).tolist() == [[0, 1, 2, 3, 4]]
    assert pad_tokens(ids, 1, 0, 1) is ids
    extra = {"adv": cpshard.TokenKey(seq_dim=1, pad=0.5)}
    assert pad_value("adv", 0, extra) == 0.5 and pad_value("padding_mask", 0) is True
    emb = torch.ones(1, 2, 3)
    assert_close(pad_tokens(emb, 1, 1, pad_value("inputs_embeds", 0))[0, 2], torch.zeros(3))
    with pytest.raises(KeyError):
        pad_value("adv", 0)
