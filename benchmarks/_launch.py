"""Shared benchmark plumbing: fork gloo ranks, time with medians, count collective bytes."""

from __future__ import annotations

import os
import socket
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.utils._python_dispatch import TorchDispatchMode


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _wrap(
    rank: int, world: int, port: int, fn: Callable[..., Any], args: tuple[Any, ...], q: Any
) -> None:
    torch.set_num_threads(1)
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("cp",))
    try:
        q.put((rank, fn(mesh, *args)))
    finally:
        dist.destroy_process_group()


def run_ranks(world: int, fn: Callable[..., Any], *args: Any) -> list[Any]:
    """Run ``fn(cp_mesh, *args)`` on ``world`` forked gloo ranks (1 thread each)."""
    ctx = mp.get_context("fork")
    q = ctx.Queue()
    mp.start_processes(
        _wrap, args=(world, free_port(), fn, args, q), nprocs=world, start_method="fork"
    )
    got = dict(q.get() for _ in range(world))
    return [got[r] for r in range(world)]


def median_time(
    fn: Callable[[], Any],
    *,
    repeat: int = 20,
    warmup: int = 3,
    sync: Callable[[], None] | None = None,
) -> float:
    """Median wall time of ``fn()`` in seconds; ``sync`` runs before each timing."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeat):
        if sync is not None:
            sync()
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def paired_median_times(
    fns: list[Callable[[], Any]],
    *,
    repeat: int = 50,
    warmup: int = 3,
    sync: Callable[[], None] | None = None,
) -> list[float]:
    """Median times of several functions measured interleaved (a, b, a, b, ...).

    Interleaving makes slow drifts of a shared 2-core machine hit every candidate alike.
    """
    for fn in fns:
        for _ in range(warmup):
            fn()
    times: list[list[float]] = [[] for _ in fns]
    for _ in range(repeat):
        for i, fn in enumerate(fns):
            if sync is not None:
                sync()
            t0 = time.perf_counter()
            fn()
            times[i].append(time.perf_counter() - t0)
    return [statistics.median(t) for t in times]


class CommBytes(TorchDispatchMode):
    """Counts c10d collective calls and the bytes this rank hands to them as input."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: dict[str, int] = {}
        self.bytes_in = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        name = str(func)
        if name.startswith("c10d."):
            self.calls[name] = self.calls.get(name, 0) + 1
            # c10d collectives take (output(s), input(s), ...): count the input payload
            if len(args) > 1:
                inp = args[1]
                tensors = inp if isinstance(inp, (list, tuple)) else [inp]
                for t in tensors:
                    if isinstance(t, torch.Tensor):
                        self.bytes_in += t.numel() * t.element_size()
        return func(*args, **(kwargs or {}))
