"""Where a collective's tensors must travel for their group (pure rule, no process group)."""

from __future__ import annotations

import pytest

from cpshard._comm import transport_device_type


@pytest.mark.parametrize(
    ("backend", "device", "want"),
    [
        ("gloo", "cpu", None),
        ("gloo", "cuda", "cpu"),  # several ranks on one GPU: gloo + host staging
        ("nccl", "cuda", None),
        ("nccl", "cpu", "cuda"),  # NCCL-only group (torch 2.11): no CPU backend at all
        ("NCCL", "cpu", "cuda"),
        ("cpu:gloo,cuda:nccl", "cuda", None),
        ("cpu:gloo,cuda:nccl", "cpu", None),
        ("cuda:nccl", "cpu", "cuda"),
        ("cpu:gloo,cuda:gloo", "cuda", "cpu"),
        ("cpu:gloo", "cuda", "cpu"),  # no backend for CUDA: through the CPU one
        ("GLOO", "cuda", "cpu"),
        ("xccl", "cpu", "xpu"),
        ("mpi", "cpu", None),  # an unknown backend is taken to serve what it is given
        ("mpi", "cuda", None),
    ],
)
def test_transport_rule(backend: str, device: str, want: str | None) -> None:
    assert transport_device_type(backend, device) == want
