"""A gloo group that refuses CPU tensors the way an NCCL-only group does.

A group made with the plain ``"nccl"`` backend (torch 2.11) has no CPU backend: a collective on a
CPU tensor raises "No backend type associated with device type cpu". gloo takes CPU tensors, so no
CPU run sees that bug. Inside :func:`nccl_like`, ``cpshard._comm`` (the only module of cpshard
that calls ``torch.distributed``) sees every group as NCCL-only on a device of its own:

* its ``dist`` answers ``"nccl"`` to ``get_backend``, and every call of it that is handed a tensor
  (a collective, a ``P2POp``) refuses one that is not a :class:`DeviceTensor`, with NCCL's
  message; the others run on gloo, on the same memory;
* its ``_move`` puts a copy "on the device" (a :class:`DeviceTensor`) when asked for a non-CPU
  device, and back to a plain tensor when asked for the CPU.

A :class:`DeviceTensor` is an ordinary CPU tensor of a subclass: the results of ops on it are
:class:`DeviceTensor` too (``new_empty``, ``view``, ``contiguous``...), as results of ops on a CUDA
tensor stay on CUDA. So a tensor reaches a collective as a :class:`DeviceTensor` only if
``_comm`` placed it (or derived it from one it placed) on the group's device, and any tensor
handed over where it was built, like the CPU flags of a ``sync_grads``, is refused, as NCCL would.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any
from unittest import mock

import torch
import torch.distributed as dist

from cpshard import _comm

__all__ = ["DeviceTensor", "NcclLikeRefusal", "nccl_like"]

# Functions of torch.distributed that take no tensors, or take them only as the P2P op tags
# (``P2POp`` itself checks its tensor when it is built through the checking ``dist``).
_PASS_THROUGH = frozenset({"isend", "irecv"})


class NcclLikeRefusal(RuntimeError):
    """A collective was handed a tensor that is not on the group's device."""


class DeviceTensor(torch.Tensor):
    """A CPU tensor that stands for one on the NCCL group's device (see the module docstring)."""


def _plain(t: torch.Tensor) -> torch.Tensor:
    return t.as_subclass(torch.Tensor)  # same memory, plain type


@dataclass
class NcclLike:
    """What the checking view saw: the calls it let through, by name."""

    checked: dict[str, int] = field(default_factory=dict)

    def unwrap(self, name: str, value: Any) -> Any:
        """``value`` with every tensor in it checked and made plain (lists and tuples too)."""
        if isinstance(value, torch.Tensor):
            if not isinstance(value, DeviceTensor):
                raise NcclLikeRefusal(
                    f"No backend type associated with device type {value.device.type}: "
                    f"cpshard handed a tensor {tuple(value.shape)} {value.dtype} that is not on "
                    f"the group's device to torch.distributed.{name} of an NCCL-only group"
                )
            self.checked[name] = self.checked.get(name, 0) + 1
            return _plain(value)
        if isinstance(value, (list, tuple)):
            return type(value)(self.unwrap(name, v) for v in value)
        return value

    def wrap(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def checked(*args: Any, **kwargs: Any) -> Any:
            if name == "batch_isend_irecv":
                return fn(*args, **kwargs)  # its P2POps were checked when they were built
            args = tuple(self.unwrap(name, a) for a in args)
            kwargs = {k: self.unwrap(name, v) for k, v in kwargs.items()}
            return fn(*args, **kwargs)

        return checked


class _CheckingDist:
    """``torch.distributed`` as ``_comm`` sees it inside :func:`nccl_like`."""

    def __init__(self, state: NcclLike) -> None:
        self._state = state

    def __getattr__(self, name: str) -> Any:
        real = getattr(dist, name)
        if name == "get_backend":
            return lambda group=None: "nccl"
        if name in _PASS_THROUGH or not callable(real):
            return real
        return self._state.wrap(name, real)


def _fake_move(x: torch.Tensor, device: torch.device) -> torch.Tensor:
    copy = _plain(x).clone(memory_format=torch.contiguous_format)
    return copy if device.type == "cpu" else copy.as_subclass(DeviceTensor)


@contextlib.contextmanager
def nccl_like() -> Iterator[NcclLike]:
    """Make every process group look NCCL-only to ``cpshard._comm`` (see the module docstring).

    Yields:
        The record of checked calls (the caller asserts that collectives did run through it).
    """
    state = NcclLike()
    with (
        mock.patch.object(_comm, "dist", _CheckingDist(state)),
        mock.patch.object(_comm, "_move", _fake_move, create=True),  # absent before the fix
    ):
        yield state
