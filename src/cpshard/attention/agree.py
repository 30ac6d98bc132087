"""The CP ranks agree on a CP attention call before its first data collective.

Every CP attention method exchanges K/V (or Q/K/V) blocks whose size follows from the call's
dtype, batch size, head counts, head dims and length. A rank whose call differs from its peers'
(a model in another dtype, an autocast region on one rank only, another head split of the same
weights) would meet their collective with another size: gloo aborts the process (SIGABRT),
NCCL hangs or reads garbage. :func:`agree_once` exchanges the call's facts first, in one small
all-gather of a fixed size, and raises the same ``ValueError`` on every rank, naming each rank's
call, when they differ.

Which calls are checked:

* inside a tracked ``ctx()`` of :func:`cpshard.prepare_cp_forward` the step tracker
  (:class:`cpshard.attention.context.StepTracker`) exchanges the first CP attention call of every
  forward (every route: SDPA interception, the HF ``"cpshard"`` attention, and
  :func:`cpshard.attention.cp_attention` called inside it);
* every other call (:func:`cpshard.attention.cp_sdpa` / ``cp_attention`` outside a tracked
  context, a model-owned context, a recomputation in the backward) through
  :func:`agree_once`: the first call on each batch's token meta, so one all-gather per batch.

Later calls of the same forward or batch are not exchanged (a collective per layer is a host
sync per layer on GPUs): the model is the same on every rank (the prepare fingerprints its
parameters) and the first call agreed on dtype and shapes. Not checked: calls traced by
``torch.compile`` (no host work there).

The exchange has the size of a step header (:mod:`cpshard.guards.step`), so a rank that meets a
step header here, or the reverse, sees a wrong magic value instead of a size mismatch.

Import rules: the rows of ``RULES`` in tests/unit/test_architecture.py that cover this module.
"""

from __future__ import annotations

import hashlib

import torch
from torch.distributed import ProcessGroup

from cpshard._comm import all_gather_fixed
from cpshard.names import ATTENTION_CHOICES
from cpshard.sharding.meta import TokenMeta

__all__ = ["AGREE_SIZE", "agree_once", "call_facts"]

AGREE_SIZE = 32
"""Values in the exchange: the size of a step header (``HEADER_SIZE + PAYLOAD_SIZE`` of
:mod:`cpshard.guards.step`, equal by a unit test)."""

_MAGIC_VALUE = 0xA77E4D
_CACHE_KEY = "agreed|ranks"
_DTYPES = (
    torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.float8_e4m3fn,
    torch.float8_e5m2,
)  # fmt: skip
# Slots: magic, then per tensor (q, k, v) its dtype code, ndim and first 4 dims, then the options.
_MAGIC, _TENSORS, _PER_TENSOR = 0, 1, 6
_CAUSAL, _WINDOW, _METHOD, _SOFTCAP, _SINKS = 19, 20, 21, 22, 23
_MASK = (1 << 62) - 1


def _dtype_code(dtype: torch.dtype) -> int:
    return _DTYPES.index(dtype) + 1 if dtype in _DTYPES else 0


def _dtype_text(code: int) -> str:
    return str(_DTYPES[code - 1]).removeprefix("torch.") if code > 0 else "another dtype"


def _text_code(text: str) -> int:
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little") & _MASK


def call_facts(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    method: str,
    causal: bool,
    window: int | None,
    softcap: float | None,
    sinks: torch.Tensor | None,
) -> torch.Tensor:
    """The facts of a call every rank must share, as LongTensor ``[AGREE_SIZE]``.

    Read from the tensors' metadata only (no data, no device sync), for any input (a tensor of
    the wrong rank included: its ``ndim`` is a fact too).
    """
    facts = torch.zeros(AGREE_SIZE, dtype=torch.long)
    facts[_MAGIC] = _MAGIC_VALUE
    for i, t in enumerate((q, k, v)):
        at = _TENSORS + i * _PER_TENSOR
        dims = list(t.shape[:4]) + [-1] * (4 - min(t.dim(), 4))
        facts[at : at + _PER_TENSOR] = torch.tensor([_dtype_code(t.dtype), t.dim(), *dims])
    facts[_CAUSAL] = int(bool(causal))
    facts[_WINDOW] = -1 if window is None else int(window)
    facts[_METHOD] = _text_code(method)
    facts[_SOFTCAP] = int(softcap is not None)
    facts[_SINKS] = int(sinks is not None)
    return facts


def _describe(row: list[int], method_of: dict[int, str]) -> str:
    parts = []
    for i, name in enumerate("qkv"):
        at = _TENSORS + i * _PER_TENSOR
        code, ndim, *dims = row[at : at + _PER_TENSOR]
        shape = dims[: min(ndim, 4)] + (["..."] if ndim > 4 else [])
        parts.append(f"{name} {_dtype_text(code)} {list(shape)}")
    window = None if row[_WINDOW] < 0 else row[_WINDOW]
    parts.append(
        f"method={method_of.get(row[_METHOD], '?')!r} causal={bool(row[_CAUSAL])} "
        f"window={window} softcap={'set' if row[_SOFTCAP] else None} "
        f"sinks={'set' if row[_SINKS] else None}"
    )
    return ", ".join(parts)


def agree_once(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    group: ProcessGroup,
    meta: TokenMeta,
    *,
    method: str,
    causal: bool,
    window: int | None,
    softcap: float | None,
    sinks: torch.Tensor | None,
    where: str,
) -> None:
    """At the first call on ``meta``: raise on every rank unless every rank's call agrees.

    Args:
        q: ``[B, Hq, L, D]`` local queries, in the dtype the call computes in.
        k: ``[B, Hkv, L, D]`` local keys.
        v: ``[B, Hkv, L, Dv]`` local values.
        group: The CP process group (two ranks or more).
        meta: The batch's token meta: the first call on it exchanges, later ones do not.
        method: The requested method (``"auto"`` resolves alike on ranks that agree).
        causal: The call's causal flag.
        window: The call's sliding window.
        softcap: The call's soft-cap.
        sinks: The call's attention sinks.
        where: The entry point, for the message.

    Raises:
        ValueError: on every rank, when the ranks' calls differ (each rank's call named), or a
            rank is in another collective of this size (a step header).
    """
    if torch.compiler.is_compiling() or meta.plan_cache.get(_CACHE_KEY):
        return
    mine = call_facts(
        q, k, v, method=method, causal=causal, window=window, softcap=softcap, sinks=sinks
    )
    rows = all_gather_fixed(mine, group).tolist()
    if any(row[_MAGIC] != _MAGIC_VALUE for row in rows):
        others = [r for r, row in enumerate(rows) if row[_MAGIC] != _MAGIC_VALUE]
        raise ValueError(
            f"{where}: CP ranks {others} are in another collective (a step header of "
            "prepare_cp_forward / ctx() / sync_grads) while this CP attention call starts: the "
            "ranks run different code. Every CP rank must make the same CP attention calls in "
            "the same order"
        )
    if any(row != rows[0] for row in rows):
        method_of = {_text_code(m): m for m in (*ATTENTION_CHOICES, method)}
        calls = "; ".join(f"rank {r}: {_describe(row, method_of)}" for r, row in enumerate(rows))
        raise ValueError(
            f"{where}: the CP ranks called CP attention with different inputs ({calls}). Every CP "
            "rank must pass the same dtypes, batch size, head counts, head dims, length and "
            "options (its K/V exchange has one size on every rank; a differing rank would crash "
            "or hang in it). Run the same model, in the same dtype and under the same autocast, "
            "on every CP rank"
        )
    meta.plan_cache[_CACHE_KEY] = True
