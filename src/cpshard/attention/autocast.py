"""CP attention under ``torch.autocast``: the compute dtype is the one SDPA would use.

``F.scaled_dot_product_attention`` is on autocast's lower-precision list (CUDA and, checked on
torch 2.13, CPU): under an active autocast for the tensors' device it casts ``q``, ``k`` and
``v`` to the autocast dtype (floating tensors other than fp64, autocast's own eligibility rule)
and returns the output in that dtype. Without autocast it refuses mixed dtypes. CP attention does
the same (:func:`autocast_inputs`), so a model that runs SDPA under autocast (HF models apply
RoPE in fp32 and hand SDPA fp32 q/k with a bf16 v; ``Trainer(bf16=True)`` runs the forward under
autocast) runs CP attention in the same dtype; outside autocast mixed dtypes raise, as SDPA
does.

The methods' own arithmetic (kernels, the fp32 LSE merge and gradient accumulators) runs with
autocast switched off (:func:`autocast_off`, for the forward and for each autograd Function's
backward, which may be called inside an autocast region too): autocast would otherwise turn
their fp32 accumulation matmuls into bf16 ones.

Import rules: the rows of ``RULES`` in tests/unit/test_architecture.py that cover this module.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from typing import Any, TypeVar

import torch

__all__ = ["autocast_inputs", "autocast_off", "backward_without_autocast"]

_F = TypeVar("_F", bound=Callable[..., Any])


def _enabled(device_type: str) -> bool:
    """Whether autocast is on for ``device_type`` (``meta`` tensors have none: torch raises)."""
    return device_type != "meta" and torch.is_autocast_enabled(device_type)


def _cast(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    # autocast's eligibility rule: floating tensors, fp64 left alone
    if t.is_floating_point() and t.dtype != torch.float64 and t.dtype != dtype:
        return t.to(dtype)
    return t


def autocast_inputs(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``q, k, v`` cast as SDPA's autocast rule casts them on ``q``'s device.

    Args:
        q: ``[B, Hq, L, D]`` queries (any dtype).
        k: ``[B, Hkv, L, D]`` keys.
        v: ``[B, Hkv, L, Dv]`` values.

    Returns:
        Under an active autocast for ``q.device.type``: each floating, non-fp64 tensor in the
        autocast dtype (differentiable casts; tensors already in it are returned as they are).
        Otherwise ``q, k, v`` unchanged.
    """
    device = q.device.type
    if not _enabled(device):
        return q, k, v
    dtype = torch.get_autocast_dtype(device)
    return _cast(q, dtype), _cast(k, dtype), _cast(v, dtype)


def autocast_off(device: torch.device) -> contextlib.AbstractContextManager[Any]:
    """A context in which autocast is off for ``device`` (a no-op where it is off already)."""
    if _enabled(device.type):
        return torch.autocast(device.type, enabled=False)
    return contextlib.nullcontext()


def backward_without_autocast(backward: _F) -> _F:
    """Decorate an autograd Function's ``backward(ctx, grad, ...)``: run it with autocast off.

    ``backward()`` called inside an autocast region runs the Function's backward under it; the
    methods' backward keeps its fp32 accumulators and the forward's dtypes instead.
    """

    @functools.wraps(backward)
    def wrapped(ctx: Any, grad: torch.Tensor, *rest: Any) -> Any:
        with autocast_off(grad.device):
            return backward(ctx, grad, *rest)

    return wrapped  # type: ignore[return-value]
