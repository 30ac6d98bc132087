"""Rank functions for the launcher tests (top-level, so ranks can import them)."""

from __future__ import annotations

import os

import torch
from torch.distributed.device_mesh import DeviceMesh

from cpshard import _comm


def rank_sum_and_threads(cp_mesh: DeviceMesh) -> tuple[int, int, float, int]:
    """(rank, world, sum of rank + 1 over ranks, torch threads of this rank)."""
    x = torch.tensor([float(cp_mesh.get_local_rank() + 1)])
    _comm.all_reduce_sum_(x, _comm.cp_group(cp_mesh))
    return cp_mesh.get_local_rank(), cp_mesh.size(), float(x), torch.get_num_threads()


def exit_on_rank(cp_mesh: DeviceMesh, bad: int) -> None:
    """Rank ``bad`` vanishes without a word; the others wait in a collective."""
    if cp_mesh.get_local_rank() == bad:
        os._exit(7)
    _comm.all_reduce_sum_(torch.ones(1), _comm.cp_group(cp_mesh))


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
