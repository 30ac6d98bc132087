"""Collectives staged through host memory (several ranks on one GPU over gloo) equal direct ones."""

from __future__ import annotations

import pytest
from _staging_fns import staged_cp_sdpa_matches_direct, staged_matches_direct

from _ranks import Ranks
from cpshard.names import METHOD_NAMES

pytestmark = pytest.mark.multirank


@pytest.mark.parametrize("world", [2, 3])
def test_forced_host_staging_matches_direct(ranks: Ranks, world: int) -> None:
    for r, same in enumerate(ranks(world, staged_matches_direct)):
        assert len(same) >= 8
        assert all(same.values()), f"rank {r}: staged != direct for {same}"


@pytest.mark.parametrize("method", METHOD_NAMES)
def test_forced_host_staging_cp_sdpa(ranks: Ranks, method: str) -> None:
    assert all(ranks(2, staged_cp_sdpa_matches_direct, method))
