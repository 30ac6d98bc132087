"""Batch identity under CP (issue 17): a sharder bound to its batch outlives later shards, one
that has sharded another batch since raises, checkpointing enabled after the prepare."""

from __future__ import annotations

import pytest
from _staleness_fns import (
    copies_keep_batch_identity,
    hf_checkpointing_enabled_after_prepare,
    stale_sharder_in_cp_attention,
)

from _ranks import Ranks

pytestmark = pytest.mark.multirank


@pytest.mark.parametrize("world", [1, 2, 3])
def test_cp_attention_with_a_resharded_sharder(ranks: Ranks, world: int) -> None:
    assert len(set(ranks(world, stale_sharder_in_cp_attention))) == 1


@pytest.mark.parametrize("world", [1, 2])
def test_hf_checkpointing_enabled_after_prepare_raises_at_the_forward(
    ranks: Ranks, world: int
) -> None:
    assert len(set(ranks(world, hf_checkpointing_enabled_after_prepare))) == 1


@pytest.mark.parametrize(("world", "copy"), [(1, "clone"), (2, "to"), (3, "clone")])
def test_copies_of_local_tensors_keep_their_batch_identity(
    ranks: Ranks, world: int, copy: str
) -> None:
    msgs = ranks(world, copies_keep_batch_identity, copy)
    assert all(m == msgs[0] for m in msgs)
