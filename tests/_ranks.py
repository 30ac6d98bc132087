"""A long-lived pool of real gloo ranks for multi-rank tests on CPU.

Ranks are forked once per world size and reused across tests (~ms per test instead of a process
start). Each task names a top-level function ``fn(cp_mesh, *args)`` by module and name; every rank
runs it and returns a picklable result. A rank that raises or hangs fails the test within seconds,
with every rank's traceback; the pool is then torn down and rebuilt for the next test, so one
broken collective never poisons later tests.
"""

from __future__ import annotations

import contextlib
import importlib
import multiprocessing as mp
import os
import queue
import socket
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

_CTX = mp.get_context("fork")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _worker(rank: int, world: int, port: int, tasks: Any, results: Any) -> None:
    import torch

    torch.set_num_threads(1)  # forking after a parallel op in the parent hangs otherwise
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=60))
        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("cp",))
    except BaseException:
        results.put((rank, -1, False, traceback.format_exc()))
        return
    while True:
        item = tasks.get()
        if item is None:
            break
        task_id, module, name, args = item
        try:
            fn = getattr(importlib.import_module(module), name)
            torch.manual_seed(1234 + rank)
            out = fn(mesh, *args)
            results.put((rank, task_id, True, out))
        except BaseException:
            results.put((rank, task_id, False, traceback.format_exc()))
    with contextlib.suppress(Exception):
        dist.destroy_process_group()


class RankFailure(AssertionError):
    """One or more ranks raised, or did not answer in time."""


class RankPool:
    """``world`` forked gloo ranks that run test functions on demand."""

    def __init__(self, world: int) -> None:
        self.world = world
        self._next_id = 0
        port = _free_port()
        self._tasks = [_CTX.Queue() for _ in range(world)]
        self._results = _CTX.Queue()
        self._procs = [
            _CTX.Process(
                target=_worker,
                args=(r, world, port, self._tasks[r], self._results),
                daemon=True,
            )
            for r in range(world)
        ]
        for p in self._procs:
            p.start()

    def alive(self) -> bool:
        return all(p.is_alive() for p in self._procs)

    def run(self, fn: Callable[..., Any], *args: Any, timeout: float = 60.0) -> list[Any]:
        """Run ``fn(cp_mesh, *args)`` on every rank; return the per-rank results, rank order."""
        task_id = self._next_id
        self._next_id += 1
        for q in self._tasks:
            q.put((task_id, fn.__module__, fn.__name__, args))
        got: dict[int, tuple[bool, Any]] = {}
        failed = False
        deadline = timeout
        while len(got) < self.world:
            try:
                rank, tid, ok, payload = self._results.get(timeout=deadline)
            except queue.Empty:
                break
            if tid not in (task_id, -1):
                continue
            got[rank] = (ok, payload)
            if not ok and not failed:
                failed = True
                deadline = 3.0  # the others are likely blocked in a collective: short grace
        if failed or len(got) < self.world:
            self.close()
            lines = []
            for r in range(self.world):
                if r not in got:
                    lines.append(f"--- rank {r}: no answer (hung or killed)")
                elif not got[r][0]:
                    lines.append(f"--- rank {r} raised:\n{got[r][1]}")
                else:
                    lines.append(f"--- rank {r}: ok")
            raise RankFailure(f"{fn.__name__} failed on world={self.world}:\n" + "\n".join(lines))
        return [got[r][1] for r in range(self.world)]

    def close(self) -> None:
        for q in self._tasks:
            with contextlib.suppress(Exception):
                q.put(None)
        for p in self._procs:
            p.join(timeout=1.0)
            if p.is_alive():
                p.kill()
                p.join(timeout=1.0)


class Ranks:
    """Pools keyed by world size, created lazily, rebuilt after a failure."""

    def __init__(self) -> None:
        self._pools: dict[int, RankPool] = {}

    def __call__(
        self, world: int, fn: Callable[..., Any], *args: Any, timeout: float = 60.0
    ) -> list[Any]:
        pool = self._pools.get(world)
        if pool is None or not pool.alive():
            if pool is not None:
                pool.close()
            pool = self._pools[world] = RankPool(world)
        try:
            return pool.run(fn, *args, timeout=timeout)
        except RankFailure:
            self._pools.pop(world, None)
            raise

    def close(self) -> None:
        for pool in self._pools.values():
            pool.close()
        self._pools.clear()
