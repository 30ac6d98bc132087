"""Decide, before any collective, how each token mixer of a model runs under CP; compose the ctx.

:func:`check_token_mixers` runs at :func:`cpshard.prepare_cp_forward` (and
:func:`cpshard.make_cp_batch_and_ctx` given a ``model``) on every rank, from the model and the
call's arguments only (the same verdict on every rank, so nothing can hang):

* no token mixer outside attention, or cp = 1 with a batch that is not packed: nothing changes;
* a mixer inside a softmax-attention module (a short convolution over its keys): no exact path
  -> ``ValueError`` (cp = 1 is the alternative);
* ``strict=True``: the generic path is refused -> ``ValueError`` naming the modules, the
  feature and the alternatives (``strict=False``, cp = 1); for a packed batch at cp = 1 the
  reason is the model's own mixers, which carry state and convolution across documents;
* otherwise the mixers run through the generic exact path (:mod:`cpshard.mixers.generic`) and
  one :class:`CPMixerWarning` names them and the cost (their compute ``C`` times) at cp > 1.

:func:`with_token_mixers` wraps the batch's ctx so that the generic path's hooks live exactly as
long as each ``with ctx():`` (and are re-installed for an activation checkpoint's
recomputation, through the CP mode's ``on_recompute``).

Imports the detection, the generic path, :mod:`cpshard._comm` (the mesh's group), the shard
facts and the active CP mode.
"""

from __future__ import annotations

import contextlib
import functools
import warnings
from collections.abc import Iterator, Sequence

from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from cpshard._comm import cp_group
from cpshard.attention.context import active_mode
from cpshard.mixers.detect import MixerSite, find_token_mixers
from cpshard.mixers.generic import GenericMixers
from cpshard.sharding.facts import ContextFactory, CPContext

__all__ = ["CPMixerWarning", "check_token_mixers", "with_token_mixers"]


class CPMixerWarning(UserWarning):
    """Token mixers outside attention run over the whole sequence on every CP rank."""


def _listing(sites: Sequence[MixerSite], limit: int = 6) -> str:
    shown = [f"{s.name} ({s.class_name}: {s.evidence})" for s in sites[:limit]]
    more = f" and {len(sites) - limit} more" if len(sites) > limit else ""
    return "; ".join(shown) + more


def check_token_mixers(
    model: nn.Module, cp_size: int, *, strict: bool, packed: bool
) -> tuple[MixerSite, ...]:
    """The token mixers the batch's ctx must run through the generic path (maybe none).

    Args:
        model: The (unwrapped) model.
        cp_size: CP group size.
        strict: Refuse the generic path instead of paying its cost.
        packed: The batch is packed (``seq_lens`` / ``cu_seqlens``).

    Returns:
        The mixers to hook (empty when nothing needs to change).

    Raises:
        ValueError: a mixer with no exact path, or ``strict`` with mixers that need the generic
            path (the same on every rank, before any collective).
    """
    sites = find_token_mixers(model)
    if not sites or (cp_size == 1 and not packed):
        return ()
    model_name = type(model).__name__
    inside = [s for s in sites if s.inside_attention]
    if inside:
        raise ValueError(
            f"{model_name} mixes tokens inside softmax attention ({_listing(inside)}): cpshard "
            "has no exact CP path for attention with a token mixer inside it (its CP attention "
            "sees only the attention scores). Run this model at cp=1 (and unpacked)"
        )
    if strict:
        if cp_size == 1:
            raise ValueError(
                f"{model_name} has token mixers outside attention ({_listing(sites)}) and the "
                "batch is packed: the model's own mixers carry their recurrent state and "
                "convolution across document boundaries (its pure-torch paths cannot keep "
                "packed documents apart), so a packed forward is silently wrong. Pass "
                "strict=False (cpshard then runs each mixer per document, exactly), or give "
                "the documents unpacked (one per row)"
            )
        raise ValueError(
            f"{model_name} has token mixers outside attention ({_listing(sites)}) and "
            f"strict=True: under CP each would see only this rank's shard from a zero state "
            f"(silently wrong), and their exact generic path runs them over the whole sequence "
            f"on every rank ({cp_size}x their compute). Pass strict=False to accept that cost, "
            "or run this model at cp=1"
        )
    if cp_size > 1:
        warnings.warn(
            f"{model_name}: {len(sites)} token mixer(s) outside attention run through cpshard's "
            f"generic exact CP path ({_listing(sites)}): each gathers the sequence and runs over "
            f"all of it on every rank, {cp_size}x its compute and activation memory. Pass "
            "strict=True to refuse instead",
            CPMixerWarning,
            stacklevel=3,
        )
    return sites


@contextlib.contextmanager
def _scope(
    sites: Sequence[MixerSite], cp_mesh: DeviceMesh | None, inner: ContextFactory
) -> Iterator[None]:
    with inner():
        mode = active_mode()
        if mode is None:  # a custom context without cpshard's CP mode: nothing to compose
            raise ValueError(
                "the token mixers of this model need cpshard's CP context, but this ctx did not "
                "enter one; use the ctx returned by cpshard.prepare_cp_forward"
            )
        hooks = GenericMixers(sites, cp_group(cp_mesh), mode.meta)
        mode.on_recompute.append(hooks.installed)  # a checkpoint's recomputation hooks again
        with hooks.installed():
            yield


def with_token_mixers(
    ctx: CPContext, sites: Sequence[MixerSite], cp_mesh: DeviceMesh | None
) -> CPContext:
    """``ctx`` with the generic path's hooks on ``sites`` for the span of each ``with ctx():``."""
    if not sites:
        return ctx
    return CPContext(functools.partial(_scope, tuple(sites), cp_mesh, ctx), ctx.facts)
