"""Training loops on real gloo ranks: FSDP2 on dp x cp meshes, RL steps, accumulation."""

from __future__ import annotations

import pytest
from _training_fns import (
    accumulation_adamw,
    fsdp2_dp_cp,
    fsdp2_forgotten_sync_is_wrong,
    grpo_packed_step,
    pads_visible_to_consumers,
    sync_grads_errors,
    sync_grads_partial_none,
)

from _ranks import Ranks
from cpshard.names import PACKED_LAYOUTS

pytestmark = pytest.mark.multirank


@pytest.mark.parametrize("recipe", ["dp_shard+sync_grads", "flat_dp_cp+scale"])
def test_fsdp2_dp2_cp2_matches_one_process(ranks: Ranks, recipe: str) -> None:
    ranks(4, fsdp2_dp_cp, recipe)


def test_forgetting_sync_grads_is_caught(ranks: Ranks) -> None:
    errs = ranks(4, fsdp2_forgotten_sync_is_wrong)
    assert min(errs) > 1e-3


def test_sync_grads_errors(ranks: Ranks) -> None:
    ranks(4, sync_grads_errors)


@pytest.mark.parametrize(
    ("world", "mode", "layout"),
    [(2, "local", "balanced"), (3, "local", "packed"), (4, "gathered", "balanced")],
)
def test_grpo_step_on_packed_rows_matches_cp1(
    ranks: Ranks, world: int, mode: str, layout: str
) -> None:
    ranks(world, grpo_packed_step, mode, layout)


@pytest.mark.parametrize("world", [2, 3])
def test_accumulation_adamw_five_steps_matches_cp1(ranks: Ranks, world: int) -> None:
    ranks(world, accumulation_adamw)


@pytest.mark.parametrize("layout", [*PACKED_LAYOUTS, "dense"])  # dense: auto layout
def test_pads_visible_to_token_counting_consumers(ranks: Ranks, layout: str) -> None:
    ranks(3, pads_visible_to_consumers, layout)


@pytest.mark.parametrize("world", [1, 3])
def test_sync_grads_sums_partially_used_parameters(ranks: Ranks, world: int) -> None:
    ranks(world, sync_grads_partial_none)
