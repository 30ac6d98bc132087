"""What one shard learned: :class:`ShardFacts`, the :class:`CPContext` that carries them, and the
batch identity that local tensors carry.

A ``shard_batch`` returns ``(ctx_factory, batch)``; a :class:`CPContext` is a context factory
that also carries the frozen :class:`ShardFacts` of that shard (lengths, caller coordinates,
rank map, token meta), derived from the shard's one
:class:`~cpshard.layouts.placement.Placement` (:meth:`ShardFacts.of`).
:meth:`cpshard.CPSharder.shard` binds a sharder to them (with the mesh the batch was sharded
on), once per shard: nothing is updated field by field.

Import rules: the rows of ``RULES`` in tests/unit/test_architecture.py that cover this module.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch.distributed.device_mesh import DeviceMesh

from cpshard.layouts.coordinates import CallerCoordinates
from cpshard.layouts.deferred import raw
from cpshard.layouts.placement import Placement
from cpshard.sharding.consistency import content_hash
from cpshard.sharding.meta import TokenMeta

__all__ = [
    "CPContext",
    "ContextFactory",
    "ShardBatchFn",
    "ShardFacts",
    "batch_tag",
    "call_record_tensors",
    "local_record",
    "matches_record",
    "same_shard",
    "tag_tensor",
]

# Local batch tensors whose content identifies a shard when their tag is lost (a clone, .to()).
RECORDED_KEYS = ("input_ids", "position_ids")

ContextFactory = Callable[[], AbstractContextManager[Any]]


class ShardBatchFn(Protocol):
    """``shard_batch(cp_mesh, tp_mesh, batch, *, loss_mask=None, padding_token_id=0)``."""

    def __call__(
        self,
        cp_mesh: DeviceMesh | None,
        tp_mesh: DeviceMesh | None,
        batch: dict[str, Any],
        *,
        loss_mask: torch.Tensor | None = None,
        padding_token_id: int = 0,
    ) -> tuple[ContextFactory, dict[str, Any]]: ...


@dataclass(frozen=True)
class ShardFacts(CallerCoordinates):
    """What one ``shard_batch`` learned about the layout it applied (frozen; one per shard).

    The caller's coordinates (:class:`~cpshard.layouts.coordinates.CallerCoordinates`:
    ``original_seq_len``, ``padded_seq_len``, ``input_row_shape``,
    ``input_token_stream_positions``), plus:

    Attributes:
        rank_map: LongTensor ``[C, L]``: global positions of every rank's local tokens.
        token_meta: Positions and document ids of every token for CP attention.
        cp_mesh: The CP mesh the batch was sharded on (set by :meth:`cpshard.CPSharder.shard`).
        check_consistency: Whether ``gather_token_tensor`` first compares dtype and shape across
            the CP ranks (set by :meth:`cpshard.CPSharder.shard`).
        placement: The :class:`~cpshard.layouts.placement.Placement` these facts were derived
            from (:meth:`of`): then ``rank_map`` is its rank map and ``token_meta`` is derived
            from it, one copy of the layout; ``None`` for facts built field by field.
    """

    rank_map: torch.Tensor | None = None
    token_meta: TokenMeta | None = None
    cp_mesh: DeviceMesh | None = field(default=None, compare=False)
    check_consistency: bool = True
    placement: Placement | None = field(default=None, compare=False, repr=False)

    @classmethod
    def of(cls, placement: Placement, rank: int) -> ShardFacts:
        """The facts of rank ``rank`` of a placement: its caller coordinates, its rank map and
        the token meta derived from it (no field copied by hand)."""
        coords = placement.coordinates
        return cls(
            coords.original_seq_len,
            coords.padded_seq_len,
            coords.input_row_shape,
            raw(coords, "input_token_stream_positions"),  # not made here
            rank_map=placement.rank_map,
            token_meta=TokenMeta.of(placement, rank),
            placement=placement,
        )

    @property
    def attention_method(self) -> str | None:
        """The CP attention method the dispatcher runs for this batch (``attention="auto"``
        resolved per batch), or ``None`` (no token meta, or the shard brings its own context).

        Recorded by the dispatcher in the token meta's per-batch cache.
        """
        meta = self.token_meta
        got = None if meta is None else meta.plan_cache.get("attention_method")
        return got if isinstance(got, str) else None


class CPContext:
    """A context-manager factory that also carries the facts of the shard that made it.

    Calling it returns a fresh context manager each time, so the same ``ctx`` can wrap several
    forward passes (e.g. policy and reference model on one batch). It is also a context manager
    itself: ``with ctx:`` is ``with ctx():`` (the spelling of torchtitan and Accelerate).

    Args:
        factory: The shard's own context, or ``None`` when the shard brings none (the built-in
            ``shard_batch`` functions only shard: the dispatcher supplies CP attention over
            ``facts.token_meta``). Calling a ``CPContext`` with no factory raises when its facts
            carry a token meta (the context of such a shard is the dispatcher's: entering the
            bare one would run shard-local attention, silently wrong at cp > 1), and enters a
            ``nullcontext`` otherwise. A ``CPContext`` given here is unwrapped (its factory is
            kept, the new facts replace its facts).
        facts: The shard's facts.
    """

    def __init__(self, factory: ContextFactory | None, facts: ShardFacts) -> None:
        # Wrapping another CPContext (new facts for the same shard) keeps its context as is.
        self.factory: ContextFactory | None = (
            factory.factory if isinstance(factory, CPContext) else factory
        )
        self.facts = facts
        self._entered: list[AbstractContextManager[Any]] = []

    def __call__(self) -> AbstractContextManager[Any]:
        if self.factory is not None:
            return self.factory()
        if self.facts.token_meta is not None:
            raise ValueError(
                "this ctx is the bare result of a shard_batch that brings no context of its own "
                "(every built-in layout): cpshard's CP attention over its token meta is added by "
                "the dispatcher, so entering it would run shard-local attention (silently wrong "
                "at cp > 1). Use the ctx returned by cpshard.prepare_cp_forward / "
                "make_cp_batch_and_ctx, or enter cpshard.attention.cp_attention_context(cp_mesh, "
                "ctx.facts.token_meta, method) yourself"
            )
        return nullcontext()

    def __enter__(self) -> Any:
        cm = self()
        out = cm.__enter__()
        self._entered.append(cm)
        return out

    def __exit__(self, *exc: Any) -> Any:
        return self._entered.pop().__exit__(*exc)


_TAG = "_cpshard_batch"
"""The attribute a local batch tensor carries its shard identity in: written by
:func:`tag_tensor` and read by :func:`batch_tag` only (the sharder's verbs, the CP attention
context and the model guard all ask :func:`batch_tag`)."""


def tag_tensor(t: torch.Tensor, tag: object) -> None:
    """Mark a local batch tensor as belonging to the shard identified by ``tag``."""
    setattr(t, _TAG, tag)


def batch_tag(t: object) -> object:
    """The shard identity a local batch tensor carries, or ``None``."""
    return getattr(t, _TAG, None) if isinstance(t, torch.Tensor) else None


def same_shard(tag: object, meta: object) -> bool:
    """Whether a tensor's shard identity ``tag`` is compatible with ``meta``.

    The same object, or two token metas with equal content (two ``prepare_cp_forward`` calls on
    the same batch, e.g. for a policy and a reference model). A tag that is not a token meta (the
    facts of a custom sharder that captured none) carries nothing to compare: it always passes,
    so a stale local tensor of such a sharder is not detected. A token-meta tag never matches an
    identity that is not a token meta.
    """
    if tag is meta:
        return True
    if not isinstance(tag, TokenMeta) or not isinstance(meta, TokenMeta):
        return not isinstance(tag, TokenMeta)  # nothing to compare against
    return (
        tag.rank == meta.rank
        and tag.world_size == meta.world_size
        and tag.positions.shape == meta.positions.shape
        and tag.document_ids.shape == meta.document_ids.shape
        and torch.equal(tag.positions, meta.positions.to(tag.positions.device))
        and torch.equal(tag.document_ids, meta.document_ids.to(tag.document_ids.device))
    )


def local_record(batch: Mapping[str, Any]) -> dict[str, tuple[tuple[int, ...], torch.Tensor]]:
    """``{key: (shape, tensor)}`` of a sharded batch's local ``input_ids`` / ``position_ids``.

    The tensors are hashed on first comparison (:func:`matches_record`: a forward given copies
    of them, or one outside its ctx), not here: a prepare whose forwards get the local tensors
    themselves (their tag names the shard) hashes nothing, and a local tensor edited in place
    before its forward is recorded as the forward sees it. The record holds a view of each (the
    same storage, a tensor object of its own): not the tagged tensor, which refers to the meta
    that holds the record.
    """
    out: dict[str, tuple[tuple[int, ...], torch.Tensor]] = {}
    for key in RECORDED_KEYS:
        value = batch.get(key)
        if isinstance(value, torch.Tensor) and value.device.type != "meta":
            out[key] = (tuple(value.shape), value.detach())
    return out


def call_record_tensors(
    module: Any, args: tuple[Any, ...], kwargs: Mapping[str, Any]
) -> dict[str, torch.Tensor]:
    """The untagged ``input_ids`` / ``position_ids`` tensors of a model call (by name, or bound
    to the forward's positional parameters)."""
    named = {k: v for k, v in kwargs.items() if k in RECORDED_KEYS}
    if args:
        try:
            params = list(inspect.signature(module.forward).parameters)
        except (TypeError, ValueError):
            params = []
        for name, value in zip(params, args, strict=False):
            if name in RECORDED_KEYS:
                named.setdefault(name, value)
    return {k: v for k, v in named.items() if isinstance(v, torch.Tensor) and batch_tag(v) is None}


def matches_record(
    record: dict[str, tuple[tuple[int, ...], torch.Tensor | tuple[int, torch.device]]],
    tensors: Mapping[str, torch.Tensor],
) -> bool | None:
    """Whether call tensors are the shard's (same shape and content for every recorded key).

    A recorded tensor is hashed on its first comparison, and its hash kept in ``record`` with
    its device (:func:`local_record`); a call tensor is hashed on that device (a local tensor
    moved by ``.to()`` is still the shard's: the CPU and accelerator hashes differ), one content
    hash per element of each side (:func:`cpshard.sharding.consistency.content_hash`).

    Returns:
        ``None`` when no key is both recorded and given (nothing to compare), else whether
        every common key has the recorded shape and content hash.
    """
    common = [k for k in tensors if k in record]
    if not common:
        return None
    for key in common:
        shape, held = record[key]
        t = tensors[key]
        if tuple(t.shape) != shape:
            return False
        if isinstance(held, torch.Tensor):
            held = (int(content_hash(held)), held.device)
            record[key] = (shape, held)
        value, device = held
        if int(content_hash(t.detach().to(device))) != value:
            return False
    return True
