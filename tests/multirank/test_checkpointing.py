"""Activation checkpointing under CP: the recomputation in backward() is CP attention too."""

from __future__ import annotations

import pytest
from _checkpoint_fns import hf_checkpointed, tiny_checkpointed, tiny_checkpointed_without_context

from _ranks import Ranks

pytestmark = pytest.mark.multirank


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("backward_inside", [False, True])
def test_checkpoint_context_fn_gradients_equal_cp1(
    ranks: Ranks, world: int, backward_inside: bool
) -> None:
    ranks(world, tiny_checkpointed, backward_inside)


def test_checkpoint_without_context_fn_raises_on_every_rank(ranks: Ranks) -> None:
    msgs = ranks(2, tiny_checkpointed_without_context)
    assert all("silently be local" in m for m in msgs)


def test_hf_gradient_checkpointing_with_context_fn_equals_cp1(ranks: Ranks) -> None:
    ranks(2, hf_checkpointed, "context_fn")


@pytest.mark.parametrize("case", ["reentrant", "no_context_fn"])
def test_hf_gradient_checkpointing_without_context_fn_raises(ranks: Ranks, case: str) -> None:
    msgs = ranks(2, hf_checkpointed, case)
    assert len(set(msgs)) == 1 and "silently wrong gradients" in msgs[0]
