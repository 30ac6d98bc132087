"""The one launcher (cpshard.tools.launch): results, fast failure, no hang, no rendezvous race."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from _harness_fns import exit_on_rank, raise_on_rank, rank_sum_and_threads
from _launch_fns import big_result, blob_len

from _ranks import CALL_DEADLINE_S, PG_TIMEOUT_S, Ranks
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
    pool = LocalRanks(3, pg_timeout_s=PG_TIMEOUT_S, grace_s=1.0)
    t0 = time.monotonic()
    with pytest.raises(RankFailure, match=r"(?s)rank 2 raised.*Traceback.*boom on rank 2") as err:
        pool.run(raise_on_rank, 2)
    assert time.monotonic() - t0 < 120  # the grace, not the 900 s process-group timeout
    assert [o.status for o in err.value.outcomes][2] == "raised"
    assert not pool.alive() and not os.path.exists(pool.store_dir)


def test_exiting_rank_is_an_error_not_a_hang(ranks: Ranks) -> None:
    t0 = time.monotonic()
    with pytest.raises(RankFailure, match=r"rank 1: died \(exit code 7\)") as err:
        ranks(2, exit_on_rank, 1)
    assert time.monotonic() - t0 < 120  # seen by the liveness check, not a deadline
    assert err.value.outcomes[1].status == "died"
    assert ranks(2, rank_sum_and_threads) == _expected(2)  # a fresh pool after the failure


def _stop(pid: int | None) -> None:
    """SIGSTOP ``pid`` and wait until it is stopped (it reads nothing from then on)."""
    assert pid is not None
    os.kill(pid, signal.SIGSTOP)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        with open(f"/proc/{pid}/stat") as f:
            if f.read().rsplit(")", 1)[1].split()[0] == "T":
                return
        time.sleep(0.01)
    raise AssertionError(f"process {pid} did not stop")


def test_arguments_and_results_larger_than_a_pipe() -> None:
    n = 8 << 20
    with LocalRanks(2) as pool:
        assert pool.run(blob_len, b"x" * n) == [n, n]
        assert pool.run(big_result, n) == [b"\0" * n, b"\1" * n]


def test_interrupt_while_sending_ends_the_ranks() -> None:
    """Ctrl-C while the parent is blocked handing a large task to a rank that does not read (here:
    stopped) ends every rank instead of leaving a half-sent task in a pool that looks alive."""

    def interrupt(*_: object) -> None:
        raise KeyboardInterrupt

    pool = LocalRanks(2)
    previous = signal.signal(signal.SIGALRM, interrupt)
    try:
        pool.run(rank_sum_and_threads)  # both ranks past the rendezvous, idle
        _stop(pool._procs[1].pid)
        signal.setitimer(signal.ITIMER_REAL, 1.0)
        with pytest.raises(KeyboardInterrupt):
            pool.run(blob_len, b"x" * (16 << 20))
        assert not pool.alive()
        assert all(p.exitcode is not None for p in pool._procs)  # killed and reaped
        assert not os.path.exists(pool.store_dir)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
        pool.close()


def test_close_does_not_wait_on_a_rank_that_does_not_read() -> None:
    """A rank whose pipe is full (stopped, or stuck outside its loop) is killed by close(), which
    never blocks writing its polite stop."""

    class Hung(Exception):  # not an OSError, which close() may suppress
        pass

    def hung(*_: object) -> None:
        raise Hung("close() blocked")

    pool = LocalRanks(2)
    previous = signal.signal(signal.SIGALRM, hung)
    try:
        pool.run(rank_sum_and_threads)
        _stop(pool._procs[1].pid)
        fd = pool._conns[1].fileno()
        os.set_blocking(fd, False)
        for size in (65536, 4096, 64, 1):  # fill it to the last byte
            with contextlib.suppress(BlockingIOError):
                while True:
                    os.write(fd, b"\1" * size)
        os.set_blocking(fd, True)
        signal.setitimer(signal.ITIMER_REAL, 20.0)
        pool.close()
        signal.setitimer(signal.ITIMER_REAL, 0)
        assert all(p.exitcode is not None for p in pool._procs)
        assert not os.path.exists(pool.store_dir)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
        for p in pool._procs:
            if p.is_alive():
                p.kill()


def _running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_killed_parent_leaves_no_ranks_and_no_directory() -> None:
    """A parent killed without closing its pool (SIGKILL here; SIGTERM likewise runs no atexit
    and no finalizer): its ranks notice within seconds, exit and remove the rendezvous directory."""
    signum = signal.SIGKILL
    script = Path(__file__).with_name("_launch_fns.py")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    out = subprocess.run(
        [sys.executable, str(script), str(int(signum))],
        capture_output=True, text=True, timeout=CALL_DEADLINE_S, env=env,
    )  # fmt: skip
    assert out.returncode == -signum, out.stderr
    store_dir, *pids = out.stdout.split()
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and (
        os.path.exists(store_dir) or any(_running(int(p)) for p in pids)
    ):
        time.sleep(0.1)
    assert not any(_running(int(p)) for p in pids), pids
    assert not os.path.exists(store_dir), os.listdir(store_dir)


def test_concurrent_launchers_rendezvous_separately() -> None:
    """Two launchers started at once, several times: each meets its own ranks (the race that a
    port picked, released and handed to the children had)."""
    results: dict[int, list[object]] = {0: [], 1: []}

    def launch(i: int) -> None:
        for _ in range(3):
            try:
                results[i].append(run_local_ranks(2, rank_sum_and_threads))
            except Exception as e:  # reported below
                results[i].append(e)

    threads = [threading.Thread(target=launch, args=(i,)) for i in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=2 * CALL_DEADLINE_S)
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
    with pytest.raises(ValueError, match="backend must be 'gloo' or 'nccl'"):
        LocalRanks(2, backend="mpi")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="backend='nccl' needs start_method='spawn'"):
        LocalRanks(1, backend="nccl")
    gpus = torch.cuda.device_count()
    with pytest.raises(ValueError, match=f"needs {gpus + 1} visible CUDA devices, found {gpus}"):
        LocalRanks(gpus + 1, backend="nccl", start_method="spawn")
