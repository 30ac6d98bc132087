"""The rank pool itself: results, reuse, and fast failure."""

from __future__ import annotations

import time

import pytest
from _harness_fns import hang, raise_on_rank, rank_sum_and_threads

from _ranks import RankFailure, Ranks

pytestmark = pytest.mark.multirank


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_ranks_run_collectives(ranks: Ranks, world: int) -> None:
    out = ranks(world, rank_sum_and_threads)
    total = world * (world + 1) / 2
    assert out == [(r, world, total, 1) for r in range(world)]


def test_failing_rank_fails_fast_with_tracebacks(ranks: Ranks) -> None:
    t0 = time.monotonic()
    with pytest.raises(RankFailure, match=r"(?s)rank 1 raised.*boom on rank 1"):
        ranks(3, raise_on_rank, 1)
    assert time.monotonic() - t0 < 120  # the grace, not the process-group timeout
    # the pool is rebuilt for the next test
    assert ranks(3, rank_sum_and_threads)[0] == (0, 3, 6.0, 1)


def test_hung_rank_fails_within_timeout(ranks: Ranks) -> None:
    t0 = time.monotonic()
    with pytest.raises(RankFailure, match="no answer"):
        ranks(2, hang, 30.0, timeout=2.0)
    assert time.monotonic() - t0 < 60  # the 2 s deadline plus killing the ranks
