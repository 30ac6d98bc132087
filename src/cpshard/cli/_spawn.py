"""Run a function on N local gloo ranks (forked, one thread each) and collect the results."""

from __future__ import annotations

import multiprocessing as mp
import pickle
import queue
import socket
import traceback
from collections.abc import Callable
from typing import Any

import torch
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from cpshard import _comm

__all__ = ["run_local_ranks"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _rank_main(
    rank: int,
    world: int,
    port: int,
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    out: Any,
    pg_timeout_s: float,
) -> None:
    torch.set_num_threads(1)  # forked children hang on their first parallel op otherwise
    try:
        # A finite process-group timeout: a rank left waiting in a collective by a failed peer
        # raises after pg_timeout_s instead of hanging (torch's default is 30 minutes).
        _comm.init_local_gloo(rank, world, port, timeout_s=pg_timeout_s)
        mesh: DeviceMesh = init_device_mesh("cpu", (world,), mesh_dim_names=("cp",))
        # Plain pickle bytes: torch's queue reducers would share tensors through file
        # descriptors that vanish when this process exits before the parent reads them.
        out.put((rank, True, pickle.dumps(fn(mesh, *args))))
    except BaseException:
        out.put((rank, False, traceback.format_exc()))
    finally:
        _comm.destroy_process_group()


def run_local_ranks(
    world: int,
    fn: Callable[..., Any],
    *args: Any,
    timeout_s: float = 600.0,
    pg_timeout_s: float = 60.0,
) -> list[Any]:
    """Run ``fn(cp_mesh, *args)`` on ``world`` forked CPU ranks joined by gloo.

    Args:
        world: Number of ranks.
        fn: Top-level function; its return value must be picklable.
        *args: Passed to ``fn`` after the mesh.
        timeout_s: Give up (and kill the ranks) after this long.
        pg_timeout_s: Process-group timeout: a collective that waits longer raises. When one
            rank fails, the others are killed at once.

    Returns:
        The per-rank results, in rank order.

    Raises:
        RuntimeError: a rank raised (its traceback is included) or did not finish in time.
    """
    if world < 1:
        raise ValueError(f"world must be >= 1, got world={world}")
    ctx = mp.get_context("fork")
    out = ctx.Queue()
    port = _free_port()
    procs = [
        ctx.Process(
            target=_rank_main, args=(r, world, port, fn, args, out, pg_timeout_s), daemon=True
        )
        for r in range(world)
    ]
    for p in procs:
        p.start()
    got: dict[int, tuple[bool, Any]] = {}
    try:
        while len(got) < world:
            rank, ok, payload = out.get(timeout=timeout_s)
            got[rank] = (ok, payload)
            if not ok:
                raise RuntimeError(f"rank {rank} failed:\n{payload}")
    except queue.Empty as e:
        raise RuntimeError(f"ranks did not finish within {timeout_s} s") from e
    finally:
        for p in procs:
            if p.is_alive() and len(got) < world:
                p.kill()
    for p in procs:
        p.join()
    return [pickle.loads(got[r][1]) for r in range(world)]
