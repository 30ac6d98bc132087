"""The generic exact path: a token mixer runs over whole documents in global order.

For a mixer cpshard has no native CP rule for, :class:`GenericMixers` installs a forward
pre-hook and a forward hook on the mixer module for the span of the batch's ``ctx()`` (removed
on exit; nothing is patched). On each call under the batch's CP context:

1. the pre-hook all-gathers the mixer's input ``hidden_states [B, L, *rest]`` over the CP group
   (:func:`cpshard._comm.all_gather_dim0`, whose backward reduce-scatters the input gradient),
   and lays it out as a batch of whole documents in global order
   (:mod:`cpshard.mixers.segments`): the mixer then runs once over ``[N, T, *rest]``, one row
   per document, so no state or convolution crosses a document boundary or a pad;
2. the forward hook keeps this rank's rows of the output, ``[B, L, *rest']``.

Cache arguments (``cache``, ``cache_params``, ``past_key_values``, ...) are dropped for the
call (a forward from an empty state is what training computes), ``cache_position`` too (it
describes local tokens). A per-token tensor aligned with the input (``[B, L, ...]``:
``position_ids``, which RecurrentGemma's RG-LRU reads to reset its state at position 0;
Zamba's second stream ``transformer_hidden_states``) is gathered and laid out by document like
``hidden_states``.
An attention mask, or any other tensor with the local length, raises: it could not follow
the gathered layout.

Exact in value and gradient (parameter gradients are each rank's share; the usual CP gradient
sum over the group completes them), at the cost of running the mixer over the whole sequence
on every rank: ``C`` times its compute, and its activations for ``C * L`` tokens.

Import rules: the rows of ``RULES`` in tests/unit/test_architecture.py that cover this module.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn
from torch.distributed import ProcessGroup

from cpshard._comm import all_gather_dim0
from cpshard.attention.context import active_mode
from cpshard.mixers.detect import MixerSite, hooks_on
from cpshard.mixers.segments import SegmentPlan, segment_plan
from cpshard.sharding.meta import TokenMeta

__all__ = ["GenericMixers", "gather_segments", "local_rows"]

_CACHE_NAMES = frozenset(
    {"cache", "cache_params", "past_key_values", "past_key_value", "layer_past", "state"}
)
_LOCAL_POSITION_NAMES = frozenset({"cache_position"})
_POSITIONS = "position_ids"


def gather_segments(x: torch.Tensor, plan: SegmentPlan, group: ProcessGroup | None) -> torch.Tensor:
    """All-gather ``x`` over the CP group and lay it out as whole documents in global order.

    Args:
        x: Local rows ``[B, L, *rest]``.
        plan: The batch's :class:`SegmentPlan`.
        group: The CP group, or ``None`` at cp = 1.

    Returns:
        ``[N, T, *rest]``: one row per document (zero rows past its end). The backward
        reduce-scatters (sums) the gradient of the gathered stream back to each rank's rows.
    """
    rows, rest = x.shape[0], x.shape[2:]
    if group is None:
        stream = x
    else:
        gathered = all_gather_dim0(x.transpose(0, 1).contiguous(), group, "sum")  # [C*L, B, ...]
        stream = gathered.transpose(0, 1)
    flat = stream.reshape(rows * stream.shape[1], *rest)
    flat = torch.cat([flat, flat.new_zeros((1, *rest))])
    return flat.index_select(0, plan.source.reshape(-1)).reshape(
        plan.num_segments, plan.max_len, *rest
    )


def local_rows(y: torch.Tensor, plan: SegmentPlan) -> torch.Tensor:
    """This rank's rows ``[B, L, *rest]`` of a segment-batch output ``y [N, T, *rest]``."""
    rest = y.shape[2:]
    flat = y.reshape(plan.num_segments * plan.max_len, *rest)
    rows, n = plan.local.shape
    return flat.index_select(0, plan.local.reshape(-1)).reshape(rows, n, *rest)


def _per_token(t: torch.Tensor, local_len: int) -> bool:
    return t.dim() >= 2 and local_len in tuple(t.shape[1:])


class GenericMixers:
    """The generic path's hooks for one batch (see the module docstring).

    Args:
        sites: The mixers to run over the whole sequence.
        group: The CP group, or ``None`` at cp = 1.
        meta: The batch's token meta (the hooks act only under a CP context of this meta).
    """

    def __init__(
        self, sites: Sequence[MixerSite], group: ProcessGroup | None, meta: TokenMeta
    ) -> None:
        self.sites = tuple(sites)
        self.group = group
        self.meta = meta
        self._plans: dict[tuple[int, str], SegmentPlan] = {}
        self._pending: dict[int, list[SegmentPlan | None]] = {}
        self._names = {id(s.module): s.name for s in self.sites}

    def plan(self, rows: int, device: torch.device) -> SegmentPlan:
        """The segment plan for ``rows`` batch rows on ``device`` (computed once)."""
        key = (rows, str(device))
        if key not in self._plans:
            self._plans[key] = segment_plan(self.meta, rows, device)
        return self._plans[key]

    def _active(self) -> bool:
        mode = active_mode()
        return mode is not None and mode.meta is self.meta

    def _follow(
        self, module: nn.Module, name: str, value: Any, rows: int, plan: SegmentPlan
    ) -> Any:
        """One other argument of the mixer's call, as the call over the gathered documents needs.

        Caches are dropped, and ``cache_position``; a per-token tensor aligned with the input
        (``[B or 1, L, *rest]``: ``position_ids``, a second hidden-state stream) is gathered and
        laid out like it (zeros past a document's end); an attention mask, or a tensor with the
        local length elsewhere, raises.
        """
        if value is None or isinstance(value, bool | int | float | str):
            return value
        if name in _CACHE_NAMES or "cache" in type(value).__name__.lower():
            return None
        if not isinstance(value, torch.Tensor) or name in _LOCAL_POSITION_NAMES:
            return None if name in _LOCAL_POSITION_NAMES else value
        n = self.meta.local_len
        if name == _POSITIONS and value.shape == (n,):
            value = value.unsqueeze(0)
        aligned = value.dim() >= 2 and value.shape[1] == n and value.shape[0] in (1, rows)
        if name != "attention_mask" and aligned:
            full = value.expand(rows, *value.shape[1:]).contiguous()
            return gather_segments(full, plan, self.group)
        if name == "attention_mask" or _per_token(value, n):
            raise ValueError(
                f"{type(module).__name__} ({self._names[id(module)]}) is a token mixer that "
                f"cpshard runs over the whole sequence under CP, but it got the per-token "
                f"argument {name or 'positional'!r} (shape {tuple(value.shape)}), which "
                "cannot follow the gathered sequence; call it without that argument, or "
                "run this model at cp=1"
            )
        return value

    def pre(
        self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
        """Forward pre-hook: gather the input and lay it out by document."""
        stack = self._pending.setdefault(id(module), [])
        if not self._active():
            stack.append(None)
            return None
        if args:
            x, rest_args, key = args[0], args[1:], None
        else:
            x, rest_args, key = kwargs.get("hidden_states"), (), "hidden_states"
        n = self.meta.local_len
        if not isinstance(x, torch.Tensor) or x.dim() < 2 or x.shape[1] != n:
            shape = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
            raise ValueError(
                f"{type(module).__name__} ({self._names[id(module)]}) mixes tokens outside "
                f"attention, so cpshard runs it over the whole sequence under CP; it needs its "
                f"input as hidden_states [B, L={n}, ...] (the local shard), got {shape}. If this "
                "module does not see the sharded sequence (e.g. an audio or vision tower), run "
                "it inside cpshard.attention.suspend()"
            )
        plan = self.plan(x.shape[0], x.device)
        if plan.trivial:
            stack.append(None)
            return None
        rows = x.shape[0]
        new_args = tuple(self._follow(module, "", a, rows, plan) for a in rest_args)
        new_kwargs = {
            k: self._follow(module, k, v, rows, plan) for k, v in kwargs.items() if k != key
        }
        seg = gather_segments(x, plan, self.group)
        stack.append(plan)
        if key is None:
            return (seg, *new_args), new_kwargs
        new_kwargs[key] = seg
        return new_args, new_kwargs

    def post(
        self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any
    ) -> Any:
        """Forward hook: keep this rank's rows of the output."""
        plan = self._pending[id(module)].pop()
        if plan is None:
            return output
        if isinstance(output, torch.Tensor):
            return local_rows(output, plan)
        if isinstance(output, tuple | list) and output and isinstance(output[0], torch.Tensor):
            first = local_rows(output[0], plan)
            return type(output)([first, *output[1:]])
        raise ValueError(
            f"{type(module).__name__} ({self._names[id(module)]}) returned "
            f"{type(output).__name__}; the generic CP path for token mixers needs a tensor "
            "[N, T, ...] (or a tuple starting with one); run this model at cp=1"
        )

    def installed(self) -> contextlib.AbstractContextManager[None]:
        """Register the hooks on every site for the span of the block, then remove them."""
        return hooks_on(self.sites, self.pre, self.post)
