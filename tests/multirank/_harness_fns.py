"""Rank functions for the rank-pool and launcher self-tests (top-level, so ranks can import them).

One set for both ``test_harness.py`` (the pool in ``tests/_ranks.py``) and ``test_launch.py``
(``cpshard.tools.launch`` itself); the launcher-only ones (pipe-sized payloads, the script whose
parent dies) live in ``_launch_fns.py``.
"""

from __future__ import annotations

import os
import time

import torch
from torch.distributed.device_mesh import DeviceMesh

from cpshard import _comm


def rank_sum_and_threads(cp_mesh: DeviceMesh) -> tuple[int, int, float, int]:
    """(rank, world, sum of rank + 1 over ranks, torch threads of this rank)."""
    x = torch.tensor([float(cp_mesh.get_local_rank() + 1)])
    _comm.all_reduce_sum_(x, _comm.cp_group(cp_mesh))
    return cp_mesh.get_local_rank(), cp_mesh.size(), float(x), torch.get_num_threads()


def raise_on_rank(cp_mesh: DeviceMesh, bad: int) -> None:
    """Rank ``bad`` raises ``RuntimeError("boom on rank <bad>")``; the others wait in a reduce."""
    if cp_mesh.get_local_rank() == bad:
        raise RuntimeError(f"boom on rank {bad}")
    _comm.all_reduce_sum_(torch.ones(1), _comm.cp_group(cp_mesh))


def exit_on_rank(cp_mesh: DeviceMesh, bad: int) -> None:
    """Rank ``bad`` vanishes without a word (exit code 7); the others wait in a collective."""
    if cp_mesh.get_local_rank() == bad:
        os._exit(7)
    _comm.all_reduce_sum_(torch.ones(1), _comm.cp_group(cp_mesh))


def hang(cp_mesh: DeviceMesh, seconds: float) -> None:
    """Sleep ``seconds`` (a rank that does not answer)."""
    time.sleep(seconds)
