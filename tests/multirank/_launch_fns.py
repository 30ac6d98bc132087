"""Launcher-only rank functions (top-level, so ranks can import them); the ones shared with
the pool's self-tests are in ``_harness_fns.py``."""

from __future__ import annotations

import os

from _harness_fns import rank_sum_and_threads
from torch.distributed.device_mesh import DeviceMesh


def blob_len(cp_mesh: DeviceMesh, blob: bytes) -> int:
    """The size of an argument (to send the ranks more than a pipe holds)."""
    return len(blob)


def big_result(cp_mesh: DeviceMesh, n: int) -> bytes:
    """``n`` bytes tagged with the rank (a result more than a pipe holds)."""
    return bytes([cp_mesh.get_local_rank()]) * n


def start_ranks_and_die(signum: int) -> None:
    """A parent that starts 2 ranks, prints their rendezvous directory and pids, then dies by
    ``signum`` without closing them (run as a script: ``python _launch_fns.py <signum>``)."""
    from cpshard.tools.launch import LocalRanks

    pool = LocalRanks(2)
    pool.run(rank_sum_and_threads)
    print(pool.store_dir, *(p.pid for p in pool._procs), flush=True)
    os.kill(os.getpid(), signum)


if __name__ == "__main__":
    import sys

    start_ranks_and_die(int(sys.argv[1]))
