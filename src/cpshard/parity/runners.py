"""Where the two sides of a parity row run: local forked ranks, or the ranks ``torchrun`` launched.

Both runners offer the same three calls, so ``cpshard parity`` has one driver loop:

* ``cp_side(case)``: the cp=N training run on every rank; the main process gets rank 0's losses
  and per-step gradient errors (against cp=1 on the same weights), the wall time and every
  rank's peak memory;
* ``reference(case, shadow)`` / ``native(case)``: the cp=1 reference and the model's own
  attention, in one process (the parent of the local ranks, or rank 0 of the launched ones);
* ``agree(ok)``: every rank learns rank 0's verdict, so all of them exit with the same status.

:class:`LocalRunner` forks its ranks once (:class:`~cpshard.tools.launch.LocalRanks`) and reuses
them for every row. :class:`LaunchedRunner` joins the process group described by the launcher's
environment: NCCL with one GPU per rank when CUDA is available, gloo on CPU otherwise.

Import rules: the rows of ``RULES`` in tests/unit/test_architecture.py that cover this module.
"""

from __future__ import annotations

import math
import os
import re
import resource
import time
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch
from torch.distributed.device_mesh import DeviceMesh

from cpshard import _comm
from cpshard.parity.runs import ParityCase, ParityResult, Shadow, native_steps, train_steps
from cpshard.tools.launch import LocalRanks

__all__ = [
    "DEFAULT_TIMEOUT_S",
    "CpSide",
    "LaunchedRunner",
    "LocalRunner",
    "launched_world_size",
    "measure",
]

DEFAULT_TIMEOUT_S = 120.0  # process-group timeout of `cpshard parity` (its --timeout)


@dataclass(frozen=True)
class CpSide:
    """One side of a row: rank 0's result, the wall time and each rank's peak memory (MB)."""

    result: ParityResult
    seconds: float
    peak_mem_mb: list[float]
    peak_mem_kind: str


def _reset_peak(device: torch.device) -> str:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        return "cuda_max_allocated"
    try:  # Linux: writing 5 resets this process's peak resident set size (VmHWM)
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return "cpu_peak_rss"
    except OSError:
        return "cpu_peak_rss_since_start"


def _peak_mb(device: torch.device, kind: str) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    if kind == "cpu_peak_rss":
        with open("/proc/self/status") as f:
            found = re.search(r"VmHWM:\s+(\d+)\s+kB", f.read())
        if found:
            return int(found.group(1)) / 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # kB on Linux


def measure(
    fn: Callable[[], ParityResult], device: torch.device
) -> tuple[ParityResult, float, float, str]:
    """Run ``fn`` and return ``(result, seconds, peak memory MB, memory kind)``."""
    kind = _reset_peak(device)
    t0 = time.perf_counter()
    result = fn()
    seconds = time.perf_counter() - t0
    return result, seconds, _peak_mb(device, kind), kind


def _cp_rank(
    cp_mesh: DeviceMesh, case: ParityCase
) -> tuple[ParityResult | None, float, float, str]:
    """A local rank's part of a row (top level, so the pool can pickle it)."""
    res, secs, mb, kind = measure(lambda: train_steps(cp_mesh, case), torch.device(case.device))
    return (res if cp_mesh.get_local_rank() == 0 else None), secs, mb, kind


class _InProcessSides:
    """The one-process sides of a row, run where the runner's main process is (its ``device``).

    Under a launcher only rank 0 calls these.
    """

    device: str

    def reference(self, case: ParityCase, shadow: Shadow) -> CpSide:
        """The cp=1 run of ``case`` in this process (``shadow``: see ``train_steps``)."""
        c = replace(case, device=self.device)
        res, secs, mb, kind = measure(
            lambda: train_steps(None, c, shadow), torch.device(self.device)
        )
        return CpSide(res, secs, [mb], kind)

    def native(self, case: ParityCase) -> CpSide:
        """``case`` with the model's own attention, in this process."""
        c = replace(case, device=self.device)
        res, secs, mb, kind = measure(lambda: native_steps(c), torch.device(self.device))
        return CpSide(res, secs, [mb], kind)


class LocalRunner(_InProcessSides):
    """The cp=N side on ``world`` forked gloo ranks of this machine, the reference here.

    Args:
        world: Number of local ranks.
        timeout_s: Process-group timeout of the ranks (finite, so a broken row cannot hang).
    """

    launcher = "local"
    backend = "gloo"
    device = "cpu"
    is_main = True

    def __init__(self, world: int, *, timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
        self.world = world
        self.timeout_s = timeout_s
        self._pool: LocalRanks | None = None

    def start(self) -> None:
        """Fork the ranks now (they are reused by every row; a failed row restarts them)."""
        if self._pool is not None and not self._pool.alive():
            self.close()
        if self._pool is None:
            self._pool = LocalRanks(self.world, pg_timeout_s=self.timeout_s)

    def cp_side(self, case: ParityCase) -> CpSide | None:
        """Train ``case`` on the local ranks.

        Raises:
            cpshard.tools.launch.RankFailure: a rank raised or died (the ranks are restarted for
                the next row).
        """
        self.start()
        assert self._pool is not None
        try:
            # no deadline for the row as a whole (as before the launcher was shared): a long
            # row is legitimate; a rank stuck in a collective fails after --timeout
            out = self._pool.run(_cp_rank, replace(case, device=self.device), timeout_s=math.inf)
        except BaseException:
            self.close()  # the next row forks fresh ranks
            raise
        res = out[0][0]
        assert res is not None
        return CpSide(res, max(o[1] for o in out), [o[2] for o in out], out[0][3])

    def agree(self, ok: bool) -> bool:
        """One process decides: nothing to share."""
        return ok

    def close(self) -> None:
        """Stop the ranks."""
        if self._pool is not None:
            self._pool.close()
            self._pool = None


def launched_world_size() -> int | None:
    """``WORLD_SIZE`` when a launcher (``torchrun``) started this process, else ``None``.

    Raises:
        ValueError: ``WORLD_SIZE`` is set but not a positive integer.
    """
    text = os.environ.get("WORLD_SIZE")
    if text is None:
        return None
    if not text.isdigit() or int(text) < 1:
        raise ValueError(f"WORLD_SIZE={text!r} is not a positive integer; launch with torchrun")
    return int(text)


class LaunchedRunner(_InProcessSides):
    """The cp=N side on the ranks a launcher started (every rank runs this), reference on rank 0.

    Args:
        timeout_s: Process-group timeout (finite: rank 0's reference runs while the others wait
            in the next collective, so it must cover the longest reference run).
    """

    launcher = "torchrun"

    def __init__(self, *, timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
        if torch.cuda.is_available():
            self.backend = "nccl"
            local_rank = int(os.environ.get("LOCAL_RANK", "0"))
            torch.cuda.set_device(local_rank)
            self.device = f"cuda:{local_rank}"
            mesh_device = "cuda"
        else:
            self.backend, self.device, mesh_device = "gloo", "cpu", "cpu"
            torch.set_num_threads(1)
        self.mesh = _comm.init_launched(self.backend, mesh_device, timeout_s=timeout_s)
        self.rank = self.mesh.get_local_rank()
        self.world = self.mesh.size()
        self.is_main = self.rank == 0

    def start(self) -> None:
        """Nothing to start: the launcher started the ranks."""

    def _gather_floats(self, value: float) -> list[float]:
        buf = torch.zeros(self.world, dtype=torch.float64, device=self.device)
        buf[self.rank] = value
        _comm.all_reduce_sum_(buf, _comm.cp_group(self.mesh))
        return [float(v) for v in buf.cpu()]

    def cp_side(self, case: ParityCase) -> CpSide | None:
        """Train ``case`` on every launched rank; rank 0 gets the side, the others ``None``."""
        c = replace(case, device=self.device)
        res, secs, mb, kind = measure(lambda: train_steps(self.mesh, c), torch.device(self.device))
        mems = self._gather_floats(mb)
        secs = max(self._gather_floats(secs))
        return CpSide(res, secs, mems, kind) if self.is_main else None

    def agree(self, ok: bool) -> bool:
        """Rank 0's verdict on every rank."""
        return self._gather_floats(float(ok) if self.is_main else 0.0)[0] > 0

    def close(self) -> None:
        """Leave the process group."""
        _comm.destroy_process_group()
