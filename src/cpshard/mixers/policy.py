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
* Mamba2 (SSD) and Gated DeltaNet mixers run natively (:mod:`cpshard.mixers.mamba2`,
  :mod:`cpshard.mixers.gdn`) where each rank holds one in-order run (``contiguous``;
  ``layout="auto"`` then picks it for a dense batch);
* every other mixer runs through the generic exact path (:mod:`cpshard.mixers.generic`) and
  one :class:`CPMixerWarning` names them and the cost (their compute ``C`` times) at cp > 1.

:func:`with_token_mixers` wraps the batch's ctx so that the generic path's hooks live exactly as
long as each ``with ctx():`` (and are re-installed for an activation checkpoint's
recomputation, through the CP mode's ``on_recompute``).

Import rules: the rows of ``RULES`` in tests/unit/test_architecture.py that cover this module.
"""

from __future__ import annotations

import contextlib
import functools
import warnings
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from cpshard._comm import cp_group
from cpshard.attention.context import active_mode
from cpshard.mixers.detect import MixerSite, find_token_mixers
from cpshard.mixers.gdn import NativeGatedDeltaNet, is_native_gdn, serves_native_gdn
from cpshard.mixers.generic import GenericMixers
from cpshard.mixers.mamba2 import NativeMamba2, conv_width, is_native_mamba2, serves_native
from cpshard.module_tree import ModuleTree
from cpshard.sharding.facts import ContextFactory, CPContext

__all__ = ["CPMixerWarning", "MixerPlan", "check_token_mixers", "with_token_mixers"]


@dataclass(frozen=True)
class MixerPlan:
    """How the batch's ctx runs the model's token mixers.

    Attributes:
        sites: Every mixer the ctx hooks (empty: nothing changes).
        native: The sites with a native CP rule (Mamba2 / SSD, Gated DeltaNet), served
            natively when the batch's layout allows (:func:`cpshard.mixers.mamba2.serves_native`,
            :func:`cpshard.mixers.gdn.serves_native_gdn`), else generically.
        gdn: The sites of ``native`` that are Gated DeltaNet mixers (the rest are Mamba2).
        layout: The layout to use (``"auto"`` becomes ``"contiguous"`` when a native site
            needs in-order shards).
    """

    sites: tuple[MixerSite, ...] = ()
    native: tuple[MixerSite, ...] = ()
    layout: str = "auto"
    gdn: tuple[MixerSite, ...] = ()


class CPMixerWarning(UserWarning):
    """Token mixers outside attention run over the whole sequence on every CP rank."""


def _listing(sites: Sequence[MixerSite], limit: int = 6) -> str:
    shown = [f"{s.name} ({s.class_name}: {s.evidence})" for s in sites[:limit]]
    more = f" and {len(sites) - limit} more" if len(sites) > limit else ""
    return "; ".join(shown) + more


def check_token_mixers(
    model: nn.Module,
    cp_size: int,
    *,
    strict: bool,
    packed: bool,
    layout: str = "auto",
    tree: ModuleTree | None = None,
) -> MixerPlan:
    """How the batch's ctx must run the model's token mixers (maybe not at all).

    Args:
        model: The (unwrapped) model.
        cp_size: CP group size.
        strict: Refuse the generic path instead of paying its cost.
        packed: The batch is packed (``seq_lens`` / ``cu_seqlens``).
        layout: The caller's layout name.
        tree: The model's module tree of this prepare (its memo keeps the detected sites
            between prepares of an unchanged model; ``None``: detect from scratch).

    Returns:
        The :class:`MixerPlan`.

    Raises:
        ValueError: a mixer with no exact path, or ``strict`` with mixers that need the generic
            path (the same on every rank, before any collective).
    """
    sites = find_token_mixers(model, tree)
    if not sites or (cp_size == 1 and not packed):
        return MixerPlan(layout=layout)
    model_name = type(model).__name__
    inside = [s for s in sites if s.inside_attention]
    if inside:
        raise ValueError(
            f"{model_name} mixes tokens inside softmax attention ({_listing(inside)}): cpshard "
            "has no exact CP path for attention with a token mixer inside it (its CP attention "
            "sees only the attention scores). Run this model at cp=1 (and unpacked)"
        )
    by_class: dict[type, str | None] = {}
    for s in sites:
        if cp_size > 1 and type(s.module) not in by_class:
            by_class[type(s.module)] = (
                "mamba2"
                if is_native_mamba2(s.module)
                else "gdn"
                if is_native_gdn(s.module)
                else None
            )
    native = tuple(s for s in sites if by_class.get(type(s.module)) is not None)
    gdn = tuple(s for s in native if by_class[type(s.module)] == "gdn")
    # "auto" picks contiguous below: dense shards that are one in-order run per rank
    serving = layout == "contiguous" or layout == "auto"
    served = native if (not packed and serving) else ()
    if native and layout == "auto" and not packed:
        layout = "contiguous"  # the native paths need one in-order run per rank
    generic = [s for s in sites if s not in served]
    if strict and generic:
        if cp_size == 1:
            raise ValueError(
                f"{model_name} has token mixers outside attention ({_listing(sites)}) and the "
                "batch is packed: the model's own mixers carry their recurrent state and "
                "convolution across document boundaries (its pure-torch paths cannot keep "
                "packed documents apart), so a packed forward is silently wrong. Pass "
                "strict=False (cpshard then runs each mixer per document, exactly), or give "
                "the documents unpacked (one per row)"
            )
        hint = (
            "; layout='contiguous' with dense rows serves the Mamba2 / Gated DeltaNet mixers "
            "natively"
            if native and not served
            else ""
        )
        raise ValueError(
            f"{model_name} has token mixers outside attention without a native CP rule for "
            f"this batch ({_listing(generic)}) and strict=True: under CP each would see only "
            f"this rank's shard from a zero state (silently wrong), and their exact generic "
            f"path runs them over the whole sequence on every rank ({cp_size}x their compute). "
            f"Pass strict=False to accept that cost, or run this model at cp=1{hint}"
        )
    if cp_size > 1 and generic:
        warnings.warn(
            f"{model_name}: {len(generic)} token mixer(s) outside attention run through "
            f"cpshard's generic exact CP path ({_listing(generic)}): each gathers the sequence "
            f"and runs over all of it on every rank, {cp_size}x its compute and activation "
            "memory. Pass strict=True to refuse instead",
            CPMixerWarning,
            stacklevel=3,
        )
    return MixerPlan(tuple(sites), native, layout, gdn)


@contextlib.contextmanager
def _scope(plan: MixerPlan, cp_mesh: DeviceMesh | None, inner: ContextFactory) -> Iterator[None]:
    with inner():
        mode = active_mode()
        if mode is None:  # a custom context without cpshard's CP mode: nothing to compose
            raise ValueError(
                "the token mixers of this model need cpshard's CP context, but this ctx did not "
                "enter one; use the ctx returned by cpshard.prepare_cp_forward"
            )
        group = cp_group(cp_mesh)
        native = [
            s
            for s in plan.native
            if group is not None
            and (
                serves_native_gdn(mode.meta, s.module)
                if s in plan.gdn
                else serves_native(mode.meta, conv_width(s.module))
            )
        ]
        gdn = [s for s in native if s in plan.gdn]
        mamba2 = [s for s in native if s not in plan.gdn]
        generic = [s for s in plan.sites if s not in native]
        with contextlib.ExitStack() as stack:
            if generic:
                hooks = GenericMixers(generic, group, mode.meta)
                mode.on_recompute.append(hooks.installed)  # a checkpoint's recomputation
                stack.enter_context(hooks.installed())
            if mamba2:
                assert group is not None
                own = NativeMamba2(mamba2, group, mode.meta)
                mode.on_recompute.append(own.installed)
                stack.enter_context(own.installed())
            if gdn:
                assert group is not None
                delta = NativeGatedDeltaNet(gdn, group, mode.meta)
                mode.on_recompute.append(delta.installed)
                stack.enter_context(delta.installed())
            yield


def with_token_mixers(ctx: CPContext, plan: MixerPlan, cp_mesh: DeviceMesh | None) -> CPContext:
    """``ctx`` with the mixer hooks of ``plan`` for the span of each ``with ctx():``."""
    if not plan.sites:
        return ctx
    return CPContext(functools.partial(_scope, plan, cp_mesh, ctx), ctx.facts)
