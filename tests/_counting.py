"""The prepare pipeline's checks as counting wrappers (unit and multi-rank tests share it)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from cpshard.dispatch import CHECKS, PrepareChecks

__all__ = ["CHECK_NAMES", "counting_checks"]

CHECK_NAMES = tuple(f.name for f in dataclasses.fields(PrepareChecks))


def counting_checks() -> tuple[PrepareChecks, list[str]]:
    """The real checks of :data:`cpshard.dispatch.CHECKS`, each recording its name when called.

    Returns:
        ``(checks, calls)``: hand ``checks`` to :func:`cpshard.dispatch.run_prepare`; ``calls``
        then lists the checks it ran, in call order.
    """
    calls: list[str] = []

    def counted(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def run(*args: Any, **kwargs: Any) -> Any:
            calls.append(name)
            return fn(*args, **kwargs)

        return run

    return PrepareChecks(**{n: counted(n, getattr(CHECKS, n)) for n in CHECK_NAMES}), calls
