"""Long-lived pools of real gloo ranks for multi-rank tests on CPU.

A thin test-facing wrapper of :class:`cpshard.tools.launch.LocalRanks`: one pool per world size,
forked on first use and reused across tests (~ms per test instead of a process start). Each task
is a top-level function ``fn(cp_mesh, *args)``; every rank seeds torch with ``1234 + rank`` and
runs it. A rank that raises or dies fails the test within seconds with every rank's story, a
rank that hangs within the call's ``timeout`` (60 s unless the test says otherwise); that pool is
then dropped and the next test of that world size forks a fresh one.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.distributed.device_mesh import DeviceMesh

from cpshard.tools.launch import LocalRanks, RankFailure

__all__ = ["RankFailure", "Ranks"]


def _seeded(cp_mesh: DeviceMesh, fn: Callable[..., Any], *args: Any) -> Any:
    torch.manual_seed(1234 + cp_mesh.get_local_rank())
    return fn(cp_mesh, *args)


class Ranks:
    """Pools keyed by world size, created lazily, rebuilt after a failure."""

    def __init__(self) -> None:
        self._pools: dict[int, LocalRanks] = {}

    def __call__(
        self, world: int, fn: Callable[..., Any], *args: Any, timeout: float = 60.0
    ) -> list[Any]:
        """Run ``fn(cp_mesh, *args)`` on ``world`` ranks; the per-rank results, in rank order.

        Raises:
            RankFailure: a rank raised, died, or did not answer within ``timeout`` seconds.
        """
        pool = self._pools.get(world)
        if pool is None or not pool.alive():
            if pool is not None:
                pool.close()
            pool = self._pools[world] = LocalRanks(world)
        try:
            return pool.run(_seeded, fn, *args, timeout_s=timeout)
        except RankFailure:
            self._pools.pop(world, None)  # closed by the failure
            raise

    def close(self) -> None:
        """Stop every pool."""
        for pool in self._pools.values():
            pool.close()
        self._pools.clear()
