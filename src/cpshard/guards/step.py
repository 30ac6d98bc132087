"""The step's life on every CP rank: prepared -> forward -> backward -> synced.

The CP ranks of a group must issue the same collectives in the same order. A rank that leaves a
step early (it caught an exception in the forward, skipped or broke off the backward, skipped
:func:`cpshard.sync_grads`) and goes on would pair its next collective with a different one of
its peers: gloo aborts on a size mismatch, and otherwise everyone waits for the process-group
timeout with messages that do not name the cause. This module keeps, per rank and per CP group, a
:class:`StepState` and makes every phase of a step start with the same small **step header**.
The record lives on the root mesh (the one ``init_device_mesh`` / ``DeviceMesh.from_group``
built), keyed by the group's name and ranks: ``mesh["cp"]``, a new object on every call, always
finds the same record; a new root mesh over the same group (``DeviceMesh.from_group``) starts a
fresh one (the way on after every rank raised mid-step). The header:

* one all-gather of :data:`HEADER_SIZE` + :data:`PAYLOAD_SIZE` int64 values at the start of
  :func:`prepare_cp_forward` / :func:`make_cp_batch_and_ctx` (always, also with
  ``check_consistency=False``; the batch fingerprint of :mod:`cpshard.sharding.consistency` rides
  in its payload slots), of the first CP attention call of a forward, of the first CP attention
  call of each backward pass, and of
  :func:`cpshard.sync_grads`. It says which phase this rank is entering (and a few facts the
  ranks must agree on). Since every phase starts with a header of the same size, a rank that
  skipped a phase meets its peers' header, not a data collective: every rank then raises the same
  ``RuntimeError`` naming what each rank was doing (e.g. "rank 1 started a new step; rank 0 runs
  the backward of the step before"), and the ranks are in step again;
* a rank that left a phase **in the middle** (after the phase's first collective: an exception
  raised inside the model's forward after its first CP attention call, or a backward that raised
  after its first CP attention backward) cannot tell whether its peers failed at the same point
  or wait in the next collective. It enters no collective again on that mesh: its next cpshard
  call raises locally, naming what it skipped. Its peers fail when it exits (the recommended way:
  re-raise), or at the process-group timeout if it stays alive;
* an exception that leaves ``ctx()`` *outside* the model's forward (after it completed), or before
  the forward's first CP collective, leaves this rank at a phase boundary: it is reported through
  the next header, not locally.

What the headers also carry (compared across the ranks, so a mismatch raises on every rank before
any data collective): the ``check_consistency`` flag of a prepare; at a prepare, the names,
shapes, dtypes and trainable pattern of the model's parameters and persistent buffers (a model
built or frozen differently on some ranks); at a sync, the names, shapes and dtypes of the
trainable parameters; at the first CP attention call of a forward, its dtypes (autocast's under
autocast), head counts, head dims, lengths and batch size.

**Weights that differ across the CP ranks** (a prepare with ``check_consistency``, the default):
the prepare's header also carries a hash of a strided sample of each parameter's and persistent
buffer's local values (:func:`model_fingerprint`; no extra collective). Plain tensors must agree
on every CP rank; DTensor shards only on the CP ranks that hold the same shard (another slot says
which: FSDP2 over ``mesh["dp"]`` gives the CP ranks of a dp row the same shard and is compared;
FSDP2 over the flattened dp x cp ranks gives each CP rank its own and is not). Where they
differ, one more all-gather (on that error path only) names the first parameter or buffer that
differs, and every rank raises :class:`ParameterMismatchError` with the likely causes: a
forgotten :func:`cpshard.sync_grads` (each rank reports whether this model ran a CP backward that
no sync summed; those ranks are named), a model built or seeded per rank (``manual_seed(rank)``:
the first prepare catches it), a gradient reduction that does not cover the CP group, a buffer
the forward updates from local tokens. So a forgotten sync shows at the next prepare, while
FSDP2 over dp x cp, DDP over the CP ranks and the user's own all-reduce over the CP group pass:
their weights stay equal. Non-persistent buffers (caches) are not compared;
``check_consistency=False`` reads no values (and so checks none).

Gradient sync records (per group, local): the identity and version of the gradients the last
:func:`cpshard.sync_grads` on the group summed, and how many ``ctx()`` blocks had been entered
then. A sync whose gradients are all those very tensors, unchanged, is doubled; one whose
gradients are those tensors advanced by exactly one in-place add per backward since (no
``zero_grad`` in between) sums already summed gradients again (a sync per micro-batch): both
raise. Accumulating over micro-batches (several backward passes, one sync) is legal. When only
some are unchanged, an earlier sync of this step summed them (a module shared by two models,
each synced): they are skipped, so a shared gradient is summed exactly once (decided through the
sync's flag all-reduce: every rank skips the same ones, or every rank raises). A sync whose other
gradients all belong to parameters last summed after the group's latest ``ctx()`` (or never
summed, with no ``ctx()`` entered on the group yet) holds gradients no CP forward made (a forward
outside ``ctx()``, a model never run under CP): summing them would multiply them by the CP size,
so every rank raises :class:`NoCPBackwardError` (each rank's verdict rides in the sync's
header). The test is per group: a model run outside ``ctx()`` in a step where another model ran
inside one is not caught. A sync on another mesh than the one the model was prepared on (the dp
mesh) raises. Undetectable: averaging instead of summing (a scale-invariant optimizer such as
AdamW hides it from the loss); ``cpshard parity --grad-sync mean`` shows it in the gradients.
Gradients zeroed through ``.data`` (no version bump) read as not zeroed: use ``zero_grad()``.

Not tracked: forwards traced by ``torch.compile`` (no header, no backward record; their
``ctx()`` still counts for the sync), model-owned contexts (a ``shard_batch`` that returns its
own context factory: the forward is tracked as a whole, its attention calls are not), and cp=1
(no collective to mismatch). One backward pass over the forwards of several prepares (two
models' losses summed) exchanges one header.

:mod:`cpshard.dispatch` and :mod:`cpshard.loss` call it; :mod:`cpshard.attention.context` gets a
:class:`ForwardTracker` handed in.

Import rules: the rows of ``RULES`` in tests/unit/test_architecture.py that cover this module.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import weakref
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from cpshard import _comm, _compat
from cpshard.module_tree import ModuleTree

__all__ = [
    "HEADER_SIZE",
    "PARAM_SAMPLE",
    "PAYLOAD_SIZE",
    "ForwardTracker",
    "ModelFingerprint",
    "NoCPBackwardError",
    "OutOfStepError",
    "ParameterMismatchError",
    "StepHeaderError",
    "StepMismatchError",
    "StepState",
    "begin_prepare",
    "begin_sync",
    "end_sync",
    "model_fingerprint",
    "prepared_mesh",
    "step_state",
    "tracked_forward",
    "watch_model",
]

HEADER_SIZE = 8
PAYLOAD_SIZE = 24
"""Slots after the header in every step header's all-gather (zeros unless a prepare sends its
batch fingerprint there): every phase's exchange has the same size, so a rank in another phase
meets a header of its own size, never a size mismatch."""
PARAM_SAMPLE = 64
_ATTR = "_cpshard_step"
_MASK = (1 << 63) - 1

# Slots of the header.
_MAGIC, _KIND, _A, _B, _C, _D, _E, _F = range(HEADER_SIZE)
_MAGIC_VALUE = 0x5C5EED
# Slots of a prepare's header that carry the model's values (compared after the exchange), and
# of a sync's header that carries whether its gradients came from no CP forward.
_PLAIN, _SHARDED, _SHARDS = _D, _E, _F
_NO_CP, _VERDICT = _B, _C
PREPARE, FORWARD, BACKWARD, SYNC, FAILED = 1, 2, 3, 4, 5
_KIND_TEXT = {
    FAILED: "raised an exception inside ctx() (its own traceback names it)",
    PREPARE: "started a new step (prepare_cp_forward / make_cp_batch_and_ctx)",
    FORWARD: "runs the forward's first CP attention call",
    BACKWARD: "runs the backward's first CP attention call",
    SYNC: "runs cpshard.sync_grads",
}
_RECOVER = (
    "Every CP rank must run every phase of a step (prepare, the forward under ctx(), the "
    "backward, sync_grads) or none; a rank that catches an exception inside a step must not go "
    "on alone: re-raise it (every rank then stops) or make every rank skip the same step"
)


class StepHeaderError(Exception):
    """Raised by a step header on every rank at once: the ranks stay in step."""


class OutOfStepError(StepHeaderError, RuntimeError):
    """The CP ranks entered different phases of their step (raised on every rank)."""


class StepMismatchError(StepHeaderError, ValueError):
    """The CP ranks entered the same phase with facts that differ (raised on every rank)."""


class ParameterMismatchError(StepHeaderError, RuntimeError):
    """The model's parameter or buffer values differ across the CP ranks where they must be
    equal (raised on every rank at a prepare)."""


class NoCPBackwardError(StepHeaderError, RuntimeError):
    """``sync_grads`` on gradients that no CP forward of the group produced (raised on every
    rank): summing them would multiply them by the CP size."""


def _str_hash(text: str) -> int:
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little") & _MASK


class StepState:
    """One rank's record of its step on one CP group (see the module docstring).

    Attributes:
        broken: Why this rank may not enter a collective on the mesh again (``None``: it may).
        epoch: Number of prepares agreed on so far (for messages).
        in_ctx: Depth of tracked ``ctx()`` blocks open now.
        model_depth: Depth of model forwards running inside the open ``ctx()``.
        forward_calls: CP attention calls of the open ``ctx()`` (the first one exchanged a
            header).
        calls_in_done_forwards: ``forward_calls`` when the model's last forward inside the open
            ``ctx()`` completed (an exception after it left no forward in the middle).
        bwd_task: ``(prepare, autograd graph task)`` of the last backward pass that reached a CP
            call.
        bwd_finished: Whether that pass ran to its end (autograd runs the callback it queued
            only when the whole pass succeeded).
        backwards_since_sync: CP backward passes since the last ``sync_grads``.
        ctx_serial: Number of outermost tracked ``ctx()`` blocks entered so far (a sync reads
            whether one was entered since the last sync that summed its parameters).
        active_watch: The watch of the prepared model whose forward runs now inside the open
            ``ctx()`` (its CP calls' backward passes count for that model).
        watches: Weak references to the watches of the models prepared on this mesh.
    """

    def __init__(self) -> None:
        self.broken: str | None = None
        self.epoch = 0
        self.in_ctx = 0
        self.model_depth = 0
        self.forward_calls = 0
        self.calls_in_done_forwards = 0
        self.bwd_task: tuple[int, int] | None = None
        self.bwd_finished = True
        self.backwards_since_sync = 0
        self.ctx_serial = 0
        self.active_watch: _ModelWatch | None = None
        self.watches: list[weakref.ref[_ModelWatch]] = []
        # id(parameter) -> (the synced module or None, the parameter's gradient, the gradient's
        # version, ctx_serial) at the end of the last sync that summed it (several models on one
        # mesh: each keeps its own). No reference to the parameter, not even a weak one: a
        # parameter with one cannot be swapped (torch.utils.swap_tensors: nn.Module.to of
        # DTensor parameters, or with torch's swap flag on), and a record outlives the step
        self.synced: dict[
            int, tuple[weakref.ref[nn.Module] | None, weakref.ref[torch.Tensor], _Versions, int]
        ] = {}

    def check_usable(self, what: str) -> None:
        """Raise locally (no collective) if this rank left a step in the middle.

        Raises:
            RuntimeError: the rank is out of step with its peers.
        """
        if self.broken is None and not self.bwd_finished:
            self.broken = (
                "its last backward() stopped in the middle (an exception raised inside the "
                "backward, after its first CP attention call, was caught): the other ranks may "
                "wait in that backward's collectives"
            )
        if self.broken is not None:
            raise RuntimeError(
                f"{what} cannot run on this rank: {self.broken}. The CP ranks are now out of "
                "step, and any collective this rank entered would pair with a different one of "
                "its peers (gloo aborts or waits for the process-group timeout). Do not "
                "continue a CP loop after an exception inside a step: re-raise it (the other "
                "ranks then fail as this process exits) and restart from a checkpoint. Only if "
                "EVERY CP rank raised the same error at the same point (a deterministic error "
                "such as a refusal, caught alike on every rank) are the ranks still in step: "
                "then go on with a new mesh object over the same group, which starts a fresh "
                "record: cp_mesh = DeviceMesh.from_group(cp_mesh.get_group(), "
                "cp_mesh.device_type, mesh_dim_names=cp_mesh.mesh_dim_names)"
            )


def step_state(cp_mesh: DeviceMesh | None) -> StepState | None:
    """The step record of this rank on ``cp_mesh``'s group (``None`` without a multi-rank group).

    Kept on the root mesh (the one ``init_device_mesh`` / ``DeviceMesh.from_group`` built), keyed
    by the CP group's name and ranks: every ``mesh["cp"]`` (a new object on each call) of one
    root sees the same record; a new root mesh (``DeviceMesh.from_group``) starts a fresh one.
    """
    group = _comm.cp_group(cp_mesh)
    if group is None:
        return None
    assert cp_mesh is not None
    root = _compat.root_mesh(cp_mesh)
    records = getattr(root, _ATTR, None)
    if not isinstance(records, dict):
        records = {}
        setattr(root, _ATTR, records)
    # the group's ranks, not the mesh's tensor (made anew on every read of DeviceMesh.mesh)
    key = (_comm.group_name(group), tuple(_comm.group_ranks(group)))
    state = records.get(key)
    if not isinstance(state, StepState):
        state = records[key] = StepState()
    return state


def _exchange(
    state: StepState,
    cp_mesh: DeviceMesh,
    kind: int,
    facts: dict[int, int],
    names: dict[int, str],
    carry: dict[int, int] | None = None,
    shown: dict[int, Callable[[int], str]] | None = None,
    payload: torch.Tensor | None = None,
) -> list[list[int]]:
    """All-gather this rank's header; raise the same error on every rank if they disagree.

    Args:
        state: This rank's record.
        cp_mesh: The CP mesh (multi-rank).
        kind: The phase entered.
        facts: Slot -> value that every rank must agree on (for this ``kind``).
        names: Slot -> what the slot means, for the message.
        carry: Slot -> value sent along, not compared (each rank's own report).
        shown: Slot -> how to write its value in the message (slots not named here show only
            which ranks agree).
        payload: LongTensor ``[P]``, ``P <= PAYLOAD_SIZE`` (the same ``P`` on every rank), sent
            in the same all-gather after the header; not compared here (the batch fingerprint
            rides along).

    Returns:
        The gathered rows, one per rank: the header's :data:`HEADER_SIZE` values, then
        :data:`PAYLOAD_SIZE` payload slots (``payload`` first, zeros after).
    """
    header = torch.zeros(HEADER_SIZE + PAYLOAD_SIZE, dtype=torch.long)
    header[_MAGIC] = _MAGIC_VALUE
    header[_KIND] = kind
    for slot, value in {**(carry or {}), **facts}.items():
        header[slot] = value & _MASK
    if payload is not None:
        flat = payload.to(device="cpu", dtype=torch.long).reshape(-1)
        if flat.numel() > PAYLOAD_SIZE:  # a programming error, the same on every rank
            raise ValueError(
                f"a step header carries at most PAYLOAD_SIZE={PAYLOAD_SIZE} payload values, got "
                f"{flat.numel()}"
            )
        header[HEADER_SIZE : HEADER_SIZE + flat.numel()] = flat
    group = _comm.cp_group(cp_mesh)
    assert group is not None
    rows = _comm.all_gather_fixed(header, group).tolist()
    kinds = [row[_KIND] for row in rows]
    if len(set(kinds)) > 1 or any(row[_MAGIC] != _MAGIC_VALUE for row in rows):
        # Every rank saw the same rows: the same error everywhere, and the ranks are in step again
        # (each entered exactly this one header).
        state.bwd_finished = True
        doing = "; ".join(
            f"rank {r} {_KIND_TEXT.get(k, f'is in another collective (header kind {k})')}"
            for r, k in enumerate(kinds)
        )
        raise OutOfStepError(
            f"the CP ranks are out of step: {doing}. A rank that starts a new phase while its "
            "peers are still in the previous one skipped it (an exception caught in the forward "
            "or the backward, a skipped backward() or sync_grads). " + _RECOVER
        )
    bad = [slot for slot in sorted(facts) if len({row[slot] for row in rows}) > 1]
    if bad:
        parts = []
        for slot in bad:
            groups: dict[int, list[int]] = {}
            for r, row in enumerate(rows):
                groups.setdefault(row[slot], []).append(r)
            show = shown.get(slot) if shown else None
            ranks = " vs ".join(
                f"ranks {g}" if show is None else f"ranks {g} pass {show(v)}"
                for v, g in groups.items()
            )
            parts.append(f"{names[slot]} ({ranks})")
        raise StepMismatchError(
            f"the CP ranks disagree on entering the same phase: {'; '.join(parts)}"
        )
    return rows


# --- prepare --------------------------------------------------------------------------------
def _as_bool(value: int) -> str:
    return str(bool(value))


@dataclass(frozen=True)
class ModelFingerprint:
    """What a prepare's header says about the model's parameters and persistent buffers.

    Attributes:
        layout: Hash of the names, shapes, dtypes (and ``requires_grad``) of every parameter and
            persistent buffer.
        names: ``"parameter <name>"`` / ``"buffer <name>"`` of every entry, in that order.
        values: LongTensor ``[N]``: per entry, a hash of a strided sample of at most
            :data:`PARAM_SAMPLE` of its local values (0: not read, a meta or empty tensor).
        keys: LongTensor ``[N]``: per entry, which shard of it this rank holds (0: a plain tensor,
            the whole value; a DTensor: its placements, mesh shape and this rank's coordinates on
            the mesh dims that split it).
    """

    layout: int
    names: list[str]
    values: torch.Tensor
    keys: torch.Tensor

    def header(self) -> dict[int, int]:
        """The slots of the prepare's header: the plain entries' values, the DTensor entries'
        values and which shards they are."""
        plain = self.keys == 0
        odd = torch.arange(1, 2 * len(self.names) + 1, 2, dtype=torch.long)
        mixed = self.values * odd
        shard_keys = ";".join(str(int(k)) for k in self.keys[~plain].tolist())
        return {
            _PLAIN: int(mixed[plain].sum()) & _MASK,
            _SHARDED: int(mixed[~plain].sum()) & _MASK,
            _SHARDS: _str_hash(shard_keys) if shard_keys else 0,
        }


def _entries(
    model: nn.Module, tree: ModuleTree | None = None
) -> list[tuple[str, torch.Tensor, bool]]:
    """``(name, tensor, is a parameter)`` of every parameter (as ``named_parameters()`` lists
    them), then every persistent buffer, from one walk of the module tree.

    With ``tree``, its memo keeps where each entry sits (module and own name), not the tensors,
    and they are read from their modules on every call: the tree is kept between prepares, and a
    tensor with a (weak) reference to it cannot be swapped by ``torch.utils.swap_tensors``
    (``nn.Module.to`` of DTensor parameters, ``load_state_dict`` with swapping on).
    """
    if tree is None:
        return [(n, t, is_param) for n, t, is_param, _, _ in _walk_entries(model.named_modules())]
    modules = tree.modules()

    def where() -> list[tuple[str, bool, int, str]]:
        walk = zip(tree.names, modules, strict=True)
        return [(n, is_param, i, own) for n, _, is_param, i, own in _walk_entries(walk)]

    kept = tree.memo("parameters and buffers", (), where)
    return [
        (n, _compat.own_tensor(modules[i], own, is_param), is_param) for n, is_param, i, own in kept
    ]


def _walk_entries(
    walk: Iterable[tuple[str, nn.Module]],
) -> list[tuple[str, torch.Tensor, bool, int, str]]:
    """:func:`_entries` from a walk of the module tree (``named_modules()``), each with the index
    of its module in the walk and its name there."""
    params: list[tuple[str, torch.Tensor, bool, int, str]] = []
    buffers: list[tuple[str, torch.Tensor, bool, int, str]] = []
    seen_params: set[int] = set()
    seen_buffers: set[int] = set()
    for i, (prefix, module) in enumerate(walk):
        dot = prefix + "." if prefix else ""
        for name, p in _compat.own_parameters(module):
            if id(p) not in seen_params:
                seen_params.add(id(p))
                params.append((f"parameter {dot}{name}", p, True, i, name))
        own = _compat.own_buffers(module)
        if not own:
            continue
        transient = _compat.non_persistent_buffers(module)
        for name, buf in own:
            if name in transient or id(buf) in seen_buffers:
                continue
            seen_buffers.add(id(buf))
            buffers.append((f"buffer {dot}{name}", buf, False, i, name))
    return params + buffers


def _shard_key(t: torch.Tensor) -> int:
    """0 for a plain tensor; for a DTensor, a hash of which shard of it this rank holds."""
    if not isinstance(t, DTensor):
        return 0
    mesh = t.device_mesh
    coordinate = list(mesh.get_coordinate() or ())
    split = [
        (dim, c)
        for dim, (placement, c) in enumerate(zip(t.placements, coordinate, strict=False))
        if not placement.is_replicate()
    ]
    return _str_hash(f"{tuple(mesh.shape)}:{t.placements}:{split}") or 1


def model_fingerprint(
    model: nn.Module, *, read_values: bool, tree: ModuleTree | None = None
) -> ModelFingerprint:
    """The :class:`ModelFingerprint` of ``model``'s parameters and persistent buffers.

    Values are a strided sample of at most :data:`PARAM_SAMPLE` values of each entry's local
    tensor (the local shard of a DTensor; meta tensors count by shape only): weights built or
    seeded differently change nearly every value, and so does an optimizer step on gradients
    that differ across the ranks. One host transfer per device. Non-persistent buffers (caches
    such as rotary tables) are left out.

    Args:
        model: The prepared model.
        read_values: ``False`` (``check_consistency=False``): no value is read (all 0).
        tree: ``model``'s module tree of this prepare, whose memo keeps where the entries sit
            and, while their shapes, dtypes, trainable flags, devices and contiguity are the
            same, the fixed part (layout hash, sampling plan) between prepares of an unchanged
            tree (``None``: walk the model). The tensors and their values are read on every
            call.
    """
    entries = _entries(model, tree)
    tensors = [t for _, t, _ in entries]
    # everything the fixed part reads of the tensors (the sampling: sizes, devices, contiguity)
    facts = [
        (t.shape, t.dtype, t.requires_grad if is_param else None, t.device, t.is_contiguous())
        for _, t, is_param in entries
    ]
    if tree is None or any(isinstance(t, DTensor) for t in tensors):
        fixed = _fixed_part(entries, facts)  # a DTensor's local shard is read on every call
    else:
        fixed = tree.memo("model fingerprint", tuple(facts), lambda: _fixed_part(entries, facts))
    values = torch.zeros(len(entries), dtype=torch.long)
    if read_values and fixed.sampling:
        bits = _sampled_bits(tensors, fixed.sampling, fixed.plain)
        values.index_add_(0, fixed.index, bits * fixed.weights)
    return ModelFingerprint(fixed.layout, fixed.names, values, fixed.keys)


_Take = tuple[int, int, int]  # (entry, values sampled, stride of the sample)


@dataclass(frozen=True)
class _FixedPart:
    """What a model fingerprint reads of its entries' names, shapes, dtypes, devices and
    layouts only (kept between prepares while they are unchanged).

    Attributes:
        layout: :attr:`ModelFingerprint.layout`.
        names: :attr:`ModelFingerprint.names`.
        keys: :attr:`ModelFingerprint.keys`.
        sampling: Per device (one host transfer each), per dtype (one float64 conversion each),
            the entries sampled: ``(entry, count, step)``, the sample being values ``0, step,
            ..., (count - 1) * step`` of the entry's flattened local tensor.
        index: LongTensor ``[V]``: the entry of each sampled value (in sampling order).
        weights: LongTensor ``[V]``: ``2 * place + 1``, ``place`` the value's place inside its
            own entry's sample (an entry's hash must not depend on the entries before it: an
            empty or short DTensor shard on some ranks only).
        plain: Every entry is a contiguous, real, plain tensor (no DTensor): a sample is one
            ``as_strided`` view.
    """

    layout: int
    names: list[str]
    keys: torch.Tensor
    sampling: list[list[list[_Take]]]
    index: torch.Tensor
    weights: torch.Tensor
    plain: bool


def _fixed_part(entries: list[tuple[str, torch.Tensor, bool]], facts: list[Any]) -> _FixedPart:
    layout = ";".join(
        f"{name}:{shape}:{dtype}" + ("" if grad is None else f":{grad}")
        for (name, _, _), (shape, dtype, grad, _, _) in zip(entries, facts, strict=True)
    )
    by_kind: dict[tuple[torch.device, torch.dtype], list[_Take]] = {}
    for i, (_, t, _) in enumerate(entries):
        local = _local(t)
        n = local.numel()
        if n == 0 or local.is_meta:
            continue
        count, dtype = min(n, PARAM_SAMPLE), local.dtype
        if local.is_complex():  # sampled as its real view: two values per element
            count, dtype = 2 * count, local.real.dtype
        kind = by_kind.setdefault((local.device, dtype), [])
        kind.append((i, count, max(1, n // PARAM_SAMPLE)))
    by_device: dict[torch.device, list[list[_Take]]] = {}
    for (device, _), takes in by_kind.items():
        by_device.setdefault(device, []).append(takes)
    sampling = list(by_device.values())
    takes = [take for groups in sampling for group in groups for take in group]
    counts = torch.tensor([count for _, count, _ in takes], dtype=torch.long)
    owners = torch.tensor([i for i, _, _ in takes], dtype=torch.long)
    index = torch.repeat_interleave(owners, counts)
    starts = torch.repeat_interleave(torch.cumsum(counts, 0) - counts, counts)
    place = torch.arange(int(counts.sum())) - starts
    return _FixedPart(
        layout=_str_hash(layout),
        names=[name for name, _, _ in entries],
        keys=torch.tensor([_shard_key(t) for _, t, _ in entries], dtype=torch.long),
        sampling=sampling,
        index=index,
        weights=2 * place + 1,
        plain=all(
            not isinstance(t, DTensor) and not t.is_complex() and contiguous
            for (_, t, _), (_, _, _, _, contiguous) in zip(entries, facts, strict=True)
        ),
    )


def _local(t: torch.Tensor) -> torch.Tensor:
    """``t``'s local shard for a DTensor (no autograd record), else ``t``."""
    if not isinstance(t, DTensor):
        return t
    with torch.no_grad():
        return t.to_local()


def _sampled_bits(
    tensors: list[torch.Tensor], sampling: list[list[list[_Take]]], plain: bool
) -> torch.Tensor:
    """The sampled values of :class:`_FixedPart` ``sampling``, as float64 bit patterns
    (LongTensor ``[V]``, on the CPU): one host transfer per device. ``plain``: every tensor is a
    contiguous, real, plain tensor (one ``as_strided`` each)."""
    parts = []
    with torch.no_grad():  # views of the values, no autograd record
        for groups in sampling:
            joined = [
                torch.cat([tensors[i].as_strided((n,), (step,)) for i, n, step in group])
                if plain
                else torch.cat([_sample(_local(tensors[i]), n, step) for i, n, step in group])
                for group in groups
            ]
            parts.append(torch.cat([j.to(torch.float64) for j in joined]).cpu())
    return torch.cat(parts).view(torch.int64)


def _sample(local: torch.Tensor, count: int, step: int) -> torch.Tensor:
    """Values ``0, step, ...`` of ``local`` flattened, ``count`` of them (of a complex tensor,
    ``count / 2`` elements as their real view)."""
    is_complex = local.is_complex()
    n = count // 2 if is_complex else count
    if local.is_contiguous():  # one view op: values 0, step, ..., of the flat tensor
        sample = local.as_strided((n,), (step,))
    else:
        sample = local.reshape(-1)[: step * n : step]
    return torch.view_as_real(sample).reshape(-1) if is_complex else sample


def _values_differ(rows: list[list[int]]) -> bool:
    """Whether the gathered prepare headers show values that differ where they must agree: the
    plain entries on any two ranks, the DTensor entries on two ranks holding the same shards."""
    if len({row[_PLAIN] for row in rows}) > 1:
        return True
    sharded: dict[int, set[int]] = {}
    for row in rows:
        sharded.setdefault(row[_SHARDS], set()).add(row[_SHARDED])
    return any(len(v) > 1 for v in sharded.values())


def _first_difference(table: list[list[int]], n: int) -> tuple[int, str] | None:
    """The first entry whose values differ between ranks holding the same shard of it, and the
    ranks' groups (``table``: per rank, ``n`` value hashes then ``n`` shard keys)."""
    for i in range(n):
        by_key: dict[int, dict[int, list[int]]] = {}
        for r, row in enumerate(table):
            by_key.setdefault(row[n + i], {}).setdefault(row[i], []).append(r)
        for groups in by_key.values():
            if len(groups) > 1:
                return i, " vs ".join(f"ranks {g}" for g in groups.values())
    return None


def _raise_values_differ(
    state: StepState, cp_mesh: DeviceMesh, rows: list[list[int]], fp: ModelFingerprint
) -> None:
    """Name the first parameter or buffer that differs and the likely causes, on every rank.

    Every rank saw the same rows, so every rank comes here: one more all-gather (of the
    per-entry hashes and shard keys; the same size everywhere since the layouts agreed) names
    the first entry that differs, then every rank raises the same error.
    """
    group = _comm.cp_group(cp_mesh)
    assert group is not None
    table = _comm.all_gather_fixed(torch.cat([fp.values, fp.keys]), group).tolist()
    first = _first_difference(table, len(fp.names))
    which = (
        "the values of parameters or buffers (none told apart by the per-entry hash)"
        if first is None
        else f"{fp.names[first[0]]} ({first[1]}; the first that differs)"
    )
    stale = [r for r, row in enumerate(rows) if row[_C]]
    if stale:
        cause = (
            f"cpshard.sync_grads(model, cp_mesh) was not called: ranks {stale} ran a CP "
            "backward() of this model that no sync_grads summed, and the optimizer stepped on "
            "each rank's own partial gradient. Call cpshard.sync_grads(model, cp_mesh) after "
            "the last backward of each optimizer step (or reduce the gradients over a group "
            "that holds every CP rank: FSDP2 over the flattened dp x cp ranks, DDP). Other "
            "possible causes: "
        )
    else:
        cause = "Likely causes: "
    raise ParameterMismatchError(
        f"the model's weights differ across the CP ranks where they must be equal: {which}. "
        "Every CP rank must run the same weights (it computes its share of one forward). "
        + cause
        + "(1) the model was built or initialised differently per rank (torch.manual_seed(rank) "
        "before building it, a checkpoint loaded on some ranks only): seed and load the same "
        "way on every rank of a CP group; (2) a gradient reduction that does not cover the CP "
        "group (FSDP / DDP over the dp ranks only, a hand-written all_reduce over another "
        "group) without cpshard.sync_grads(model, cp_mesh); (3) a buffer the forward updates "
        "from each rank's own tokens (BatchNorm running statistics, routing counters). A "
        "parameter sharded across the CP ranks on purpose must be a DTensor (ranks holding "
        "different shards are not compared); check_consistency=False skips this comparison "
        f"(prepare {state.epoch} on this CP group)"
    )


def begin_prepare(
    state: StepState | None,
    cp_mesh: DeviceMesh | None,
    *,
    check_consistency: bool,
    model: nn.Module | None,
    payload: torch.Tensor | None = None,
    check_payload: Callable[[torch.Tensor], None] | None = None,
    synced_elsewhere: bool = False,
    model_tree: ModuleTree | None = None,
) -> torch.Tensor | None:
    """Start a step: raise locally if this rank left the last one midway, then agree on it.

    One header all-gather (always, whatever ``check_consistency`` says), which also carries
    ``payload`` (the batch fingerprint: one collective per prepare). The ranks must agree on
    the phase (every one of them starts a step), on ``check_consistency``, and on the model's
    parameters' and persistent buffers' names, shapes, dtypes and trainable pattern (whatever
    ``check_consistency`` says; a prepare without a model counts as none). With
    ``check_consistency`` the header also carries a hash of the model's values
    (:func:`model_fingerprint`): plain tensors must agree on every CP rank, DTensor shards on
    the ranks that hold the same shards; where they differ every rank raises, naming the first
    parameter or buffer that differs (one more all-gather, on that error path only). Each rank
    also reports whether this model ran a CP backward that no ``sync_grads`` summed since
    (``synced_elsewhere``: its DDP wrapper sums over the CP group, so it never does); the
    message names those ranks as the likely cause.

    Args:
        state: The group's record (``None`` without a multi-rank group: no collective).
        cp_mesh: The CP mesh.
        check_consistency: The prepare's flag.
        model: The prepared model (``None``: ``make_cp_batch_and_ctx``).
        payload: LongTensor ``[P]`` sent along (the batch fingerprint).
        check_payload: Called with the gathered payloads before the model's values are
            compared (the batch check: a batch that differs is named first).
        synced_elsewhere: The model's wrapper sums its gradients over the CP group (DDP).
        model_tree: ``model``'s module tree of this prepare (:func:`model_fingerprint`).

    Returns:
        Every rank's ``payload`` as a LongTensor ``[C, P]`` on the CPU (row ``r`` from rank
        ``r``), or ``None`` without a collective (no multi-rank group, or no payload).

    Raises:
        RuntimeError: this rank left its last step midway (locally, no collective), the ranks
            are out of step, or the model's values differ across the CP ranks
            (:class:`ParameterMismatchError`, on every rank).
        ValueError: the ranks disagree on ``check_consistency`` or on the model's layout.
    """
    if state is None or cp_mesh is None:
        return None
    state.check_usable("prepare_cp_forward / make_cp_batch_and_ctx")
    watch = None if model is None else _watch_of(model)
    fp = (
        None
        if model is None
        else model_fingerprint(model, read_values=bool(check_consistency), tree=model_tree)
    )
    unsynced = watch is not None and watch.backwards > 0 and not synced_elsewhere
    # the same slots are compared on every rank (whatever each rank's flag): the message is the
    # same everywhere. The layout is no data value: compared also with check_consistency=False
    # (0 without a model).
    facts = {_A: int(bool(check_consistency)), _B: 0 if fp is None else fp.layout}
    names = {
        _A: "check_consistency (pass the same value on every rank)",
        _B: "the model's parameters and buffers (names, shapes, dtypes, which are trainable: "
        "build and freeze the model the same way on every CP rank, and pass it on every rank)",
    }
    carry = {_C: int(unsynced), **({} if fp is None else fp.header())}
    rows = _exchange(
        state, cp_mesh, PREPARE, facts, names, carry=carry, shown={_A: _as_bool},
        payload=payload,
    )  # fmt: skip
    state.epoch += 1
    table = None
    if payload is not None:
        size = HEADER_SIZE + payload.numel()
        table = torch.tensor([row[HEADER_SIZE:size] for row in rows], dtype=torch.long)
        if check_payload is not None:
            check_payload(table)  # a batch that differs is named first
    if fp is not None and _values_differ(rows):
        _raise_values_differ(state, cp_mesh, rows, fp)
    return table


# --- forward --------------------------------------------------------------------------------
class _BackwardStart(torch.autograd.Function):
    """Identity on a CP attention output; its backward runs just before the call's own backward
    (and its collectives)."""

    @staticmethod
    def forward(
        ctx: Any, out: torch.Tensor, tracker: ForwardTracker, watch: _ModelWatch | None
    ) -> torch.Tensor:
        ctx.tracker, ctx.watch = tracker, watch
        return out.view_as(out)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        ctx.tracker.backward_started(ctx.watch)
        return grad, None, None


class ForwardTracker:
    """What the CP attention routing calls around each CP attention call of a tracked forward
    (it implements :class:`cpshard.attention.context.StepTracker`).

    ``enter_call`` exchanges the forward's header at its first call (dtypes, head counts, head
    dims and lengths must agree across the ranks); ``leave_call`` marks the output, so the first
    CP call of each backward pass exchanges a header and the pass's end is recorded.
    """

    def __init__(self, state: StepState, cp_mesh: DeviceMesh) -> None:
        self.state = state
        self.cp_mesh = cp_mesh
        self.serial = state.epoch  # the prepare this tracker belongs to

    def enter_call(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Before a CP attention call's first collective. Returns q, k, v unchanged."""
        state = self.state
        if state.forward_calls == 0:
            state.check_usable("a CP attention call")
            desc = (str(q.dtype), str(k.dtype), str(v.dtype), q.shape[1], k.shape[1],
                    q.shape[-1], v.shape[-1], q.shape[-2], k.shape[-2], q.shape[0])  # fmt: skip
            _exchange(
                state, self.cp_mesh, FORWARD, {_A: _str_hash(repr(desc))},
                {_A: "the first CP attention call's dtypes, head counts, head dims, lengths or "
                 "batch size (run the same model in the same dtype, under the same autocast, on "
                 "every CP rank)"},
            )  # fmt: skip
        state.forward_calls += 1
        return q, k, v

    def leave_call(self, out: torch.Tensor) -> torch.Tensor:
        """After a CP attention call: the output, marked so its backward is seen."""
        if out.requires_grad and torch.is_grad_enabled():
            watch = self.state.active_watch
            marked: torch.Tensor = _BackwardStart.apply(out, self, watch)  # type: ignore[no-untyped-call]
            return marked
        return out

    def backward_started(self, watch: _ModelWatch | None = None) -> None:
        """A CP attention call's backward is about to run its collectives.

        Args:
            watch: The watch of the prepared model whose forward made the call (``None``: not
                known); each backward pass counts once for it.
        """
        state = self.state
        # autograd's graph task id alone can repeat across backward passes (seen under DDP and
        # the HF Trainer); with the prepare it belongs to, a new pass is told apart
        task = (self.serial, _compat.current_graph_task_id())
        if watch is not None and watch.bwd_task != task:
            watch.bwd_task = task
            watch.backwards += 1
        last = state.bwd_task
        # a pass still running with this graph task id: its header ran (one pass may span the
        # forwards of several prepares, e.g. two models' losses summed)
        if last == task or (last is not None and not state.bwd_finished and last[1] == task[1]):
            return
        # The first CP call of a new backward pass.
        state.check_usable("backward()")
        _exchange(state, self.cp_mesh, BACKWARD, {}, {})
        state.bwd_task, state.bwd_finished = task, False
        state.backwards_since_sync += 1
        # Autograd runs a queued callback only when the whole pass succeeded.
        _compat.queue_backward_callback(functools.partial(_finished, state, task))


def _finished(state: StepState, task: tuple[int, int]) -> None:
    if state.bwd_task == task:
        state.bwd_finished = True


@contextlib.contextmanager
def tracked_forward(
    state: StepState | None, cp_mesh: DeviceMesh | None, inner: Callable[[], Any]
) -> Iterator[None]:
    """``inner()`` (the CP context), recording how this rank leaves it.

    An exception leaving the block while the model's forward runs, after the forward's first CP
    attention call, makes this rank's next cpshard call raise locally (see the module docstring).
    """
    if state is None or cp_mesh is None:
        with inner():
            yield
        return
    state.check_usable("ctx()")
    state.in_ctx += 1
    outer = state.in_ctx == 1
    if outer:
        state.ctx_serial += 1
        state.forward_calls = state.calls_in_done_forwards = state.model_depth = 0
    try:
        with inner():
            yield
    except BaseException as e:
        if outer:
            _left_ctx(state, cp_mesh, e)
        raise
    finally:
        state.in_ctx -= 1
        if outer:
            state.model_depth = 0
            state.active_watch = None


def _left_ctx(state: StepState, cp_mesh: DeviceMesh, e: BaseException) -> None:
    """Record how an exception left the outermost tracked ``ctx()``.

    In the middle of the model's forward (a CP call of this ``ctx()`` ran in a forward that did
    not complete): this rank may enter no collective again. At a phase boundary (before the
    forward's first CP call, or after the forward completed): one ``FAILED`` header tells the
    peers at once, so they raise naming this rank instead of waiting for it; when every rank
    raised at the same point, they all send it and stay in step. This rank then re-raises its own
    exception (an out-of-step error of the header is dropped: it names this rank's failure).
    """
    if state.forward_calls > state.calls_in_done_forwards:
        state.broken = (
            f"an exception ({type(e).__name__}: {str(e)[:200]}) left ctx() in the middle of "
            f"the model's forward, after {state.forward_calls} CP attention call(s); the other "
            "ranks may wait in that forward's next collective"
        )
        return
    if not isinstance(e, Exception) or isinstance(e, StepHeaderError) or state.broken:
        return  # KeyboardInterrupt and the like leave at once; a header's error is everyone's
    with contextlib.suppress(RuntimeError, ValueError):
        _exchange(state, cp_mesh, FAILED, {}, {})


class _ModelWatch:
    """Forward pre/post hooks: whether the model's forward is running inside a tracked ctx()."""

    def __init__(self, model: nn.Module) -> None:
        self.state: StepState | None = None
        self.mesh: DeviceMesh | None = None
        self.model = weakref.ref(model)
        self.backwards = 0  # this model's CP backward passes since a sync summed its gradients
        self.bwd_task: tuple[int, int] | None = None

    def pre(self, module: nn.Module, args: Any, kwargs: Any) -> None:
        if self.state is not None and self.state.in_ctx and not kwargs.get("_pre_embed_only"):
            self.state.model_depth += 1
            if self.state.model_depth == 1:
                self.state.active_watch = self

    def post(self, module: nn.Module, args: Any, kwargs: Any, output: Any) -> None:
        state = self.state
        if state is not None and state.model_depth > 0:
            state.model_depth -= 1
            if state.model_depth == 0:
                state.calls_in_done_forwards = state.forward_calls
                state.active_watch = None


def _watch_of(model: nn.Module) -> _ModelWatch | None:
    for hook in _compat.forward_pre_hooks(model):
        watch = getattr(hook, "__self__", None)
        if isinstance(watch, _ModelWatch):
            return watch
    return None


def watch_model(model: nn.Module, state: StepState | None, cp_mesh: DeviceMesh | None) -> None:
    """Register the forward hooks of :func:`tracked_forward` on ``model`` once; point them at
    ``state``, the record of ``cp_mesh``, the mesh it is prepared on now."""
    watch = _watch_of(model)
    if watch is None:
        watch = _ModelWatch(model)
        model.register_forward_pre_hook(watch.pre, with_kwargs=True)
        model.register_forward_hook(watch.post, with_kwargs=True)
    watch.state, watch.mesh = state, cp_mesh
    if state is not None:
        state.watches = [w for w in state.watches if w() is not None and w() is not watch]
        state.watches.append(weakref.ref(watch))


def prepared_mesh(module: nn.Module) -> DeviceMesh | None:
    """The multi-rank CP mesh ``module`` (or the model a wrapper such as DDP holds) was last
    prepared on; ``None``: not prepared, or last prepared without CP."""
    for sub in module.modules():
        watch = _watch_of(sub)
        if watch is not None:
            return watch.mesh if _comm.cp_group(watch.mesh) is not None else None
    return None


# --- sync -----------------------------------------------------------------------------------
def begin_sync(
    state: StepState | None,
    cp_mesh: DeviceMesh | None,
    params: Iterable[tuple[str, torch.nn.Parameter]],
    *,
    prepared_on: DeviceMesh | None = None,
) -> list[bool]:
    """Judge a ``sync_grads`` call locally, then agree on it (one header all-gather, which
    carries every rank's verdict).

    Args:
        state: The record of ``cp_mesh`` (``None`` without a multi-rank group).
        cp_mesh: The mesh given to ``sync_grads``.
        params: ``(name, parameter)`` of the trainable parameters it sums.
        prepared_on: The multi-rank CP mesh the model was last prepared on, if known.

    Returns:
        Per parameter, whether its gradient on this rank is the very tensor, unchanged, that an
        earlier sync on this group summed (a module shared by two models synced one after the
        other): ``sync_grads`` skips it where every rank says so, and raises on every rank
        where only some do. All ``False`` without a multi-rank group.

    Raises:
        ValueError: the mesh is not the one the model was prepared on (every rank that passes
            it), or the ranks' trainable parameters differ (names, shapes, dtypes).
        RuntimeError: this rank left its step midway (locally), a doubled or per-micro-batch
            sync on any rank, gradients that no CP forward of the group made
            (:class:`NoCPBackwardError`), each raised on every rank (every rank's verdict rides
            in the header), or the ranks are out of step.
    """
    if prepared_on is not None and (
        cp_mesh is None or prepared_on.mesh.tolist() != cp_mesh.mesh.tolist()
    ):
        given = "None" if cp_mesh is None else f"the mesh of ranks {cp_mesh.mesh.tolist()}"
        dims = "" if cp_mesh is None else f" (dims {cp_mesh.mesh_dim_names})"
        raise ValueError(
            f"sync_grads got {given}{dims}, but the model was prepared for CP on the mesh of "
            f"ranks {prepared_on.mesh.tolist()} (dims {prepared_on.mesh_dim_names}): summing "
            "over other ranks than the CP group is silently wrong. Pass the CP mesh given to "
            "prepare_cp_forward (e.g. mesh['cp']), not the data-parallel one"
        )
    params = list(params)
    if state is None or cp_mesh is None:
        return [False] * len(params)
    state.check_usable("sync_grads")
    verdict, done = _since_last_sync(state, [p for _, p in params])
    fresh = [p for (_, p), d in zip(params, done, strict=True) if p.grad is not None and not d]
    no_cp = bool(fresh) and not any(state.ctx_serial > _synced_at(state, p) for p in fresh)
    layout = ";".join(f"{n}:{tuple(p.shape)}:{p.dtype}" for n, p in params)
    rows = _exchange(
        state, cp_mesh, SYNC, {_A: _str_hash(layout)},
        {_A: "the trainable parameters (names, shapes, dtypes): freeze and build the model the "
         "same way on every CP rank"},
        carry={_NO_CP: int(no_cp), _VERDICT: _VERDICTS.index(verdict)},
    )  # fmt: skip
    # each rank's verdict rides in the header: a rank-local cause (an in-place op on one rank's
    # gradients) makes every rank raise, instead of one raising while its peers wait in the header
    doubled = [r for r, row in enumerate(rows) if _VERDICTS[row[_VERDICT]] == "untouched"]
    if doubled:
        raise RuntimeError(
            "sync_grads was called again with no backward() since the last sync_grads (the "
            "gradients are the very tensors it summed, unchanged): it would sum the already "
            "summed gradients again (multiplied by the CP size). Call it once per optimizer "
            f"step, after the last backward (ranks {doubled})"
        )
    again = [r for r, row in enumerate(rows) if _VERDICTS[row[_VERDICT]] == "accumulated"]
    if again:
        raise RuntimeError(
            "sync_grads is summing gradients that still hold the gradients the last sync_grads "
            "already summed (a backward() accumulated into them, with no zero_grad in between): "
            "called after every micro-batch, it multiplies the earlier micro-batches' gradients "
            "by the CP size again. Accumulate over the micro-batches and call sync_grads once, "
            "after the last backward and before optimizer.step(); zero the gradients after each "
            f"step with optimizer.zero_grad() / model.zero_grad() (ranks {again})"
        )
    without = [r for r, row in enumerate(rows) if row[_NO_CP]]
    if without:
        raise NoCPBackwardError(
            f"sync_grads would sum gradients that no CP forward produced (ranks {without}): no "
            "ctx() of a prepare on this CP group was entered since these parameters' gradients "
            "were last summed (or ever), so they come from a forward outside ctx() or from a "
            "model never run under CP. Such a gradient is already the full gradient of the "
            "rank's batch: summed over the CP ranks it would be multiplied by the CP size. Run "
            "the forward under the ctx() of cpshard.prepare_cp_forward(model, cp_mesh, batch) "
            "(or make_cp_batch_and_ctx) on the same CP mesh (mesh['cp'] of the same mesh; a mesh "
            "rebuilt with DeviceMesh.from_group keeps a record of its own), or drop sync_grads "
            "for gradients computed without CP"
        )
    return done


_VERDICTS = ("fresh", "untouched", "accumulated")
"""The verdicts of :func:`_since_last_sync`, coded by index in a sync's header."""


def _synced_at(state: StepState, param: torch.Tensor) -> int:
    """``state.ctx_serial`` when the last sync on the group summed ``param`` (0: never).

    By ``id(param)`` alone: a new parameter that reuses a freed one's id reads that one's
    serial, which only tells whether a CP forward ran since (the reading the caller needs)."""
    record = state.synced.get(id(param))
    return record[3] if record is not None else 0


_Versions = tuple[int, int | None]
"""A gradient's version counter, and its local shard's for a DTensor (``None`` otherwise)."""


def _versions(grad: torch.Tensor) -> _Versions:
    if not isinstance(grad, DTensor):
        return _compat.tensor_version(grad), None
    with torch.no_grad():
        return _compat.tensor_version(grad), _compat.tensor_version(grad.to_local())


def _backwards_into(now: _Versions, then: _Versions, expected: int) -> int:
    """How many backward passes added into a gradient since a sync recorded it: ``0`` none
    (unchanged), ``-1`` it was changed otherwise (zeroed in place), else the count.

    A plain tensor: one in-place add per backward, so the version's advance. A DTensor (FSDP2):
    a backward adds into the local shard (several in-place ops, the DTensor's own counter
    untouched), while ``zero_()`` and other in-place ops through the DTensor advance its own
    counter: unchanged wrapper and a changed shard is backward passes and nothing else, counted
    as ``expected``.
    """
    if now[1] is None or then[1] is None:
        return now[0] - then[0]
    if now[0] != then[0]:
        return -1
    return 0 if now[1] == then[1] else expected


def _record_alive(
    record: tuple[weakref.ref[nn.Module] | None, weakref.ref[torch.Tensor], _Versions, int],
) -> bool:
    """A record of another model that still counts: its synced module is alive (with no module
    given, its gradient)."""
    module = record[0]
    return module() is not None if module is not None else record[1]() is not None


def _since_last_sync(state: StepState, params: list[torch.Tensor]) -> tuple[str, list[bool]]:
    """What happened to ``params``' gradients since the last sync that summed them, and which
    of them it summed unchanged.

    The verdict is ``"untouched"`` (every gradient is the same tensor at the same version: no
    backward since), ``"accumulated"`` (one of them is the same tensor, advanced by exactly the
    backward passes since, one in-place add each: nothing zeroed it) or ``"fresh"`` (replaced,
    zeroed, never synced, or not known). The flags say, per parameter, whether its gradient is
    the very tensor, unchanged, that the last sync summed: with a ``"fresh"`` verdict those are
    parameters an earlier sync of this step already summed (a module shared by two models, each
    synced), and are skipped.

    Only the parameters of this sync are compared: syncing a second model on the same mesh (an
    actor and a critic, a policy and a value head) reads ``"fresh"``, not the first model's
    record. ``zero_grad`` sets gradients to ``None`` or zeroes them in place (a version bump of
    its own), so a legal loop always reads ``"fresh"``. The number of backward passes is the
    CP-tracked count of the mesh (one when none was tracked); it cannot tell which model's
    backward ran, so with other models' records alive on the mesh ``"accumulated"`` is not
    decided (an in-place zeroing plus one backward would look like two backward passes).
    """
    expected = max(1, state.backwards_since_sync)
    mine = {id(p) for p in params}
    alone = all(key in mine for key, record in state.synced.items() if _record_alive(record))
    done: list[bool] = []
    accumulated = False
    for param in params:
        record, grad = state.synced.get(id(param)), param.grad
        delta = -1  # not the gradient the last sync summed
        if grad is not None and record is not None and record[1]() is grad:
            delta = _backwards_into(_versions(grad), record[2], expected)  # the very gradient
        done.append(delta == 0)
        accumulated = accumulated or (delta == expected and alone)
    with_grad = [d for p, d in zip(params, done, strict=True) if p.grad is not None]
    if with_grad and all(with_grad):
        return "untouched", done
    return ("accumulated" if accumulated else "fresh"), done


def end_sync(
    state: StepState | None,
    params: Iterable[torch.Tensor] = (),
    summed: Iterable[bool] = (),
    module: nn.Module | None = None,
) -> None:
    """Record a completed ``sync_grads``: the identity and version of the gradients it summed.

    Args:
        state: The group's record (``None`` without a multi-rank group).
        params: The parameters of the sync.
        summed: Per parameter, whether this sync summed its gradient (a parameter an earlier
            sync summed keeps that sync's record); empty: all of them.
        module: The module synced (``None``: parameters given as an iterable); its records
            count as another model's while it is alive.
    """
    if state is None:
        return
    state.backwards_since_sync = 0
    params = list(params)
    flags = list(summed) or [True] * len(params)
    mine = {id(p) for p in params}
    for ref in state.watches:  # the prepared models whose gradients this sync summed
        watch, model = ref(), None
        if watch is not None:
            model = watch.model()
        if model is not None and any(id(p) in mine for p in model.parameters()):
            watch.backwards = 0  # type: ignore[union-attr]
    # drop the records of parameters (or gradients) that are gone, then record this sync's
    state.synced = {
        key: record
        for key, record in state.synced.items()
        if record[1]() is not None and _record_alive(record)
    }
    owner = None if module is None else weakref.ref(module)
    for p, flag in zip(params, flags, strict=True):
        if flag and p.grad is not None:
            state.synced[id(p)] = (
                owner,
                weakref.ref(p.grad),
                _versions(p.grad),
                state.ctx_serial,
            )
