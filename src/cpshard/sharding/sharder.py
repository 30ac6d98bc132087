"""``CPSharder``: the CP contract object, its captured facts and the caller-coordinate token verbs.

A sharder is a closed set of verbs with open implementations: ``shard_batch`` and
``local_token_global_indices`` are plain callables that a layout (or a model that owns its CP)
fills in. The dispatcher binds the CP mesh, calls ``shard_batch`` once per batch, and installs the
facts that shard learned (lengths, row shape, token repositioning, the rank map, attention
metadata) on the sharder. The token verbs then move any per-token tensor between the caller's
coordinates and the local shard, exactly as the batch was moved.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch.distributed.device_mesh import DeviceMesh

from cpshard import _comm
from cpshard.guards.consistency import check_verb_consistency
from cpshard.layouts.index import consecutive_runs, inverse_permutation
from cpshard.sharding.meta import TokenMeta

__all__ = ["CPContext", "CPSharder", "ShardBatchFn", "ShardFacts"]

ContextFactory = Callable[[], AbstractContextManager[Any]]
IndicesFn = Callable[[DeviceMesh | None, int, torch.device], torch.Tensor]
RankMapFn = Callable[[int, int, torch.device], torch.Tensor]
Runs = list[tuple[int, int]]

# Above this many contiguous runs a shard/gather indexes element-wise instead of copying slices.
_MAX_RUNS = 256


@dataclass(frozen=True)
class _Plan:
    """Index plan of one padded length: what shard and gather copy, and from where."""

    local: torch.Tensor  # [L] global position of each local token
    local_runs: Runs | None  # runs of `local` (value, length), None if too fragmented
    inverse: torch.Tensor  # [P] stream slot holding each global position
    gather_runs: Runs | None  # runs of `inverse` split at rank boundaries


def _take(t: torch.Tensor, dim: int, idx: torch.Tensor, runs: Runs | None) -> torch.Tensor:
    """``t.index_select(dim, idx)`` as a copy of a few slices when ``idx`` is a few runs."""
    if runs is None:
        return t.index_select(dim, idx)
    if len(runs) == 1:  # a copy even when the run is the whole tensor: never a view of `t`
        return t.narrow(dim, runs[0][0], runs[0][1]).clone(memory_format=torch.contiguous_format)
    return torch.cat([t.narrow(dim, v, n) for v, n in runs], dim=dim)


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
class ShardFacts:
    """What one ``shard_batch`` learned about the layout it applied.

    Attributes:
        original_seq_len: Caller's sequence length before CP padding (``None`` when there is no
            single one, e.g. a packed stream addressed by row shape).
        padded_seq_len: Length of the padded global stream that was sharded.
        input_row_shape: ``(B, S)`` of the caller's rows when the layout flattened them into one
            stream by a pure reshape.
        input_token_stream_positions: LongTensor ``[B, S]``: padded-stream position of each
            caller token for layouts that reposition tokens; ``-1`` = dropped pad slot.
        rank_map: LongTensor ``[C, L]``: global positions of every rank's local tokens.
        token_meta: Positions and document ids of every token for CP attention.
    """

    original_seq_len: int | None
    padded_seq_len: int | None
    input_row_shape: tuple[int, ...] | None = None
    input_token_stream_positions: torch.Tensor | None = None
    rank_map: torch.Tensor | None = None
    token_meta: TokenMeta | None = None


class CPContext:
    """A context-manager factory that also carries the facts of the shard that made it.

    Calling it returns a fresh context manager each time, so the same ``ctx`` can wrap several
    forward passes (e.g. policy and reference model on one batch). It is also a context manager
    itself: ``with ctx:`` is ``with ctx():`` (the spelling of torchtitan and Accelerate).
    """

    def __init__(self, factory: ContextFactory, facts: ShardFacts) -> None:
        self._factory = factory
        self.facts = facts
        self._entered: list[AbstractContextManager[Any]] = []

    def __call__(self) -> AbstractContextManager[Any]:
        return self._factory()

    def __enter__(self) -> Any:
        cm = self._factory()
        out = cm.__enter__()
        self._entered.append(cm)
        return out

    def __exit__(self, *exc: Any) -> Any:
        return self._entered.pop().__exit__(*exc)


_TAG = "_cpshard_batch"


def tag_tensor(t: torch.Tensor, tag: object) -> None:
    """Mark a local batch tensor as belonging to the shard identified by ``tag``."""
    setattr(t, _TAG, tag)


def batch_tag(t: object) -> object:
    """The shard identity a local batch tensor carries, or ``None``."""
    return getattr(t, _TAG, None) if isinstance(t, torch.Tensor) else None


def same_shard(tag: object, meta: object) -> bool:
    """Whether a tensor's shard identity ``tag`` is compatible with ``meta``.

    The same object, or two token metas with equal content (two ``prepare_cp_forward`` calls on
    the same batch, e.g. for a policy and a reference model). Tags that are not token metas
    (custom sharders) are only compared by identity when ``meta`` is not a token meta either.
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


@dataclass
class CPSharder:
    """The CP contract: shard a batch, and shard/gather any per-token tensor like it.

    Attributes:
        shard_batch: ``(cp_mesh, tp_mesh, batch, *, loss_mask, padding_token_id) ->
            (ctx_factory, batch)``; pads and shards the batch.
        local_token_global_indices: ``(cp_mesh, padded_seq_len, device) -> LongTensor [P/C]``:
            global position of each local token, local order; ``None`` for data-dependent layouts,
            whose map is captured by ``shard_batch``.
        layout: Diagnostic label only (``"none"``, ``"round_robin"``, ...); no code branches on it.
        rank_map_fn: Optional ``(world_size, padded_seq_len, device) -> LongTensor [C, P/C]`` for
            closed-form layouts, so gathers need no extra collective to learn other ranks' maps.
        cp_mesh: The 1-D CP mesh, bound by the dispatcher (``None`` without CP).
        tp_mesh: Optional TP mesh handed to ``shard_batch``.
        original_seq_len, padded_seq_len, input_row_shape, input_token_stream_positions,
        rank_map, token_meta: Facts captured by the last shard (see :class:`ShardFacts`).
        check_consistency: ``gather_token_tensor`` first compares dtype and shape across the CP
            ranks (one all-gather of a few int64 values) so a mismatch raises on every rank
            instead of reinterpreting bits or crashing gloo; set by the dispatcher.
    """

    shard_batch: ShardBatchFn
    local_token_global_indices: IndicesFn | None
    layout: str = "custom"
    rank_map_fn: RankMapFn | None = None
    cp_mesh: DeviceMesh | None = None
    tp_mesh: DeviceMesh | None = None
    original_seq_len: int | None = None
    padded_seq_len: int | None = None
    input_row_shape: tuple[int, ...] | None = None
    input_token_stream_positions: torch.Tensor | None = None
    rank_map: torch.Tensor | None = None
    token_meta: TokenMeta | None = None
    check_consistency: bool = True
    _batch_tag: object = field(default=None, init=False, repr=False, compare=False)
    _plans: dict[tuple[int, str], _Plan] = field(
        default_factory=dict, init=False, repr=False, compare=False
    )

    # ------------------------------------------------------------------ sharding a batch
    def shard(
        self,
        batch: dict[str, Any],
        *,
        loss_mask: torch.Tensor | None = None,
        padding_token_id: int = 0,
    ) -> tuple[ContextFactory, dict[str, Any]]:
        """Run ``shard_batch`` on the bound mesh and install the facts it learned.

        Args:
            batch: The caller's batch; never mutated.
            loss_mask: Optional ``[B, S]`` loss mask, sharded like the tokens.
            padding_token_id: Pad id for ``input_ids``.

        Returns:
            ``(ctx_factory, sharded_batch)``.
        """
        ctx, out = self.shard_batch(
            self.cp_mesh,
            self.tp_mesh,
            batch,
            loss_mask=loss_mask,
            padding_token_id=padding_token_id,
        )
        facts = getattr(ctx, "facts", None)
        if isinstance(facts, ShardFacts):
            self.install(facts)
        if not isinstance(ctx, CPContext):  # a custom shard_batch: `with ctx:` works too
            ctx = CPContext(ctx, facts if isinstance(facts, ShardFacts) else ShardFacts(None, None))
        # A fresh identity per shard: the local tensors carry it, so CP attention, the prepared
        # model and the verbs can tell this batch from an older or newer one.
        self._batch_tag = self.token_meta if self.token_meta is not None else object()
        for key, value in out.items():
            if isinstance(value, torch.Tensor) and value is not batch.get(key):
                tag_tensor(value, self._batch_tag)
        return ctx, out

    def install(self, facts: ShardFacts) -> None:
        """Record the facts of a shard (the single installation point)."""
        self.original_seq_len = facts.original_seq_len
        self.padded_seq_len = facts.padded_seq_len
        self.input_row_shape = facts.input_row_shape
        self.input_token_stream_positions = facts.input_token_stream_positions
        self.rank_map = facts.rank_map
        self.token_meta = facts.token_meta
        self._plans.clear()

    # ------------------------------------------------------------------ index maps
    @property
    def cp_size(self) -> int:
        """Number of CP ranks (1 without a mesh)."""
        return _comm.cp_rank_and_size(self.cp_mesh)[1]

    def _local_indices(self, padded_seq_len: int, device: torch.device) -> torch.Tensor:
        rank, world = _comm.cp_rank_and_size(self.cp_mesh)
        if self.rank_map is not None:
            expected = self.rank_map.numel()
            if padded_seq_len != expected:
                raise ValueError(
                    f"the captured CP map covers a padded stream of {expected} tokens "
                    f"({world} ranks x {self.rank_map.shape[1]}), got padded_seq_len="
                    f"{padded_seq_len}; the tensor does not match the batch this sharder last "
                    "sharded"
                )
            return self.rank_map[rank].to(device=device, dtype=torch.long)
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
        group = _comm.cp_group(self.cp_mesh)
        if group is None:
            return local
        # A custom sharder with no closed-form rank map: learn the others' maps (small ints).
        return _comm.all_gather_long(local, group)

    def _plan(self, padded_seq_len: int, device: torch.device) -> _Plan:
        key = (padded_seq_len, str(device))
        plan = self._plans.get(key)
        if plan is None:
            local = self._local_indices(padded_seq_len, device)
            inverse = inverse_permutation(self._stream_order(local, padded_seq_len))
            local_runs = consecutive_runs(local)
            gather_runs = consecutive_runs(inverse, split_every=max(local.numel(), 1))
            plan = _Plan(
                local,
                local_runs if len(local_runs) <= _MAX_RUNS else None,
                inverse,
                gather_runs if len(gather_runs) <= _MAX_RUNS else None,
            )
            self._plans[key] = plan
        return plan

    # ------------------------------------------------------------------ token verbs
    def _to_padded_stream(
        self, t: torch.Tensor, seq_dim: int, fill: float | int | bool | None
    ) -> tuple[torch.Tensor, int]:
        """Map a caller-coordinate tensor onto the padded global stream (no collective)."""
        positions = self.input_token_stream_positions
        if positions is not None and tuple(t.shape[:2]) == tuple(positions.shape):
            if fill is None:
                raise ValueError(
                    "sharding a tensor in input coordinates "
                    f"{tuple(positions.shape)} on a layout that repositions tokens "
                    f"(layout={self.layout!r}) requires `fill` for the padded slots; pass e.g. "
                    "fill=0"
                )
            assert self.padded_seq_len is not None
            valid = positions >= 0
            out = t.new_full((self.padded_seq_len, *t.shape[2:]), fill)
            out = out.index_put((positions[valid],), t[valid])
            return out.unsqueeze(0), 1
        row = self.input_row_shape
        if row is not None and tuple(t.shape[: len(row)]) == tuple(row):
            n = 1
            for d in row:
                n *= d
            t = t.reshape(1, n, *t.shape[len(row) :])
            seq_dim = 1
        length = t.shape[seq_dim]
        padded = self.padded_seq_len
        if padded is None or length == padded:
            return t, seq_dim
        if length == self.original_seq_len and fill is not None:
            pad_shape = list(t.shape)
            pad_shape[seq_dim] = padded - length
            return torch.cat([t, t.new_full(pad_shape, fill)], dim=seq_dim), seq_dim
        accepted = [f"padded_seq_len={padded}"]
        if self.original_seq_len is not None and self.original_seq_len != padded:
            accepted.append(f"original_seq_len={self.original_seq_len} (with `fill`)")
        if row is not None:
            accepted.append(f"leading row shape {tuple(row)}")
        if positions is not None:
            accepted.append(f"input positions shape {tuple(positions.shape)} (with `fill`)")
        hint = (
            " An original-length tensor needs an explicit `fill` for the padded slots."
            if length == self.original_seq_len
            else ""
        )
        raise ValueError(
            f"this sharder last sharded a batch with {', '.join(accepted)}; got a tensor of "
            f"shape {tuple(t.shape)} whose length on dim {seq_dim} is {length}.{hint} Pass a "
            "tensor in one of those coordinates, or pre-pad it yourself."
        )

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
                positions ``[B, S]`` of a repositioning layout (needs ``fill``).
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
        stream, dim = self._to_padded_stream(t, seq_dim, fill)
        plan = self._plan(stream.shape[dim], stream.device)
        return _take(stream, dim, plan.local, plan.local_runs)

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

        One all-gather of exactly the payload (after a 16-value check, see below); the reorder is a
        precomputed inverse permutation.

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

        Before the data all-gather, the ranks compare dtype, shape, ``seq_dim``, ``trim`` and
        ``grad`` in one all-gather of a few int64 values (unless ``check_consistency`` is off),
        so a mismatch raises the same ``ValueError`` on every rank.

        Raises:
            TypeError: ``t`` is not a tensor.
            ValueError: the ranks passed different dtypes / shapes / arguments, unknown ``grad``
                mode, ``seq_dim`` out of range, a meta-device tensor, a local tensor of another
                batch, or a gathered length that does not match the last shard.
        """
        group = _comm.cp_group(self.cp_mesh)
        if group is not None and self.check_consistency:
            assert self.cp_mesh is not None
            check_verb_consistency(
                self.cp_mesh, group, "gather_token_tensor", t,
                seq_dim=seq_dim, trim=trim, fill=fill, grad=grad,
            )  # fmt: skip
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
        if self.padded_seq_len is not None and padded != self.padded_seq_len:
            raise ValueError(
                f"a local tensor of length {t.shape[seq_dim]} on dim {seq_dim} gathers to "
                f"{padded} tokens over {world} ranks, but this sharder last sharded "
                f"padded_seq_len={self.padded_seq_len} (local length "
                f"{self.padded_seq_len // world}); pass the local shard of that batch"
            )
        if trim and fill is None and self.input_token_stream_positions is not None:
            raise ValueError(
                "trimming to input coordinates on a layout that repositions tokens "
                f"(layout={self.layout!r}) requires `fill` for dropped slots; pass e.g. fill=0"
            )
        if (
            trim
            and self.input_token_stream_positions is not None
            and (seq_dim != 1 or t.shape[0] != 1)
        ):
            raise ValueError(
                "trimming to input coordinates needs a local [1, L, ...] stream shard "
                f"(seq_dim=1), got shape {tuple(t.shape)} with seq_dim={seq_dim}; gather the "
                "tensor the way the batch was sharded, or use trim=False"
            )
        plan = self._plan(padded, t.device)
        # [C, *t.shape]: one all-gather of exactly the payload, no transpose of the local shard
        stacked = t.unsqueeze(0)
        if group is not None:
            mode: _comm.GradMode = "sum" if grad == "sum" else "replicated"
            stacked = _comm.all_gather_dim0(stacked, group, mode)
        n = t.shape[seq_dim]
        if plan.gather_runs is not None:
            parts = [stacked[s // n].narrow(seq_dim, s % n, k) for s, k in plan.gather_runs]
            full = parts[0] if len(parts) == 1 else torch.cat(parts, dim=seq_dim)
        else:
            full = stacked.movedim(0, seq_dim).flatten(seq_dim, seq_dim + 1)
            full = full.index_select(seq_dim, plan.inverse)
        if group is None and full.untyped_storage().data_ptr() == t.untyped_storage().data_ptr():
            full = full.clone(memory_format=torch.contiguous_format)  # cp=1: never a view of t
        return self._trim(full, seq_dim, fill) if trim else full

    def _check_tag(self, t: torch.Tensor, verb: str) -> None:
        tag = batch_tag(t)
        if tag is not None and not same_shard(tag, self._batch_tag):
            raise ValueError(
                f"{verb} got a local tensor of another batch than the one this sharder last "
                "sharded (a sharder's facts belong to its latest batch); use the sharder "
                "returned together with that batch by prepare_cp_forward / make_cp_batch_and_ctx"
            )

    def _trim(
        self, full: torch.Tensor, seq_dim: int, fill: float | int | bool | None
    ) -> torch.Tensor:
        positions = self.input_token_stream_positions
        if positions is not None:
            assert fill is not None
            stream = full.select(0, 0)  # [1, P, ...] checked before the all-gather
            pos = positions.to(full.device)
            picked = stream.index_select(0, pos.clamp(min=0).reshape(-1))
            picked = picked.reshape(*pos.shape, *stream.shape[1:])
            dropped = (pos < 0).reshape(*pos.shape, *([1] * (stream.dim() - 1)))
            return picked.masked_fill(dropped, fill)
        if self.input_row_shape is not None:
            row = self.input_row_shape
            n = 1
            for d in row:
                n *= d
            return full.narrow(seq_dim, 0, n).reshape(*row, *full.shape[seq_dim + 1 :])
        if self.original_seq_len is not None:
            return full.narrow(seq_dim, 0, self.original_seq_len)
        raise ValueError(
            f"this sharder (layout={self.layout!r}) captured no caller coordinates to trim to; "
            "gather with trim=False, or shard a batch first"
        )
