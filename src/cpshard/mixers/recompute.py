"""A function whose backward recomputes it: only its inputs are kept between the two passes.

A native mixer's state summary (:mod:`cpshard.mixers.mamba2`, :mod:`cpshard.mixers.gdn`) is a
second pass over the rank's tokens next to the module's own. Kept by autograd, its intermediates
(the convolution output, decayed inputs, the Gated DeltaNet's chunked kernel run with
``d_k + d_v`` value columns) would stay alive until the backward, beside the module's own
activations: a rank would hold far more than ``1 / C`` of one process. :func:`recomputed` keeps
only the inputs (tensors the module's own graph holds anyway: its convolution input, its
projections, its parameters) and runs the function again, under autograd, when its gradient is
asked for. The backward runs it under the autocast state its forward ran under (a bf16
Trainer's forward under autocast), so the gradient belongs to the function whose value was used.

Import rules: the rows of ``RULES`` in tests/unit/test_architecture.py that cover this module.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.autograd.function import once_differentiable

__all__ = ["recomputed"]

_Fn = Callable[..., tuple[torch.Tensor, ...]]


class _Recomputed(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, fn: _Fn, *inputs: torch.Tensor | None) -> tuple[torch.Tensor, ...]:
        ctx.fn = fn
        device = next((t.device.type for t in inputs if t is not None), "cpu")
        ctx.autocast = (
            device,
            torch.is_autocast_enabled(device),
            torch.get_autocast_dtype(device),
            torch.is_autocast_cache_enabled(),
        )
        ctx.save_for_backward(*inputs)
        return tuple(fn(*inputs))  # autograd records nothing inside a Function's forward

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        needs = ctx.needs_input_grad[1:]
        inputs = [
            None if t is None else t.detach().requires_grad_(need)
            for t, need in zip(ctx.saved_tensors, needs, strict=True)
        ]
        wanted = [t for t in inputs if t is not None and t.requires_grad]
        if not wanted:
            return (None,) * (1 + len(inputs))
        device, enabled, dtype, cache = ctx.autocast
        with (
            torch.enable_grad(),
            torch.autocast(device, dtype=dtype, enabled=enabled, cache_enabled=cache),
        ):
            outs = ctx.fn(*inputs)
        got = iter(torch.autograd.grad(outs, wanted, grads, allow_unused=True))
        return (
            None,
            *(next(got) if t is not None and t.requires_grad else None for t in inputs),
        )


def recomputed(fn: _Fn, *inputs: torch.Tensor | None) -> tuple[torch.Tensor, ...]:
    """``fn(*inputs)``, differentiable, keeping only ``inputs`` for the backward.

    Args:
        fn: A pure function of its tensor arguments (``None`` allowed) returning a tuple of
            tensors; it runs once forward (no autograd record) and once more in the backward.
        inputs: Its arguments; the gradient reaches each that requires one.

    Returns:
        ``fn(*inputs)``.
    """
    out: tuple[torch.Tensor, ...] = _Recomputed.apply(fn, *inputs)  # type: ignore[no-untyped-call]
    return out
