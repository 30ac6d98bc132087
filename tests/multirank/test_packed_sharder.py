"""Packed batches through the dispatcher on real gloo ranks (world sizes 1-4)."""

from __future__ import annotations

import pytest
from _packed_fns import (
    packed_attention,
    packed_attention_lens,
    packed_attention_window,
    packed_bad_inputs,
    packed_corpus_batch,
    packed_embeds_grad,
    packed_errors,
    packed_from_positions,
    packed_keys_verbs_grads,
    packed_round_trip,
)

from _ranks import Ranks
from cpshard.names import ATTENTION_CHOICES, PACKED_LAYOUTS

pytestmark = pytest.mark.multirank


@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("layout", PACKED_LAYOUTS)
@pytest.mark.parametrize("use_cu", [False, True])
def test_packed_round_trip(ranks: Ranks, world: int, layout: str, use_cu: bool) -> None:
    maps = ranks(world, packed_round_trip, layout, use_cu)
    flat = sorted(p for m in maps for p in m)
    assert flat == list(range(len(flat)))  # the ranks' shards tile the padded stream


@pytest.mark.parametrize("world", [1, 3])
@pytest.mark.parametrize("layout", PACKED_LAYOUTS)
def test_packed_embeds_grad(ranks: Ranks, world: int, layout: str) -> None:
    ranks(world, packed_embeds_grad, layout)


def test_packed_errors(ranks: Ranks) -> None:
    ranks(2, packed_errors)


@pytest.mark.parametrize("world", [1, 2, 4])
def test_packed_corpus_batch(ranks: Ranks, world: int) -> None:
    ranks(world, packed_corpus_batch)


@pytest.mark.parametrize("world", [1, 2, 3])
@pytest.mark.parametrize("layout", PACKED_LAYOUTS)
def test_packed_from_restarting_positions(ranks: Ranks, world: int, layout: str) -> None:
    ranks(world, packed_from_positions, layout)


CASES = 2 * len(ATTENTION_CHOICES)  # (method or "auto") x (cp_attention, ctx) per rank


@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("layout", PACKED_LAYOUTS)
@pytest.mark.parametrize("pack", ["seq_lens", "cu_seqlens"])
@pytest.mark.parametrize("seed", [0, 1])
def test_packed_attention_matches_one_process(
    ranks: Ranks, world: int, layout: str, pack: str, seed: int
) -> None:
    """Attention on a packed batch sharded by the dispatcher equals one fp64 process, forward
    and backward, for every method, through cp_attention and through ctx() + plain SDPA."""
    assert ranks(world, packed_attention, layout, pack, seed) == [CASES] * world


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("layout", PACKED_LAYOUTS)
def test_packed_attention_sliding_window(ranks: Ranks, world: int, layout: str) -> None:
    """Windows of 1, 3 and 8 over packed documents, every method, both paths."""
    for window in (1, 3, 8):
        assert ranks(world, packed_attention_window, layout, window) == [CASES] * world


EDGE_PACKS = {
    "all_pad_row": ([[3, 1], [], [2, 5]], 8),
    "all_pad_first_row": ([[], [6, 1, 1]], 8),
    "one_long_document": ([[40], [1, 1, 1], [2]], 40),
    "fewer_documents_than_ranks": ([[5, 6]], 12),
    "one_token_per_rank": ([[1, 1, 1, 1]], 4),
}


@pytest.mark.parametrize("world", [2, 3, 4])
@pytest.mark.parametrize("layout", PACKED_LAYOUTS)
@pytest.mark.parametrize("case", list(EDGE_PACKS))
def test_packed_attention_edge_packs(ranks: Ranks, world: int, layout: str, case: str) -> None:
    """All-padding rows, one document longer than all others, C > documents, C == tokens."""
    seq_lens, row_len = EDGE_PACKS[case]
    if case == "one_token_per_rank":
        seq_lens, row_len = [[1] * world], world
    assert ranks(world, packed_attention_lens, layout, seq_lens, row_len) == [CASES] * world


@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("layout", PACKED_LAYOUTS)
def test_bad_packed_inputs_raise_on_every_rank(ranks: Ranks, world: int, layout: str) -> None:
    """cu_seqlens not from 0 / not increasing / not ending at T, seq_lens not fitting or
    negative, more ranks than tokens, packed batches for layouts without documents (by name,
    as a closed-form ``cp_sharder``, or from a model-owned hook): the same
    ValueError on every rank through the dispatcher, no hang, the caller's batch unchanged."""
    names = ranks(world, packed_bad_inputs, layout)
    assert all(n == names[0] for n in names)
    assert len(names[0]) == 22 + (world > 1) + (world > 3)


@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("layout", PACKED_LAYOUTS)
def test_packed_keys_verbs_and_grads(ranks: Ranks, world: int, layout: str) -> None:
    ranks(world, packed_keys_verbs_grads, layout)
