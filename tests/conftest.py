"""Shared fixtures: the multi-rank pool (see ``tests/_ranks.py``); the ini's ``timeout`` without
pytest-timeout."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

os.environ.setdefault("OMP_NUM_THREADS", "1")

from _ranks import Ranks


def pytest_addoption(parser: pytest.Parser, pluginmanager: pytest.PytestPluginManager) -> None:
    """Declare the ini key ``timeout`` when pytest-timeout is absent (or disabled with
    ``-p no:timeout``), so ``--strict-config`` accepts the repo's config there, e.g. in the GPU
    image. Without the plugin no per-test timeout applies: ``benchmarks/gpu_check.sh`` bounds
    each step itself and dumps the stacks of a hang (``faulthandler_timeout``)."""
    if not pluginmanager.has_plugin("timeout"):
        parser.addini("timeout", "per-test timeout of pytest-timeout (not installed: unused)")


@pytest.fixture(scope="session")
def ranks() -> Iterator[Ranks]:
    """``ranks(world, fn, *args)`` runs ``fn(cp_mesh, *args)`` on ``world`` real gloo ranks."""
    pool = Ranks()
    yield pool
    pool.close()
