"""Dataclass fields whose value may be made on first read.

A packed plan's input map (``[B, S]``: the stream slot of every caller token) is read by the
token verbs in input coordinates and by nothing a prepare runs; made for every batch it costs a
pass over ``B * S`` fresh values. A field declared with :class:`DeferredField` takes either its
value or a :class:`Deferred` maker; reading the field makes the value once and keeps it, so a
reader never sees the maker, and equality, ``repr``, pickling and copies see the value.

:func:`raw` reads a field without making it (to hand a maker on to another object) and
:func:`replace` is :func:`dataclasses.replace` that hands the makers on unmade.

Import rules: the rows of ``RULES`` in tests/unit/test_architecture.py that cover this module.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, Generic, TypeVar, overload

__all__ = ["Deferred", "DeferredField", "raw", "replace"]

T = TypeVar("T")


class Deferred(Generic[T]):
    """A value made by ``make()`` on the first :meth:`get`, then kept (one maker may be shared by
    several objects: it runs once). Pickled and copied as its value."""

    __slots__ = ("_make", "_value")

    def __init__(self, make: Callable[[], T]) -> None:
        self._make: Callable[[], T] | None = make
        self._value: T | None = None

    def get(self) -> T:
        """The value (made now if not yet)."""
        if self._make is not None:
            self._value, self._make = self._make(), None
        return self._value  # type: ignore[return-value]

    def __reduce__(self) -> tuple[Callable[[T], T], tuple[T]]:
        return _made, (self.get(),)


def _made(value: T) -> T:
    return value


class DeferredField(Generic[T]):
    """A data descriptor for a (frozen) dataclass field that takes a value or a
    :class:`Deferred`: reading it gives the value, made on first read and stored in the
    instance. ``default`` as for a plain field (none: the field is required).

    Example:
        >>> @dataclasses.dataclass(frozen=True)
        ... class Box:
        ...     n: DeferredField[int] = DeferredField()
        >>> Box(Deferred(lambda: 3)).n
        3
    """

    _MISSING = object()

    def __init__(self, default: Any = _MISSING) -> None:
        self.default = default
        self.slot = ""

    def __set_name__(self, owner: type, name: str) -> None:
        self.slot = _slot(name)
        # the class's deferred fields, its bases' included (read by raw and replace)
        type.__setattr__(owner, _NAMES, (*getattr(owner, _NAMES, ()), name))

    @overload
    def __get__(self, obj: None, owner: type) -> T: ...

    @overload
    def __get__(self, obj: object, owner: type) -> T: ...

    def __get__(self, obj: object | None, owner: type) -> T:
        if obj is None:  # the dataclass asks for the default
            if self.default is DeferredField._MISSING:
                raise AttributeError(self.slot)
            return self.default  # type: ignore[no-any-return]
        value = obj.__dict__[self.slot]
        if isinstance(value, Deferred):
            value = value.get()
            obj.__dict__[self.slot] = value
        return value  # type: ignore[no-any-return]

    def __set__(self, obj: object, value: T | Deferred[T]) -> None:
        obj.__dict__[self.slot] = value


_NAMES = "cpshard_deferred_fields"
"""Class attribute: the names of a class's :class:`DeferredField` fields (set as it is made)."""


def _slot(name: str) -> str:
    return f"_deferred_{name}"


def raw(obj: object, name: str) -> Any:
    """Field ``name`` of ``obj`` as stored: its value, or its :class:`Deferred` if not made yet
    (a plain field: its value)."""
    if name in getattr(type(obj), _NAMES, ()):
        return obj.__dict__[_slot(name)]
    return getattr(obj, name)


def replace(obj: T, **changes: Any) -> T:
    """:func:`dataclasses.replace` that hands the fields not changed on as stored: a value not
    made yet stays a maker (shared, made once for both objects)."""
    for name in getattr(type(obj), _NAMES, ()):
        if name not in changes:
            changes[name] = obj.__dict__[_slot(name)]
    return dataclasses.replace(obj, **changes)  # type: ignore[type-var]
