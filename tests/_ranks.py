"""Long-lived pools of real gloo ranks for multi-rank tests on CPU.

A thin test-facing wrapper of :class:`cpshard.tools.launch.LocalRanks`: one pool per world size,
forked on first use and reused across tests (~ms per test instead of a process start). Each task
is a top-level function ``fn(cp_mesh, *args)``; every rank seeds torch with ``1234 + rank`` and
runs it. A rank that raises or dies fails the test within seconds with every rank's story, a
rank that hangs within the call's deadline; that pool is then dropped and the next test of that
world size forks a fresh one.

Deadlines catch true hangs only, never a slow correct run: the slowest call of the suite (a
``torch.compile`` case, or the FSDP2 cp x dp training on 4 ranks) took 52-60 s on a loaded 2-core
machine, so a call may run :data:`CALL_DEADLINE_S` (15x that) and a collective may wait
:data:`PG_TIMEOUT_S` for a peer (one rank may compile while the others wait). Tests pass no
``timeout`` of their own, except those that check the deadline itself.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.distributed.device_mesh import DeviceMesh

from cpshard.tools.launch import LocalRanks, RankFailure

__all__ = ["CALL_DEADLINE_S", "PG_TIMEOUT_S", "RankFailure", "Ranks"]

CALL_DEADLINE_S = 900.0  # one call of every rank; a correct call took <= 60 s under load
PG_TIMEOUT_S = 900.0  # one collective's wait for a peer (the call deadline ends a hang first)


def _seeded(cp_mesh: DeviceMesh, fn: Callable[..., Any], *args: Any) -> Any:
    torch.manual_seed(1234 + cp_mesh.get_local_rank())
    return fn(cp_mesh, *args)


class Ranks:
    """Pools keyed by world size, created lazily, rebuilt after a failure."""

    def __init__(self) -> None:
        self._pools: dict[int, LocalRanks] = {}

    def __call__(
        self, world: int, fn: Callable[..., Any], *args: Any, timeout: float = CALL_DEADLINE_S
    ) -> list[Any]:
        """Run ``fn(cp_mesh, *args)`` on ``world`` ranks; the per-rank results, in rank order.

        Raises:
            RankFailure: a rank raised, died, or did not answer within ``timeout`` seconds.
        """
        pool = self._pools.get(world)
        if pool is None or not pool.alive():
            if pool is not None:
                pool.close()
            pool = self._pools[world] = LocalRanks(world, pg_timeout_s=PG_TIMEOUT_S)
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
