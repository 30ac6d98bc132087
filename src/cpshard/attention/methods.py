"""The CP attention methods as strategy objects, in one registry keyed by their names.

Each method (``all_gather``, ``ring``, ``ulysses``, ``selective``:
:data:`cpshard.names.METHOD_NAMES`) is one object with

* ``check(q_heads, kv_heads, world)``: its input rule, raised on every rank before any
  collective (only ``ulysses`` refuses anything: head counts not divisible by the CP size);
* ``plans(plan, causal, window, device)``: the kernel and exchange plans it runs, built from the
  batch's :class:`~cpshard.attention.plan.AttentionPlan` once and cached;
* ``planned(plan, causal, window, device)``: whether those plans are cached already (inside
  ``torch.compile`` the host work of building them runs outside the graph);
* ``apply(q, k, v, plans, group, *, scale, backend, softcap, sinks)``: the differentiable
  forward (an autograd Function whose backward is the method's own).

:func:`method_named` looks a name up; nothing else in cpshard switches on method names.
``"auto"`` is not a method: :mod:`cpshard.attention.cost` resolves it to one of these.

Import rules: the rows of ``RULES`` in tests/unit/test_architecture.py that cover this module.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import Any, Protocol

import torch
from torch.distributed import ProcessGroup

from cpshard.attention.all_gather import AllGatherMethod
from cpshard.attention.kernels import KernelBackend
from cpshard.attention.plan import AttentionPlan
from cpshard.attention.ring import RingMethod
from cpshard.attention.selective import SelectiveMethod
from cpshard.attention.ulysses import UlyssesMethod
from cpshard.names import METHOD_NAMES

__all__ = ["METHODS", "CPMethod", "method_named", "servable"]


class CPMethod(Protocol):
    """One CP attention method (see the module docstring)."""

    @property
    def name(self) -> str:
        """Its name in :data:`cpshard.names.METHOD_NAMES`."""

    def check(self, q_heads: int, kv_heads: int, world: int) -> None:
        """Raise ``ValueError`` (same on every rank) if this method cannot serve the call."""

    def plans(
        self, plan: AttentionPlan, causal: bool, window: int | None, device: torch.device
    ) -> Any:
        """The plans :meth:`apply` runs (cached per batch)."""

    def planned(
        self, plan: AttentionPlan, causal: bool, window: int | None, device: torch.device
    ) -> bool:
        """Whether :meth:`plans` would only read cached plans (no host work to build them)."""

    def apply(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        plans: Any,
        group: ProcessGroup | None,
        *,
        scale: float,
        backend: KernelBackend,
        softcap: float | None,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``[B, Hq, L, D]`` attention output, differentiable w.r.t. ``q``, ``k``, ``v``."""


METHODS: Mapping[str, CPMethod] = MappingProxyType(
    {m.name: m for m in (AllGatherMethod(), RingMethod(), UlyssesMethod(), SelectiveMethod())}
)
"""Every method by name, in the order of :data:`cpshard.names.METHOD_NAMES` (read-only)."""

if tuple(METHODS) != tuple(sorted(METHODS, key=METHOD_NAMES.index)) or set(METHODS) != set(
    METHOD_NAMES
):  # pragma: no cover - an import-time consistency check of this file against names.py
    raise ImportError(f"method registry {tuple(METHODS)} != cpshard.names {METHOD_NAMES}")


def method_named(name: str) -> CPMethod:
    """The strategy object of ``name``.

    Raises:
        ValueError: ``name`` is not a method (what, the valid names).
    """
    found = METHODS.get(name)
    if found is None:
        raise ValueError(
            f"unknown CP attention method {name!r}; valid methods are {', '.join(METHODS)}"
            " (or 'auto' where the caller resolves it)"
        )
    return found


def servable(q_heads: int, kv_heads: int, world: int, outer: bool = False) -> tuple[str, ...]:
    """The names of the methods whose check accepts this call, in registry order; ``outer``: the
    call runs across ``cp_outer`` of a 2-D CP mesh, where Ulysses (already inside ``cp_inner``)
    is no candidate."""
    ok = []
    for name, m in METHODS.items():
        if outer and name == "ulysses":
            continue
        try:
            m.check(q_heads, kv_heads, world)
        except ValueError:
            continue
        ok.append(name)
    return tuple(ok)
