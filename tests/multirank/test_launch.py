"""The one launcher (cpshard.tools.launch): results, fast failure, no hang, no rendezvous race."""

from __future__ import annotations

import os
import threading
import time

import pytest
from _harness_fns import raise_on_rank
from _launch_fns import exit_on_rank, rank_sum_and_threads

from _ranks import Ranks
from cpshard.launch import run_local_ranks
from cpshard.tools.launch import LocalRanks, RankFailure

pytestmark = pytest.mark.multirank


def _expected(world: int) -> list[tuple[int, int, float, int]]:
    return [(r, world, world * (world + 1) / 2, 1) for r in range(world)]


@pytest.mark.parametrize("world", [1, 3])
def test_run_local_ranks_one_thread_per_rank(world: int) -> None:
    assert run_local_ranks(world, rank_sum_and_threads) == _expected(world)


def test_pool_is_reused_and_its_rendezvous_directory_removed() -> None:
    with LocalRanks(2) as pool:
        store_dir = pool.store_dir
        assert os.path.isdir(store_dir)
        pids = [p.pid for p in pool._procs]
        assert pool.run(rank_sum_and_threads) == _expected(2)
        assert pool.run(rank_sum_and_threads) == _expected(2)
        assert [p.pid for p in pool._procs] == pids and pool.alive()
    assert not os.path.exists(store_dir)
    assert not pool.alive()
    with pytest.raises(RuntimeError, match="closed pool"):
        pool.run(rank_sum_and_threads)


def test_raising_rank_fails_fast_with_its_traceback_and_cleans_up() -> None:
    pool = LocalRanks(3, pg_timeout_s=60.0, grace_s=1.0)
    t0 = time.monotonic()
    with pytest.raises(RankFailure, match=r"(?s)rank 2 raised.*Traceback.*boom on rank 2") as err:
        pool.run(raise_on_rank, 2)
    assert time.monotonic() - t0 < 15  # the grace, not the 60 s process-group timeout
    assert [o.status for o in err.value.outcomes][2] == "raised"
    assert not pool.alive() and not os.path.exists(pool.store_dir)


def test_exiting_rank_is_an_error_not_a_hang(ranks: Ranks) -> None:
    t0 = time.monotonic()
    with pytest.raises(RankFailure, match=r"rank 1: died \(exit code 7\)") as err:
        ranks(2, exit_on_rank, 1)
    assert time.monotonic() - t0 < 15
    assert err.value.outcomes[1].status == "died"
    assert ranks(2, rank_sum_and_threads) == _expected(2)  # a fresh pool after the failure


def test_concurrent_launchers_rendezvous_separately() -> None:
    """Two launchers started at once, several times: each meets its own ranks (the race that a
    port picked, released and handed to the children had)."""
    results: dict[int, list[object]] = {0: [], 1: []}

    def launch(i: int) -> None:
        for _ in range(3):
            try:
                results[i].append(run_local_ranks(2, rank_sum_and_threads, timeout_s=60.0))
            except Exception as e:  # reported below
                results[i].append(e)

    threads = [threading.Thread(target=launch, args=(i,)) for i in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in threads)
    assert results == {0: [_expected(2)] * 3, 1: [_expected(2)] * 3}


def test_spawned_ranks_for_gpu_callers() -> None:
    """start_method="spawn" (what a CUDA caller needs) rendezvouses the same way."""
    with LocalRanks(2, start_method="spawn") as pool:
        assert pool.run(rank_sum_and_threads) == _expected(2)
    assert not os.path.exists(pool.store_dir)


def test_bad_arguments_are_refused_before_any_fork() -> None:
    with pytest.raises(ValueError, match="world must be >= 1"):
        LocalRanks(0)
    with pytest.raises(ValueError, match="pg_timeout_s must be > 0"):
        LocalRanks(2, pg_timeout_s=0)
    with pytest.raises(ValueError, match="start_method must be 'fork' or 'spawn'"):
        LocalRanks(2, start_method="forkserver")  # type: ignore[arg-type]
