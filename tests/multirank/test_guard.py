"""Guard rails on real gloo ranks: divergent batches and verb inputs raise on every rank."""

from __future__ import annotations

import pytest
from _guard_fns import (
    bad_inputs_everywhere,
    ddp_wrapped_hf_model,
    divergent_batch,
    divergent_gather,
    hf_calls_under_ctx,
    no_aliasing,
    plain_model_without_position_ids,
    reference_model_on_policy_batch,
    routing,
    same_batch_passes,
    stale_state,
)

from _ranks import Ranks
from cpshard.names import DENSE_LAYOUTS

pytestmark = pytest.mark.multirank

DENSE = [
    "content",
    "swap",
    "attention_mask",
    "labels",
    "position_ids",
    "seq_len",
    "batch_size",
    "dtype",
    "extra_key",
    "layout",
    "attention",
    "pad_id",
    "invalid_here_only",
]


@pytest.mark.parametrize("variant", DENSE)
def test_divergent_dense_batch_raises_everywhere(ranks: Ranks, variant: str) -> None:
    msgs = ranks(2, divergent_batch, variant, False, False)
    assert len(set(msgs)) == 1  # the same error on every rank


@pytest.mark.parametrize("variant", ["content", "seq_lens", "seq_len", "layout"])
def test_divergent_packed_batch_raises_everywhere(ranks: Ranks, variant: str) -> None:
    msgs = ranks(3, divergent_batch, variant, True, False)
    assert len(set(msgs)) == 1


@pytest.mark.parametrize("variant", ["content", "seq_len", "pad_id"])
def test_divergent_batch_through_prepare_cp_forward(ranks: Ranks, variant: str) -> None:
    msgs = ranks(3, divergent_batch, variant, False, True)
    assert len(set(msgs)) == 1


@pytest.mark.parametrize("world", [1, 2, 3])
@pytest.mark.parametrize("packed", [False, True])
def test_same_batch_passes(ranks: Ranks, world: int, packed: bool) -> None:
    assert len(set(ranks(world, same_batch_passes, packed))) == 1


@pytest.mark.parametrize("variant", ["dtype", "shape", "not_a_tensor", "trim"])
def test_divergent_gather_raises_everywhere(ranks: Ranks, variant: str) -> None:
    msgs = ranks(2, divergent_gather, variant)
    assert len(set(msgs)) == 1


@pytest.mark.parametrize(
    "case",
    [
        "old_ctx_new_batch",
        "new_ctx_old_batch",
        "nested",
        "outside_ctx",
        "verb_of_other_batch",
        "reused_sharder",
        "same_batch_twice",
    ],
)
@pytest.mark.parametrize("world", [1, 2])
def test_stale_state_raises_everywhere(ranks: Ranks, world: int, case: str) -> None:
    msgs = ranks(world, stale_state, case)
    assert len(set(msgs)) == 1


@pytest.mark.parametrize("case", ["labels", "attention_mask", "outside_ctx", "no_position_ids"])
def test_hf_calls_under_ctx_raise(ranks: Ranks, case: str) -> None:
    msgs = ranks(2, hf_calls_under_ctx, case)
    assert len(set(msgs)) == 1


@pytest.mark.parametrize("world", [1, 3])
def test_model_without_position_ids_raises(ranks: Ranks, world: int) -> None:
    msgs = ranks(world, plain_model_without_position_ids)
    assert len(set(msgs)) == 1


@pytest.mark.parametrize("world", [2, 3])
def test_reference_model_under_its_own_ctx(ranks: Ranks, world: int) -> None:
    ranks(world, reference_model_on_policy_batch)


@pytest.mark.parametrize("world", [2, 3])
def test_ddp_wrapped_hf_model(ranks: Ranks, world: int) -> None:
    ranks(world, ddp_wrapped_hf_model)


def test_routing_and_suspend(ranks: Ranks) -> None:
    ranks(2, routing)


@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("layout", DENSE_LAYOUTS)
def test_no_aliasing(ranks: Ranks, world: int, layout: str) -> None:
    ranks(world, no_aliasing, layout)


@pytest.mark.parametrize("world", [2, 3])
def test_bad_inputs_raise_on_every_rank(ranks: Ranks, world: int) -> None:
    assert len(set(ranks(world, bad_inputs_everywhere))) == 1
