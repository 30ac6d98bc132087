"""``CPSharder``: the CP contract object and its caller-coordinate token verbs.

A sharder is a closed set of verbs with open implementations: ``shard_batch`` and
``local_token_global_indices`` are plain callables that a layout (or a model that owns its CP)
fills in. :meth:`CPSharder.shard` returns, with the local batch, a sharder *bound* to that batch:
its frozen :class:`~cpshard.sharding.facts.ShardFacts` (the mesh the batch was sharded on
included) are never replaced by a later shard, so it cannot go stale; the dispatcher hands it to
the caller. The sharder that shards (the template) also answers for its latest batch, the seed's
contract. The fact names of the contract (``original_seq_len``, ``padded_seq_len``, ...) read the
facts. The token verbs then move any per-token tensor between the caller's coordinates
(:mod:`cpshard.layouts.coordinates`) and the local shard, exactly as the batch was moved; the
gather/scatter index they copy with is this sharder's cache, keyed by the shard's placement.

Import rules: the rows of ``RULES`` in tests/unit/test_architecture.py that cover this module.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.distributed.device_mesh import DeviceMesh

from cpshard import _comm
from cpshard.layouts.deferred import replace
from cpshard.sharding.consistency import verb_descriptor, verb_mismatch_message
from cpshard.sharding.facts import (
    CPContext,
    ShardBatchFn,
    ShardFacts,
    batch_tag,
    local_record,
    same_shard,
    tag_tensor,
)
from cpshard.sharding.gather import gather_with_header, slot_bytes
from cpshard.sharding.meta import TokenMeta
from cpshard.sharding.token_index import TokenIndex

__all__ = ["CPContext", "CPSharder", "ShardBatchFn", "ShardFacts", "gather_rank_map"]

IndicesFn = Callable[[DeviceMesh | None, int, torch.device], torch.Tensor]
RankMapFn = Callable[[int, int, torch.device], torch.Tensor]


class _GatherSlot:
    """Payload bytes of the checked gather's one collective, shared by a sharder and the
    sharders bound to its batches: agreed by every rank without a collective (the last gather's
    size, seeded at shard time), see :mod:`cpshard.sharding.gather`."""

    __slots__ = ("nbytes",)

    def __init__(self) -> None:
        self.nbytes = 0


def _check_tensor(t: object, verb: str) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(
            f"{verb} needs a torch.Tensor, got {type(t).__name__}; convert it first, e.g. "
            "torch.as_tensor(x)"
        )
    if t.device.type == "meta":
        raise ValueError(
            f"{verb} got a tensor on the meta device (shape {tuple(t.shape)}), which holds no "
            "values; materialise it first (e.g. model.to_empty(device=...) and an init)"
        )
    return t


def _norm_dim(t: torch.Tensor, seq_dim: int, name: str = "seq_dim") -> int:
    if not -t.dim() <= seq_dim < t.dim():
        raise ValueError(
            f"{name}={seq_dim} is out of range for a {t.dim()}-D tensor of shape "
            f"{tuple(t.shape)}; pass a dim in [{-t.dim()}, {t.dim() - 1}]"
        )
    return seq_dim % t.dim()


def gather_rank_map(
    local: torch.Tensor, cp_mesh: DeviceMesh | None, padded_seq_len: int
) -> torch.Tensor:
    """Every rank's local map, learned by one all-gather (for a sharder with no captured map).

    Each rank sends exactly ``P / C + 1`` values (its map, then its true length), so a rank whose
    map has the wrong length raises the same ``ValueError`` on every rank instead of breaking the
    collective.

    Args:
        local: LongTensor ``[P / C]``: this rank's ``local_token_global_indices``.
        cp_mesh: 1-D CP mesh or ``None``.
        padded_seq_len: ``P``, a multiple of the CP size.

    Returns:
        LongTensor ``[C, P / C]`` on ``local``'s device.
    """
    world = _comm.cp_rank_and_size(cp_mesh)[1]
    n = padded_seq_len // world
    fixed = torch.full((n + 1,), -1, dtype=torch.long)
    m = min(n, local.numel())
    fixed[:m] = local.reshape(-1)[:m].long().cpu()
    fixed[n] = local.numel()
    group = _comm.cp_group(cp_mesh)
    if group is None or cp_mesh is None:
        full = fixed.view(1, n + 1)
    else:  # on the mesh's device, whatever device the caller built its map on
        full = _comm.all_gather_fixed(fixed, group)
    for rank, length in enumerate(full[:, n].tolist()):
        if length != n:
            raise ValueError(
                f"rank {rank}'s local_token_global_indices has {length} tokens, expected "
                f"padded_seq_len / cp_size = {n}"
            )
    return full[:, :n].to(local.device)


@dataclass
class CPSharder:
    """The CP contract: shard a batch, and shard/gather any per-token tensor like it.

    Attributes:
        shard_batch: ``(cp_mesh, tp_mesh, batch, *, loss_mask, padding_token_id) ->
            (ctx_factory, batch)``; pads and shards the batch. A ``ctx_factory`` that is a
            :class:`~cpshard.sharding.facts.CPContext` carries the facts of the shard.
        local_token_global_indices: ``(cp_mesh, padded_seq_len, device) -> LongTensor [P/C]``:
            global position of each local token, local order; ``None`` for data-dependent layouts,
            whose map is captured by ``shard_batch`` (``ShardFacts.rank_map``).
        layout: Diagnostic label only (``"none"``, ``"round_robin"``, ...); no code branches on it.
        rank_map_fn: Optional ``(world_size, padded_seq_len, device) -> LongTensor [C, P/C]``
            for a closed-form layout whose ``shard_batch`` captures no rank map, so its gathers
            need no extra collective to learn the other ranks' maps (the built-in layouts
            capture theirs).

    The facts (:attr:`facts`, one frozen :class:`~cpshard.sharding.facts.ShardFacts`):
    ``original_seq_len``, ``padded_seq_len``, ``input_row_shape``,
    ``input_token_stream_positions`` (the seed's captured fields), and read-only ``rank_map``,
    ``token_meta``, ``cp_mesh`` and ``check_consistency``. :meth:`shard` returns a sharder
    bound to the batch it sharded (:attr:`is_bound`): its facts are that batch's for good, so
    its verbs keep answering for that batch after later shards. The sharder that shards answers
    for its latest batch (the seed's mutable holder, kept for the seed's contract).

    The seed's contract works unchanged:

    * ``CPSharder(shard_batch, indices, original_seq_len=..., padded_seq_len=...,
      input_row_shape=..., input_token_stream_positions=...)``: the given facts are this
      sharder's from the start (its verbs work before any shard) and the base of every shard;
    * a ``shard_batch`` that records facts on the sharder it belongs to (the seed's
      ``record_on=sharder``: ``sharder.original_seq_len = S``, ``sharder.padded_seq_len = P``)
      instead of returning them: each assignment replaces the frozen facts (never edits them),
      and the facts recorded during :meth:`shard` become that shard's facts when its context
      factory carries none. ``shard_batch=None`` at construction, assigned before the first
      shard (the seed's two-step model hooks), works too.
    """

    shard_batch: ShardBatchFn
    local_token_global_indices: IndicesFn | None
    layout: str = "custom"
    rank_map_fn: RankMapFn | None = None
    _facts: ShardFacts = field(init=False, repr=False, compare=False)
    _built_facts: ShardFacts = field(init=False, repr=False, compare=False)
    _slot: _GatherSlot = field(init=False, repr=False, compare=False)
    # The sharder this one is bound from (None: not bound to a batch).
    _origin: CPSharder | None = field(default=None, init=False, repr=False, compare=False)
    # Gather/scatter indices per (padded length, device) of one placement (or facts).
    _index_owner: object = field(default=None, init=False, repr=False, compare=False)
    _index_cache: dict[tuple[int, str], TokenIndex] = field(init=False, repr=False, compare=False)

    def __init__(
        self,
        shard_batch: ShardBatchFn | None,
        local_token_global_indices: IndicesFn | None,
        layout: str = "custom",
        rank_map_fn: RankMapFn | None = None,
        *,
        original_seq_len: int | None = None,
        padded_seq_len: int | None = None,
        input_row_shape: tuple[int, ...] | None = None,
        input_token_stream_positions: torch.Tensor | None = None,
    ) -> None:
        # ``None`` only until assigned: the seed's hooks bind shard_batch to the sharder itself.
        self.shard_batch = shard_batch  # type: ignore[assignment]
        self.local_token_global_indices = local_token_global_indices
        self.layout = layout
        self.rank_map_fn = rank_map_fn
        shape = None if input_row_shape is None else tuple(int(d) for d in input_row_shape)
        self._built_facts = ShardFacts(
            original_seq_len, padded_seq_len, shape, input_token_stream_positions
        )
        self._facts = self._built_facts
        self._slot = _GatherSlot()
        self._origin = None
        self._index_owner = None
        self._index_cache = {}

    def _bound_to(self, facts: ShardFacts) -> CPSharder:
        """A sharder with this one's callables, bound to ``facts`` (one batch) for good."""
        bound = copy.copy(self)  # a subclass stays itself, with its own attributes
        bound._built_facts = bound._facts = facts
        bound._slot = self._slot  # the gather slot is shared: every rank gathers alike
        bound._origin = self
        bound._index_owner = None
        bound._index_cache = {}
        return bound

    @property
    def is_bound(self) -> bool:
        """Whether this sharder is bound to one batch (returned by :meth:`shard`)."""
        return self._origin is not None

    # ------------------------------------------------------------------ sharding a batch
    def shard(
        self,
        cp_mesh: DeviceMesh | None,
        batch: dict[str, Any],
        *,
        tp_mesh: DeviceMesh | None = None,
        loss_mask: torch.Tensor | None = None,
        padding_token_id: int = 0,
        check_consistency: bool = True,
    ) -> tuple[CPContext, dict[str, Any], CPSharder]:
        """Run ``shard_batch``; bind a sharder to the batch it returns.

        Args:
            cp_mesh: 1-D CP mesh (validated by the caller) or ``None``.
            batch: The caller's batch; never mutated.
            tp_mesh: Handed to ``shard_batch`` (not kept).
            loss_mask: Optional ``[B, S]`` loss mask, sharded like the tokens.
            padding_token_id: Pad id for ``input_ids``.
            check_consistency: Whether ``gather_token_tensor`` compares dtype and shape across
                the CP ranks first.

        Returns:
            ``(ctx, sharded_batch, bound)``: ``bound`` is a sharder bound to this batch (its
            facts are ``ctx.facts`` for good); this sharder's facts become them too (its latest
            batch). Sharding with a bound sharder shards with the one it was bound from.
        """
        if self._origin is not None:
            return self._origin.shard(
                cp_mesh,
                batch,
                tp_mesh=tp_mesh,
                loss_mask=loss_mask,
                padding_token_id=padding_token_id,
                check_consistency=check_consistency,
            )
        if self.shard_batch is None:
            raise TypeError(
                f"this sharder (layout={self.layout!r}) has shard_batch=None; assign its "
                "shard_batch (e.g. sharder.shard_batch = functools.partial(fn, "
                "record_on=sharder)) before sharding a batch"
            )
        # Facts recorded on the sharder during shard_batch (the seed's record_on) start from the
        # construction facts, never from an older shard's.
        self._facts = self._built_facts
        ctx, out = self.shard_batch(
            cp_mesh, tp_mesh, batch, loss_mask=loss_mask, padding_token_id=padding_token_id
        )
        recorded = self._facts
        if isinstance(ctx, CPContext):
            factory, facts = ctx.factory, ctx.facts
        else:  # a custom shard_batch: `with ctx:` works too
            if not callable(ctx):
                raise TypeError(
                    f"shard_batch of this sharder (layout={self.layout!r}) must return a context "
                    f"factory and the sharded batch, got a {type(ctx).__name__} as the factory; "
                    "return e.g. (cpshard.CPContext(None, facts), batch) to get cpshard's CP "
                    "attention over facts.token_meta, or your own zero-argument factory"
                )
            # Any factory may carry its shard's facts (a `facts` attribute), not only a CPContext.
            carried = getattr(ctx, "facts", None)
            factory = ctx
            facts = carried if isinstance(carried, ShardFacts) else recorded
        facts = replace(facts, cp_mesh=cp_mesh, check_consistency=check_consistency)
        self._facts = facts
        bound = self._bound_to(facts)
        self._seed_gather_slot(out)
        # A fresh identity per shard: the local tensors carry it, so CP attention, the prepared
        # model and the verbs can tell this batch from an older or newer one by its token meta.
        # A shard without a token meta brings its own context (a model-owned or custom one that
        # cpshard cannot see entered): its tensors carry nothing, so no guard misreads them.
        if facts.token_meta is not None:
            for key, value in out.items():
                if isinstance(value, torch.Tensor) and value is not batch.get(key):
                    tag_tensor(value, facts.token_meta)
            # ... and a content record that survives .clone() / .to() of the local tensors
            facts.token_meta.local_record.update(local_record(out))
        return CPContext(factory, facts), out, bound

    def _seed_gather_slot(self, out: dict[str, Any]) -> None:
        """Seed the checked gather's slot with one fp32 value per local token of the sharded
        primary input (``[B, L]`` log-probs, the common gather, then ride in one collective):
        the same on every rank, whose batches the batch check found equal."""
        primary = out.get("input_ids")
        if not isinstance(primary, torch.Tensor):
            primary = out.get("inputs_embeds")
        if self._slot.nbytes == 0 and isinstance(primary, torch.Tensor) and primary.dim() >= 2:
            self._slot.nbytes = slot_bytes(int(primary.shape[0]) * int(primary.shape[1]) * 4)

    # ------------------------------------------------------------------ captured facts
    @property
    def facts(self) -> ShardFacts:
        """The frozen facts of this sharder's batch: the bound one's, else the latest shard's
        (the construction facts before any)."""
        return self._facts

    def _record(self, **fact: Any) -> None:
        """The seed's ``record_on``: replace the frozen facts with one field changed.

        Raises:
            AttributeError: this sharder is bound to a batch (its facts are that batch's).
        """
        if self._origin is not None:
            name = ", ".join(fact)
            raise AttributeError(
                f"cannot set {name} on a sharder bound to its batch (returned by "
                "prepare_cp_forward / make_cp_batch_and_ctx / CPSharder.shard): its facts are "
                "that batch's. Record facts on the sharder whose shard_batch runs (the seed's "
                "record_on=sharder), or build a new CPSharder"
            )
        self._facts = replace(self._facts, **fact)

    @property
    def original_seq_len(self) -> int | None:
        """Caller's sequence length before CP padding (see :class:`ShardFacts`)."""
        return self._facts.original_seq_len

    @original_seq_len.setter
    def original_seq_len(self, value: int | None) -> None:
        self._record(original_seq_len=None if value is None else int(value))

    @property
    def padded_seq_len(self) -> int | None:
        """Length of the padded global stream of this sharder's batch."""
        return self._facts.padded_seq_len

    @padded_seq_len.setter
    def padded_seq_len(self, value: int | None) -> None:
        self._record(padded_seq_len=None if value is None else int(value))

    @property
    def input_row_shape(self) -> tuple[int, ...] | None:
        """``(B, S)`` of the caller's rows when the layout flattened them into one stream."""
        return self._facts.input_row_shape

    @input_row_shape.setter
    def input_row_shape(self, value: tuple[int, ...] | None) -> None:
        self._record(input_row_shape=None if value is None else tuple(int(d) for d in value))

    @property
    def input_token_stream_positions(self) -> torch.Tensor | None:
        """LongTensor ``[B, S]``: stream slot of each caller token (``-1`` = dropped)."""
        return self._facts.input_token_stream_positions

    @input_token_stream_positions.setter
    def input_token_stream_positions(self, value: torch.Tensor | None) -> None:
        self._record(input_token_stream_positions=value)

    @property
    def rank_map(self) -> torch.Tensor | None:
        """LongTensor ``[C, L]``: global positions of every rank's local tokens."""
        return self._facts.rank_map

    @property
    def token_meta(self) -> TokenMeta | None:
        """Positions and document ids of every token, for CP attention."""
        return self._facts.token_meta

    @property
    def cp_mesh(self) -> DeviceMesh | None:
        """The CP mesh the last batch was sharded on (``None`` without CP)."""
        return self._facts.cp_mesh

    @property
    def check_consistency(self) -> bool:
        """Whether ``gather_token_tensor`` first checks dtype and shape across the CP ranks."""
        return self._facts.check_consistency

    @property
    def cp_size(self) -> int:
        """Number of CP ranks (1 without a mesh)."""
        return _comm.cp_rank_and_size(self.cp_mesh)[1]

    @property
    def _batch_tag(self) -> object:
        """Identity of this sharder's batch: its token meta, else the facts object itself."""
        facts = self._facts
        return facts.token_meta if facts.token_meta is not None else facts

    # ------------------------------------------------------------------ index maps
    def _local_indices(self, padded_seq_len: int, device: torch.device) -> torch.Tensor:
        rank, world = _comm.cp_rank_and_size(self.cp_mesh)
        rank_map = self.rank_map
        if rank_map is not None:
            expected = rank_map.numel()
            if padded_seq_len != expected:
                raise ValueError(
                    f"the captured CP map covers a padded stream of {expected} tokens "
                    f"({world} ranks x {rank_map.shape[1]}), got padded_seq_len="
                    f"{padded_seq_len}; the tensor does not match the batch this sharder last "
                    "sharded"
                )
            return rank_map[rank].to(device=device, dtype=torch.long)
        if self.local_token_global_indices is None:
            raise ValueError(
                f"this sharder (layout={self.layout!r}) has a data-dependent token layout whose "
                "map is captured by shard_batch; token-tensor shard/gather are unavailable "
                "before the first shard. Shard a batch first."
            )
        return self.local_token_global_indices(self.cp_mesh, padded_seq_len, device).long()

    def _stream_order(self, local: torch.Tensor, padded_seq_len: int) -> torch.Tensor:
        """LongTensor ``[P]``: global position of each slot of the rank-major gathered stream."""
        _, world = _comm.cp_rank_and_size(self.cp_mesh)
        if self.rank_map is not None:
            return self.rank_map.reshape(-1).to(local.device)
        if self.rank_map_fn is not None:
            return self.rank_map_fn(world, padded_seq_len, local.device).reshape(-1)
        if world == 1:
            return local
        # A custom sharder that captures no rank map and has no closed-form one (no built-in
        # layout): learn the other ranks' maps (small ints), once per padded length.
        return gather_rank_map(local, self.cp_mesh, padded_seq_len).reshape(-1)

    def _token_index(self, padded_seq_len: int, device: torch.device) -> TokenIndex:
        """The gather/scatter index of ``padded_seq_len``, cached per placement.

        The cache is keyed by the facts' placement (its rank map), or by the facts themselves
        when they carry none (a custom sharder's); a new key drops the older entries.
        """
        facts = self._facts
        place = facts.placement
        owner = place if place is not None and place.rank_map is facts.rank_map else facts
        if owner is not self._index_owner:
            self._index_owner, self._index_cache = owner, {}
        key = (padded_seq_len, str(device))
        index = self._index_cache.get(key)
        if index is None:
            local = self._local_indices(padded_seq_len, device)
            index = TokenIndex.build(local, self._stream_order(local, padded_seq_len))
            self._index_cache[key] = index
        return index

    # ------------------------------------------------------------------ token verbs
    def shard_token_tensor(
        self,
        t: torch.Tensor,
        *,
        seq_dim: int = 1,
        fill: float | int | bool | None = None,
    ) -> torch.Tensor:
        """Take this rank's shard of a per-token tensor given in the caller's coordinates.

        Args:
            t: Per-token tensor, e.g. advantages ``[B, S]`` or log-probs ``[B, S, K]``. Accepted
                coordinates: the padded length, the original length (needs ``fill``), the
                pre-flatten row shape ``[B, S, ...]`` of a flattened layout, or the input
                positions ``[B, S, ...]`` of a layout that repositions tokens (needs ``fill``).
            seq_dim: Sequence dim of ``t`` (ignored for row-shape and input-position tensors).
            fill: Value of CP padding slots.

        Returns:
            The local shard, in the same local order as the sharded batch; differentiable.

        Returns a new tensor that shares no memory with ``t`` at every CP size (``cp=1`` too), so
        in-place edits of the shard never reach the caller's tensor.

        Raises:
            TypeError: ``t`` is not a tensor.
            ValueError: ``seq_dim`` out of range, a meta-device tensor, a local tensor of another
                batch, or a length that maps to no captured fact.
        """
        t = _check_tensor(t, "shard_token_tensor")
        self._check_tag(t, "shard_token_tensor")
        seq_dim = _norm_dim(t, seq_dim)
        stream, dim = self._facts.to_stream(t, seq_dim, fill, self.layout)
        return self._token_index(stream.shape[dim], stream.device).take_local(stream, dim)

    def gather_token_tensor(
        self,
        t: torch.Tensor,
        *,
        seq_dim: int = 1,
        trim: bool = False,
        fill: float | int | bool | None = None,
        grad: str = "sum",
    ) -> torch.Tensor:
        """All-gather a local per-token tensor back into global (or caller) coordinates.

        One all-gather of the payload plus a 128-byte header that carries the cross-rank check
        (see below); the reorder is a precomputed inverse permutation.

        Args:
            t: Local shard, e.g. per-token log-probs ``[B, L]`` (never needs ``[B, S, V]``).
            seq_dim: Sequence dim of ``t``.
            trim: Restore the caller's coordinates (original length, row shape or input
                positions) instead of returning the padded global stream.
            fill: Value for input slots whose token was dropped (repositioning layouts only).
            grad: ``"sum"``: the backward is the exact adjoint of the all-gather (each rank
                receives the sum over ranks of the upstream gradient of its tokens); use it when
                each rank's loss covers a different part of the gathered tensor. ``"replicated"``:
                for a loss computed identically on every CP rank; each rank keeps its own slice of
                its own upstream gradient, so no rescaling by the CP size is needed.

        Returns:
            ``[..., P, ...]`` in global order, or the caller's coordinates with ``trim=True``; a
            new tensor that shares no memory with ``t`` (at ``cp=1`` too).

        The ranks compare dtype, shape, ``seq_dim``, ``trim``, ``fill`` and ``grad`` (unless
        ``check_consistency`` is off): a header of 16 int64 values rides in the data all-gather,
        whose payload slot every rank sizes alike without communicating (the previous gather's
        size, seeded at shard time with one fp32 per local token), so a mismatch raises the same
        ``ValueError`` on every rank and never breaks the collective. A payload larger than
        the slot (a new shape) costs one more, exact all-gather (:mod:`cpshard.sharding.gather`).

        Raises:
            TypeError: ``t`` is not a tensor.
            ValueError: the ranks passed different dtypes / shapes / arguments, unknown ``grad``
                mode, ``seq_dim`` out of range, a meta-device tensor, a local tensor of another
                batch, or a gathered length that does not match this sharder's batch.
        """
        facts = self._facts
        group = _comm.cp_group(facts.cp_mesh)
        carried: torch.Tensor | None = None
        checked = group is not None and facts.check_consistency
        if checked:  # the check rides in the data collective (see cpshard.sharding.gather)
            assert group is not None
            same_dim = (  # seq_dim=1 and -2 of a 3-D tensor are the same dim on every rank
                seq_dim % t.dim()
                if isinstance(t, torch.Tensor) and isinstance(seq_dim, int)
                and -t.dim() <= seq_dim < t.dim()
                else seq_dim
            )  # fmt: skip
            carried = self._gather_checked(t, group, same_dim, trim, fill, grad)
        t = _check_tensor(t, "gather_token_tensor")
        self._check_tag(t, "gather_token_tensor")
        if grad not in ("sum", "replicated"):
            raise ValueError(
                f"grad must be 'sum' (exact adjoint of the all-gather) or 'replicated' (loss "
                f"identical on every CP rank), got grad={grad!r}"
            )
        seq_dim = _norm_dim(t, seq_dim)
        world = self.cp_size
        padded = t.shape[seq_dim] * world
        if facts.padded_seq_len is not None and padded != facts.padded_seq_len:
            raise ValueError(
                f"a local tensor of length {t.shape[seq_dim]} on dim {seq_dim} gathers to "
                f"{padded} tokens over {world} ranks, but this sharder's batch has "
                f"padded_seq_len={facts.padded_seq_len} (local length "
                f"{facts.padded_seq_len // world}); pass the local shard of that batch"
            )
        if trim:
            facts.check_from_stream(tuple(t.shape), seq_dim, fill, self.layout)
        index = self._token_index(padded, t.device)
        # [C, *t.shape]: one all-gather of exactly the payload, no transpose of the local shard
        stacked = t.unsqueeze(0)
        if carried is not None:
            stacked = carried
        elif group is not None:
            mode: _comm.GradMode = "sum" if grad == "sum" else "replicated"
            stacked = _comm.all_gather_dim0(stacked, group, mode)
        if checked:  # the next gather's slot: this payload's size (the same on every rank)
            self._slot.nbytes = slot_bytes(t.numel() * t.element_size())
        full = index.reorder_gathered(stacked, seq_dim)
        if group is None and full.untyped_storage().data_ptr() == t.untyped_storage().data_ptr():
            full = full.clone(memory_format=torch.contiguous_format)  # cp=1: never a view of t
        return facts.from_stream(full, seq_dim, fill, self.layout) if trim else full

    def _gather_checked(
        self, t: object, group: Any, seq_dim: int, trim: bool, fill: object, grad: str
    ) -> torch.Tensor | None:
        """The call's descriptor in one all-gather with the payload when it fits the agreed
        slot; raises the same ``ValueError`` on every rank when the descriptors differ.

        Returns:
            The gathered ``[C, *t.shape]`` payload, or ``None`` (the caller gathers it).
        """
        desc = verb_descriptor(t, seq_dim=seq_dim, trim=trim, fill=fill, grad=grad)
        mode = "replicated" if grad == "replicated" else "sum"
        if isinstance(t, torch.Tensor) and t.device.type != "meta":
            device = t.device
        else:  # the header alone, on the mesh's device (NCCL needs CUDA)
            device = torch.device("cpu" if self.cp_mesh is None else self.cp_mesh.device_type)
        stacked, rows = gather_with_header(t, desc, group, self._slot.nbytes, mode, device)
        message = verb_mismatch_message("gather_token_tensor", rows)
        if message is not None:
            raise ValueError(message)
        return stacked

    def _check_tag(self, t: torch.Tensor, verb: str) -> None:
        tag = batch_tag(t)
        if tag is not None and not same_shard(tag, self._batch_tag):
            raise ValueError(
                f"{verb} got a local tensor of another batch than this sharder's (a sharder "
                "answers for the batch it was returned with, or, the one that shards, for its "
                "latest); use the sharder returned together with that batch by "
                "prepare_cp_forward / make_cp_batch_and_ctx"
            )
