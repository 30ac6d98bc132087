"""The seed's sharder contract works unchanged (issue 17): facts recorded on the sharder inside
``shard_batch`` (``record_on=sharder``) and a sharder built with fact fields."""

from __future__ import annotations

import pytest
from _seed_contract_fns import (
    bound_sharder_outlives_later_shards,
    record_on_assignment_replaces_facts,
    seed_hook_records_on_sharder,
    sharder_built_with_facts,
)

from _ranks import Ranks

pytestmark = pytest.mark.multirank


@pytest.mark.parametrize("world", [1, 2, 3])
def test_seed_hook_recording_facts_on_its_sharder(ranks: Ranks, world: int) -> None:
    ranks(world, seed_hook_records_on_sharder, 11)


@pytest.mark.parametrize("world", [1, 3])
def test_sharder_constructed_with_fact_fields(ranks: Ranks, world: int) -> None:
    ranks(world, sharder_built_with_facts)


@pytest.mark.parametrize("world", [1, 2])
def test_bound_sharder_outlives_later_shards(ranks: Ranks, world: int) -> None:
    ranks(world, bound_sharder_outlives_later_shards, 9)


@pytest.mark.parametrize("world", [1, 2])
def test_record_on_assignment_replaces_facts(ranks: Ranks, world: int) -> None:
    ranks(world, record_on_assignment_replaces_facts)
