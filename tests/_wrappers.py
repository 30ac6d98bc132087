"""A module wrapper whose own ``__getattr__`` forwards to the module it wraps (as FSDP1's and
some PEFT wrappers do): the attribute reads that skip ``nn.Module.__getattr__``'s miss path
must still see through it (unit tests of the guards and the mixer detection share it)."""

from __future__ import annotations

from torch import nn

__all__ = ["Forwarding"]


class Forwarding(nn.Module):
    """Holds ``inner``; an attribute it does not have itself is read from ``inner``."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def __getattr__(self, name: str) -> object:
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self.inner, name)
