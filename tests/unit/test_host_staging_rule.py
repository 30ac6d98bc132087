"""When collectives must be staged through host memory (pure rule, no process group)."""

from __future__ import annotations

import pytest

from cpshard._comm import needs_host_staging


@pytest.mark.parametrize(
    ("backend", "device", "want"),
    [
        ("gloo", "cpu", False),
        ("gloo", "cuda", True),  # several ranks on one GPU: gloo + staging
        ("nccl", "cuda", False),
        ("cpu:gloo,cuda:nccl", "cuda", False),
        ("cpu:gloo,cuda:nccl", "cpu", False),
        ("cpu:gloo,cuda:gloo", "cuda", True),
        ("cpu:gloo", "cuda", True),  # no backend for CUDA: stage through the CPU one
        ("GLOO", "cuda", True),
    ],
)
def test_staging_rule(backend: str, device: str, want: bool) -> None:
    assert needs_host_staging(backend, device) is want


def test_forced_staging_covers_cpu() -> None:
    assert needs_host_staging("gloo", "cpu", force=True)
    assert needs_host_staging("nccl", "cuda", force=True)
