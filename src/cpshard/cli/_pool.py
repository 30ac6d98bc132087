"""A pool of N local gloo ranks, started once and reused for many tasks (``cpshard parity``).

Starting ranks costs seconds (fork, rendezvous, first imports); a parity row costs a fraction of
that, so the ranks are forked once and receive one task after another. Each task is a top-level
function ``fn(cp_mesh, *args)`` that every rank runs. A rank that raises or dies ends the task
with every rank's traceback; the other ranks, likely blocked in a collective, get a short grace
and are killed, so a broken row never hangs the command. The process group is created with a
finite timeout (``timeout_s``): a rank blocked that long in a collective raises. A rank whose
parent died (killed by a signal, so it could not close the pool) exits when it is next idle.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import pickle
import queue
import socket
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch
from torch.distributed.device_mesh import init_device_mesh

from cpshard import _comm

__all__ = ["DEFAULT_TIMEOUT_S", "LocalRankPool", "RankFailure"]

DEFAULT_TIMEOUT_S = 120.0
_GRACE_S = 3.0  # after one rank failed, how long the others may still answer


class RankFailure(RuntimeError):
    """A rank raised or died while running a task (the message has every rank's story)."""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _rank_main(
    rank: int, world: int, port: int, timeout_s: float, parent: int, tasks: Any, out: Any
) -> None:
    torch.set_num_threads(1)  # forked children hang on their first parallel op otherwise
    try:
        _comm.init_local_gloo(rank, world, port, timeout_s=timeout_s)
        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("cp",))
    except BaseException:
        out.put((rank, -1, False, traceback.format_exc()))
        return
    try:
        while True:
            try:
                item = tasks.get(timeout=1.0)
            except queue.Empty:
                if os.getppid() != parent:  # the parent was killed: do not linger
                    break
                continue
            if item is None:
                break
            task_id, payload = item
            try:
                fn, args = pickle.loads(payload)
                # Plain pickle bytes: torch's queue reducers would share tensors through file
                # descriptors that can vanish before the parent reads them.
                out.put((rank, task_id, True, pickle.dumps(fn(mesh, *args))))
            except BaseException:
                out.put((rank, task_id, False, traceback.format_exc()))
    finally:
        _comm.destroy_process_group()


class LocalRankPool:
    """``world`` forked CPU ranks joined by gloo, running tasks on demand.

    Args:
        world: Number of ranks (>= 1).
        timeout_s: Process-group timeout: a collective that waits longer raises on its rank.

    Use as a context manager, or call :meth:`close`.
    """

    def __init__(self, world: int, *, timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
        if world < 1:
            raise ValueError(f"world must be >= 1, got world={world}")
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got timeout_s={timeout_s}")
        self.world = world
        self.timeout_s = timeout_s
        self._next_id = 0
        ctx = mp.get_context("fork")
        self._tasks = [ctx.Queue() for _ in range(world)]
        self._out = ctx.Queue()
        port = _free_port()
        self._procs = [
            ctx.Process(
                target=_rank_main,
                args=(r, world, port, timeout_s, os.getpid(), self._tasks[r], self._out),
                daemon=True,
            )
            for r in range(world)
        ]
        for p in self._procs:
            p.start()

    def __enter__(self) -> LocalRankPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def alive(self) -> bool:
        """Every rank process is still running."""
        return all(p.is_alive() for p in self._procs)

    def run(self, fn: Callable[..., Any], *args: Any) -> list[Any]:
        """Run ``fn(cp_mesh, *args)`` on every rank; return the results in rank order.

        Args:
            fn: A top-level function (pickled by reference); its result must be picklable.
            *args: Picklable arguments.

        Raises:
            RankFailure: a rank raised or died; the pool is closed (make a new one to go on).
        """
        task_id = self._next_id
        self._next_id += 1
        payload = pickle.dumps((fn, args))
        for q in self._tasks:
            q.put((task_id, payload))
        got: dict[int, tuple[bool, Any]] = {}
        give_up_at: float | None = None
        while len(got) < self.world:
            try:
                rank, tid, ok, data = self._out.get(timeout=0.2)
            except queue.Empty:
                now = time.monotonic()
                if give_up_at is None and not self.alive():
                    give_up_at = now + _GRACE_S  # a rank died: let the others report
                if give_up_at is not None and now >= give_up_at:
                    break
                continue
            if tid not in (task_id, -1):
                continue
            got[rank] = (ok, data)
            if not ok and give_up_at is None:
                give_up_at = time.monotonic() + _GRACE_S
        if len(got) == self.world and all(ok for ok, _ in got.values()):
            return [pickle.loads(got[r][1]) for r in range(self.world)]
        self.close()
        lines = []
        for r in range(self.world):
            if r not in got:
                lines.append(f"--- rank {r}: no answer (blocked in a collective, or died)")
            elif not got[r][0]:
                lines.append(f"--- rank {r} raised:\n{got[r][1]}")
            else:
                lines.append(f"--- rank {r}: ok")
        name = getattr(fn, "__name__", repr(fn))
        raise RankFailure(f"{name} failed on {self.world} local ranks:\n" + "\n".join(lines))

    def close(self) -> None:
        """Stop every rank (politely, then by force)."""
        for q in self._tasks:
            with contextlib.suppress(Exception):
                q.put(None)
        for p in self._procs:
            p.join(timeout=2.0)
            if p.is_alive():
                p.kill()
                p.join(timeout=2.0)
