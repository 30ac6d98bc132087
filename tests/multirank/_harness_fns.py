"""Rank functions for the harness self-tests (top-level, so ranks can import them)."""

from __future__ import annotations

import time

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh


def rank_and_sum(cp_mesh: DeviceMesh) -> tuple[int, int, float]:
    x = torch.tensor([float(cp_mesh.get_local_rank() + 1)])
    dist.all_reduce(x, group=cp_mesh.get_group())
    return cp_mesh.get_local_rank(), cp_mesh.size(), float(x)


def raise_on_rank(cp_mesh: DeviceMesh, bad: int) -> None:
    if cp_mesh.get_local_rank() == bad:
        raise RuntimeError(f"boom on rank {bad}")
    x = torch.ones(1)
    dist.all_reduce(x, group=cp_mesh.get_group())  # the others block here


def hang(cp_mesh: DeviceMesh, seconds: float) -> None:
    time.sleep(seconds)
