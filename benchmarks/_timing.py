"""Shared benchmark plumbing: time with medians, count collective bytes.

Ranks are launched with :func:`cpshard.launch.run_local_ranks` (forked gloo, 1 thread each).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode


def fastest_cpu_wall(
    make: Callable[[], Any], run: Callable[[Any], Any], repeat: int
) -> tuple[float, float, Any]:
    """Fastest process-CPU and wall seconds of ``repeat`` runs of ``run(make())``, each on a fresh
    input made outside the timer (nothing one run caches on its input helps the next); and the
    last run's result."""
    cpu = wall = float("inf")
    out = None
    for _ in range(repeat):
        fresh = make()
        c0, w0 = time.process_time(), time.perf_counter()
        out = run(fresh)
        cpu = min(cpu, time.process_time() - c0)
        wall = min(wall, time.perf_counter() - w0)
    return cpu, wall, out


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
