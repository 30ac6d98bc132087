"""Shared fixtures: the multi-rank pool (see ``tests/_ranks.py``)."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

os.environ.setdefault("OMP_NUM_THREADS", "1")

from _ranks import Ranks


@pytest.fixture(scope="session")
def ranks() -> Iterator[Ranks]:
    """``ranks(world, fn, *args)`` runs ``fn(cp_mesh, *args)`` on ``world`` real gloo ranks."""
    pool = Ranks()
    yield pool
    pool.close()
