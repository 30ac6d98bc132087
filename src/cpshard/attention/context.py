"""Route ``F.scaled_dot_product_attention`` calls of plain PyTorch models to CP attention.

:func:`cp_attention_context` is a scoped ``TorchFunctionMode``: while it is active, an SDPA call
whose query and key sequence lengths (dim ``-2``) both equal ``meta.local_len`` is served by
:func:`cpshard.attention.cp_sdpa` (``causal = is_causal``); every other SDPA call (a cross-attention
or a vision tower with another length) passes through untouched. Nothing global is patched, and
the autograd Functions capture the group and meta, so ``backward()`` may run outside the context.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator, Mapping
from types import MappingProxyType
from typing import Any

import torch
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh
from torch.overrides import TorchFunctionMode

from cpshard._comm import cp_group
from cpshard.attention.core import check_method, cp_sdpa
from cpshard.meta import TokenMeta

__all__ = ["active_cp_attention", "cp_attention_context", "cp_context_active"]

_SDPA_PARAMS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale")
_SDPA_DEFAULTS: Mapping[str, Any] = MappingProxyType(
    {"attn_mask": None, "dropout_p": 0.0, "is_causal": False, "scale": None, "enable_gqa": False}
)


def _is_sdpa(func: Callable[..., Any]) -> bool:
    return (
        func is F.scaled_dot_product_attention or func is torch._C._nn.scaled_dot_product_attention
    )


def _bind(args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
    """Name the arguments of an SDPA call (positional or keyword)."""
    bound = dict(_SDPA_DEFAULTS)
    bound.update(zip(_SDPA_PARAMS, args, strict=False))
    bound.update(kwargs)
    return bound


class _CPSDPAMode(TorchFunctionMode):
    """Serves matching SDPA calls with :func:`cp_sdpa`; see the module docstring."""

    def __init__(self, cp_mesh: DeviceMesh | None, meta: TokenMeta, method: str) -> None:
        super().__init__()
        self.group = cp_group(cp_mesh)
        self.meta = meta
        self.method = method

    def __torch_function__(
        self,
        func: Callable[..., Any],
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        if not _is_sdpa(func):
            return func(*args, **kwargs)
        call = _bind(args, kwargs)
        q, k = call["query"], call["key"]
        n = self.meta.local_len
        if q.dim() != 4 or q.shape[-2] != n or k.shape[-2] != n:
            return func(*args, **kwargs)
        if call["attn_mask"] is not None:
            raise ValueError(
                "scaled_dot_product_attention got an explicit attn_mask inside "
                "cp_attention_context; under CP the mask comes from the token meta (document ids "
                "and global positions, padding included): pass attn_mask=None and is_causal"
            )
        if call["dropout_p"] != 0.0:
            raise ValueError(
                f"CP attention does not support dropout, got dropout_p={call['dropout_p']}; "
                "pass dropout_p=0.0 (e.g. model.eval() or attention_dropout=0)"
            )
        hq, hkv = q.shape[1], k.shape[1]
        if hq != hkv and not call["enable_gqa"]:
            raise ValueError(
                f"query has {hq} heads and key {hkv}: pass enable_gqa=True for GQA (as "
                "scaled_dot_product_attention itself requires)"
            )
        return cp_sdpa(
            q, k, call["value"], group=self.group, meta=self.meta, method=self.method,
            causal=bool(call["is_causal"]), scale=call["scale"],
        )  # fmt: skip


def active_cp_attention() -> Callable[..., torch.Tensor] | None:
    """:func:`cp_sdpa` bound to the innermost active context's group, meta and method, or None.

    For integrations that pass attention arguments SDPA cannot carry (``window``, ``softcap``):
    call the result as ``attn(q, k, v, causal=..., scale=..., window=..., softcap=...)``.
    """
    from torch.overrides import _get_current_function_mode_stack

    stack = _get_current_function_mode_stack()  # type: ignore[no-untyped-call]
    for mode in reversed(stack):
        if isinstance(mode, _CPSDPAMode):
            return functools.partial(cp_sdpa, group=mode.group, meta=mode.meta, method=mode.method)
    return None


def cp_context_active() -> bool:
    """Whether a :func:`cp_attention_context` is active on this thread (innermost modes first)."""
    from torch.overrides import _get_current_function_mode_stack

    stack = _get_current_function_mode_stack()  # type: ignore[no-untyped-call]
    return any(isinstance(m, _CPSDPAMode) for m in stack)


@contextlib.contextmanager
def _scope(cp_mesh: DeviceMesh | None, meta: TokenMeta, method: str) -> Iterator[None]:
    with _CPSDPAMode(cp_mesh, meta, method):
        yield


def cp_attention_context(
    cp_mesh: DeviceMesh | None, meta: TokenMeta, method: str
) -> contextlib.AbstractContextManager[None]:
    """A context in which SDPA calls over the local shard become CP attention.

    Args:
        cp_mesh: 1-D CP mesh, or ``None`` (then ``meta.world_size`` must be 1).
        meta: Token meta of the sharded batch.
        method: ``"all_gather"``, ``"ring"`` or ``"ulysses"``.

    Returns:
        A context manager; use as ``with cp_attention_context(mesh, meta, "ring"): model(...)``.

    Raises:
        ValueError: unknown ``method`` (raised here, before the model runs).

    Example:
        >>> ctx = functools.partial(cp_attention_context, cp_mesh, meta, "ring")
        >>> with ctx():
        ...     out = model(**batch)
    """
    check_method(method)
    return _scope(cp_mesh, meta, method)
