"""Local ranks: processes of this machine joined by gloo (or NCCL) that run functions on demand.

:class:`LocalRanks` forks ``world`` processes once (one thread each; ``start_method="spawn"`` for
callers that use CUDA, which cannot be forked) and joins them in a gloo process group with a 1-D
``("cp",)`` mesh of all of them (``backend="nccl"``: spawned, one GPU per rank, a CUDA mesh).
:meth:`LocalRanks.run` sends a top-level function ``fn(cp_mesh, *args)`` (pickled by reference:
module + qualname) to every rank and returns the per-rank results in rank order; the ranks stay
up for the next call.

Nothing ever waits forever:

* a rank that raises fails the call at once with its traceback; the other ranks (likely blocked in
  a collective) get ``grace_s`` to report, then every rank is killed and the pool is closed, so a
  broken collective never reaches the next call (make a new pool, or let a caller such as the
  test fixture do it);
* a rank that dies (``os._exit``, a signal) is seen by the liveness check of every wait;
* a call that has not finished after ``timeout_s`` fails, naming the ranks that gave no answer;
* the process group has a finite timeout (``pg_timeout_s``): a rank blocked that long in a
  collective raises;
* a rank whose parent died exits when it is next idle, removing the rendezvous directory;
* Ctrl-C in the parent during a call kills the ranks; :meth:`LocalRanks.close` never blocks on a
  rank that does not read.

The rendezvous cannot race: the ranks meet in a ``FileStore`` inside a fresh private temporary
directory (removed by :meth:`LocalRanks.close`, at garbage collection or exit, or by the ranks
of a parent that was killed), not on a TCP port picked, released and hoped to stay free. gloo's
own connections then listen on ports the OS assigns while they are held.

:func:`run_local_ranks` is the one-shot form (public as ``cpshard.launch.run_local_ranks``).

Import rules: the rows of ``RULES`` in tests/unit/test_architecture.py that cover this module.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import shutil
import tempfile
import time
import traceback
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing import connection, get_context
from multiprocessing.connection import Connection
from typing import Any, Literal

import torch

from cpshard import _comm

__all__ = [
    "DEFAULT_GRACE_S",
    "DEFAULT_PG_TIMEOUT_S",
    "DEFAULT_RUN_TIMEOUT_S",
    "LocalRanks",
    "RankFailure",
    "RankOutcome",
    "run_local_ranks",
]

DEFAULT_PG_TIMEOUT_S = 60.0
DEFAULT_RUN_TIMEOUT_S = 600.0
DEFAULT_GRACE_S = 3.0
_POLL_S = 0.5  # the longest a wait goes without checking that every rank is still alive
_INIT = -1  # task id of a report from the rank's start (rendezvous, mesh)
_STOP = b""  # the message that ends a rank's loop

Status = Literal["ok", "raised", "died", "no answer"]


@dataclass(frozen=True)
class RankOutcome:
    """How one rank ended a call.

    Attributes:
        rank: The rank.
        status: ``"ok"``, ``"raised"`` (``detail`` is the traceback), ``"died"`` (``detail``
            names the exit code) or ``"no answer"`` (still running when the call gave up).
        detail: Traceback, exit code or reason, as text.
        at: ``time.time()`` when the parent learned it (``None`` for ``"no answer"``).
    """

    rank: int
    status: Status
    detail: str
    at: float | None

    def describe(self) -> str:
        """One section of a failure message."""
        if self.status == "raised":
            return f"--- rank {self.rank} raised:\n{self.detail}"
        return f"--- rank {self.rank}: {self.status}" + (f" ({self.detail})" if self.detail else "")


class RankFailure(RuntimeError):
    """A rank raised, died or did not answer in time; the message has every rank's story.

    Attributes:
        outcomes: One :class:`RankOutcome` per rank, in rank order.
    """

    def __init__(self, message: str, outcomes: tuple[RankOutcome, ...]) -> None:
        super().__init__(message)
        self.outcomes = outcomes

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (str(self), self.outcomes))


def _remove_dir(path: str, owner: int) -> None:
    if os.getpid() == owner:
        shutil.rmtree(path, ignore_errors=True)


def _send(conn: Connection, message: tuple[int, bool, Any]) -> None:
    conn.send_bytes(pickle.dumps(message))


def _if_orphaned_remove(store_path: str, parent: int) -> bool:
    """Whether the parent died; if so, remove the rendezvous directory its finalizer cannot."""
    if os.getppid() == parent:
        return False
    shutil.rmtree(os.path.dirname(store_path), ignore_errors=True)
    return True


def _rank_main(
    rank: int,
    world: int,
    store_path: str,
    backend: Literal["gloo", "nccl"],
    pg_timeout_s: float,
    parent: int,
    conn: Connection,
    inherited: list[Connection],
) -> None:
    torch.set_num_threads(1)  # forked children hang on their first parallel op otherwise
    for other in inherited:  # only this rank's end stays open here: a dead peer reads as EOF
        other.close()
    try:
        mesh = _comm.init_local(rank, world, store_path, backend=backend, timeout_s=pg_timeout_s)
    except BaseException:
        with contextlib.suppress(OSError):
            _send(conn, (_INIT, False, traceback.format_exc()))
        _if_orphaned_remove(store_path, parent)
        return
    try:
        while True:
            if not conn.poll(1.0):
                if _if_orphaned_remove(store_path, parent):  # do not linger
                    return
                continue
            try:
                message = conn.recv_bytes()
            except EOFError:  # the parent's end closed: it is dying (its stop comes first)
                end = time.monotonic() + 2.0  # the exit closes files before it re-parents us
                while not _if_orphaned_remove(store_path, parent) and time.monotonic() < end:
                    time.sleep(0.05)
                return
            if message == _STOP:
                return
            task_id, payload = pickle.loads(message)
            try:
                fn, args = pickle.loads(payload)
                # Plain pickle bytes: torch's reducers would share tensors through file
                # descriptors that can vanish before the parent reads them.
                result = pickle.dumps(fn(mesh, *args))
            except BaseException:
                _send(conn, (task_id, False, traceback.format_exc()))
            else:
                _send(conn, (task_id, True, result))
    finally:
        _comm.destroy_process_group()


class LocalRanks:
    """``world`` local ranks (forked or spawned) joined by gloo or NCCL, running functions.

    Args:
        world: Number of ranks (>= 1).
        pg_timeout_s: Process-group timeout: a collective that waits longer raises on its rank.
        grace_s: After one rank failed, how long the others may still report before every rank
            is killed.
        start_method: ``"fork"`` (fast; the parent must not have initialised CUDA) or
            ``"spawn"`` (fresh interpreters, for ranks that use a GPU; ``fn`` and its module
            must be importable).
        backend: ``"gloo"`` (CPU mesh; ranks may still compute on GPUs, several on one) or
            ``"nccl"`` (needs ``start_method="spawn"`` and a GPU per rank: rank ``r`` uses
            ``cuda:r``, the mesh is a CUDA mesh). Results travel by pickle: return CPU values.

    Raises:
        ValueError: ``world < 1``, a non-positive timeout, an unknown ``start_method`` or
            ``backend``, or ``backend="nccl"`` with ``start_method="fork"`` or fewer visible
            GPUs than ranks.

    Use as a context manager, or call :meth:`close`.
    """

    def __init__(
        self,
        world: int,
        *,
        pg_timeout_s: float = DEFAULT_PG_TIMEOUT_S,
        grace_s: float = DEFAULT_GRACE_S,
        start_method: Literal["fork", "spawn"] = "fork",
        backend: Literal["gloo", "nccl"] = "gloo",
    ) -> None:
        if world < 1:
            raise ValueError(f"world must be >= 1, got world={world}")
        if start_method not in ("fork", "spawn"):
            raise ValueError(
                f"start_method must be 'fork' or 'spawn', got start_method={start_method!r}"
            )
        if backend not in ("gloo", "nccl"):
            raise ValueError(f"backend must be 'gloo' or 'nccl', got backend={backend!r}")
        if backend == "nccl":
            if start_method != "spawn":
                raise ValueError(
                    "backend='nccl' needs start_method='spawn': a forked child cannot use CUDA"
                )
            gpus = torch.cuda.device_count()
            if world > gpus:
                raise ValueError(
                    f"backend='nccl' runs one GPU per rank: world={world} needs {world} visible "
                    f"CUDA devices, found {gpus}; use fewer ranks, or backend='gloo' to share a GPU"
                )
        for name, value in (("pg_timeout_s", pg_timeout_s), ("grace_s", grace_s)):
            if not value > 0:
                raise ValueError(f"{name} must be > 0 seconds, got {name}={value}")
        self.world = world
        self.pg_timeout_s = pg_timeout_s
        self.grace_s = grace_s
        self._next_id = 0
        self._closed = False
        self._dir = tempfile.mkdtemp(prefix="cpshard-ranks-")
        # a pool that is never closed still leaves no directory behind (at GC or exit, and only
        # in this process: a forked rank holds a copy of this object)
        self._cleanup = weakref.finalize(self, _remove_dir, self._dir, os.getpid())
        ctx = get_context("fork") if start_method == "fork" else get_context("spawn")
        pipes = [ctx.Pipe(duplex=True) for _ in range(world)]
        self._conns = [mine for mine, _ in pipes]
        # a forked rank inherits every pipe end and closes the others; a spawned one gets its own
        ends = [end for pair in pipes for end in pair] if start_method == "fork" else []
        self._procs = [
            ctx.Process(
                target=_rank_main,
                args=(
                    r,
                    world,
                    os.path.join(self._dir, "store"),
                    backend,
                    pg_timeout_s,
                    os.getpid(),
                    pipes[r][1],
                    [e for e in ends if e is not pipes[r][1]],
                ),
                daemon=True,
            )
            for r in range(world)
        ]
        try:
            for p in self._procs:
                p.start()
        except BaseException:
            self.close()
            raise
        finally:
            for _, theirs in pipes:
                theirs.close()

    @property
    def store_dir(self) -> str:
        """The private directory of the rendezvous (gone after :meth:`close`)."""
        return self._dir

    def __enter__(self) -> LocalRanks:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def alive(self) -> bool:
        """The pool is open and every rank process is running."""
        return not self._closed and all(p.is_alive() for p in self._procs)

    def run(
        self, fn: Callable[..., Any], *args: Any, timeout_s: float = DEFAULT_RUN_TIMEOUT_S
    ) -> list[Any]:
        """Run ``fn(cp_mesh, *args)`` on every rank; return the results in rank order.

        Args:
            fn: A top-level function (pickled by reference); its result must be picklable.
            *args: Picklable arguments.
            timeout_s: Give up after this long (every rank is then killed); ``math.inf``: no
                limit (the process-group timeout still bounds every collective).

        Returns:
            The per-rank results.

        Raises:
            RuntimeError: The pool is closed.
            RankFailure: A rank raised, died or gave no answer in time; the pool is closed.
        """
        if self._closed:
            raise RuntimeError("LocalRanks.run on a closed pool; make a new LocalRanks")
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0 seconds, got timeout_s={timeout_s}")
        payload = pickle.dumps((fn, args))
        task_id = self._next_id
        self._next_id += 1
        message = pickle.dumps((task_id, payload))
        try:
            for conn in self._conns:
                with contextlib.suppress(OSError):  # a rank that is gone: the wait reports it
                    conn.send_bytes(message)
            outcomes, results = self._collect(task_id, timeout_s)
        except BaseException:  # e.g. KeyboardInterrupt: ranks are mid-task or mid-message
            self._kill()
            raise
        if all(o.status == "ok" for o in outcomes):
            return [results[r] for r in range(self.world)]
        self._kill()
        name = getattr(fn, "__qualname__", repr(fn))
        text = "\n".join(o.describe() for o in outcomes)
        raise RankFailure(f"{name} failed on {self.world} local ranks:\n{text}", outcomes)

    def _collect(
        self, task_id: int, timeout_s: float
    ) -> tuple[tuple[RankOutcome, ...], dict[int, Any]]:
        got: dict[int, RankOutcome] = {}
        results: dict[int, Any] = {}
        deadline = time.monotonic() + timeout_s
        give_up_at = deadline
        by_conn = {conn: r for r, conn in enumerate(self._conns)}

        def died(r: int) -> None:
            self._procs[r].join(timeout=0.1)
            code = self._procs[r].exitcode
            got[r] = RankOutcome(r, "died", f"exit code {code}", time.time())

        while len(got) < self.world:
            now = time.monotonic()
            if now >= give_up_at:
                break
            waiting = [c for c, r in by_conn.items() if r not in got]
            for conn in connection.wait(waiting, timeout=min(_POLL_S, give_up_at - now)):
                assert isinstance(conn, Connection)
                r = by_conn[conn]
                try:
                    tid, ok, data = pickle.loads(conn.recv_bytes())
                except (EOFError, OSError):
                    died(r)
                    continue
                if tid not in (task_id, _INIT):
                    continue  # a stale answer
                if ok:
                    results[r] = pickle.loads(data)
                    got[r] = RankOutcome(r, "ok", "", time.time())
                else:
                    got[r] = RankOutcome(r, "raised", str(data), time.time())
            for r, p in enumerate(self._procs):
                if r not in got and not p.is_alive() and not self._conns[r].poll():
                    died(r)
            if any(o.status != "ok" for o in got.values()):
                give_up_at = min(give_up_at, time.monotonic() + self.grace_s)
        missing = "hung, or blocked in a collective" + (
            "" if time.monotonic() < deadline else f"; the call timed out after {timeout_s} s"
        )
        outcomes = tuple(
            got.get(r, RankOutcome(r, "no answer", missing, None)) for r in range(self.world)
        )
        return outcomes, results

    def _kill(self) -> None:
        for p in self._procs:
            if p.is_alive():
                p.kill()
        self.close()

    def close(self) -> None:
        """Stop every rank (politely, then by force) and remove the rendezvous directory."""
        if self._closed:
            return
        self._closed = True
        started = [p for p in self._procs if p.pid is not None]
        try:
            for conn in self._conns:
                # never blocks: a rank that does not read (a full pipe) is killed below; a
                # 4-byte message is written whole or not at all
                with contextlib.suppress(OSError):
                    os.set_blocking(conn.fileno(), False)
                    conn.send_bytes(_STOP)
            end = time.monotonic() + 2.0
            for p in started:
                p.join(timeout=max(0.0, end - time.monotonic()))
        finally:  # also when interrupted: no rank, pipe or directory outlives the pool
            for p in started:
                if p.is_alive():
                    p.kill()
                    p.join(timeout=2.0)
            for conn in self._conns:
                conn.close()
            self._cleanup()


def run_local_ranks(
    world: int,
    fn: Callable[..., Any],
    *args: Any,
    timeout_s: float = DEFAULT_RUN_TIMEOUT_S,
    pg_timeout_s: float = DEFAULT_PG_TIMEOUT_S,
) -> list[Any]:
    """Run ``fn(cp_mesh, *args)`` once on ``world`` forked CPU ranks joined by gloo.

    Args:
        world: Number of ranks.
        fn: Top-level function; its return value must be picklable.
        *args: Passed to ``fn`` after the mesh (picklable).
        timeout_s: Give up (and kill the ranks) after this long.
        pg_timeout_s: Process-group timeout: a collective that waits longer raises. When one
            rank fails, the others get a short grace to report and are then killed.

    Returns:
        The per-rank results, in rank order.

    Raises:
        RankFailure: A rank raised (its traceback is included), died or did not finish in time
            (a ``RuntimeError``).
    """
    with LocalRanks(world, pg_timeout_s=pg_timeout_s) as ranks:
        return ranks.run(fn, *args, timeout_s=timeout_s)
