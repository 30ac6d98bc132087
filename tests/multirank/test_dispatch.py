"""prepare_cp_forward with model-owned CP (the hook wins over every built-in layout)."""

from __future__ import annotations

import pytest
from _dispatch_fns import (
    checks_once_one_collective,
    hook_errors,
    model_owned_hook,
    model_owned_map_errors,
    options_raise_on_every_rank,
)

from _ranks import Ranks

pytestmark = pytest.mark.multirank


@pytest.mark.parametrize("world", [1, 2, 3])
@pytest.mark.parametrize("through_forward", [False, True])
def test_model_owned_hook(ranks: Ranks, world: int, through_forward: bool) -> None:
    ranks(world, model_owned_hook, through_forward)


def test_hook_errors(ranks: Ranks) -> None:
    ranks(2, hook_errors)


@pytest.mark.parametrize("world", [2, 3])
def test_model_owned_map_must_be_a_bijection(ranks: Ranks, world: int) -> None:
    ranks(world, model_owned_map_errors)


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("packed", [False, True])
def test_each_check_once_and_one_collective_per_prepare(
    ranks: Ranks, world: int, packed: bool
) -> None:
    ranks(world, checks_once_one_collective, packed)


def test_invalid_options_raise_on_every_rank(ranks: Ranks) -> None:
    ranks(2, options_raise_on_every_rank)
