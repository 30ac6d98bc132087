"""The step's life on every CP rank: prepared -> forward -> backward -> synced.

The CP ranks of a group must issue the same collectives in the same order. A rank that leaves a
step early (it caught an exception in the forward, skipped or broke off the backward, skipped
:func:`cpshard.sync_grads`) and goes on would pair its next collective with a different one of
its peers: gloo aborts on a size mismatch, and otherwise everyone waits for the process-group
timeout with messages that do not name the cause. This module keeps, per rank and per CP mesh, a
:class:`StepState` and makes every phase of a step start with the same small **step header**:

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
any data collective): the ``check_consistency`` flag of a prepare; at a prepare, the names, shapes,
dtypes and trainable pattern of the model's parameters (a model built or frozen differently on
some ranks), plus each rank's own report of an optimizer step on
unsynced gradients (below); at a sync, the names, shapes and dtypes of the trainable parameters;
at the first CP attention call of a forward, its dtypes (autocast's under autocast), head
counts, head dims, lengths and batch size.

Gradient sync records (per mesh, local, no collective): the identity and version of the
gradients the last :func:`cpshard.sync_grads` summed. A sync whose gradients are those very
tensors, unchanged, is doubled; one whose gradients are those tensors advanced by exactly one
in-place add per backward since (no ``zero_grad`` in between) sums already summed gradients again
(a sync per micro-batch): both raise. Accumulating over micro-batches (several backward passes,
one sync) is legal. A sync on another mesh than the one the model was prepared on (the dp mesh)
raises. A forgotten sync shows at the next prepare: the model's trainable parameters changed since
its previous prepare while a CP backward since the last sync was never synced (an optimizer step on
partial gradients). Undetectable: averaging instead of summing (a scale-invariant optimizer such as
AdamW hides it from the loss); ``cpshard parity --grad-sync mean`` shows it in the gradients.
Gradients zeroed through ``.data`` (no version bump) read as not zeroed: use ``zero_grad()``.

Not tracked: forwards traced by ``torch.compile`` (no header, no backward record), model-owned
contexts (a ``shard_batch`` that returns its own context factory: the forward is tracked as a
whole, its attention calls are not), and cp=1 (no collective to mismatch).

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
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from cpshard import _comm, _compat

__all__ = [
    "HEADER_SIZE",
    "PARAM_SAMPLE",
    "PAYLOAD_SIZE",
    "ForwardTracker",
    "OutOfStepError",
    "StepHeaderError",
    "StepMismatchError",
    "StepState",
    "begin_prepare",
    "begin_sync",
    "end_sync",
    "params_fingerprint",
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


def _str_hash(text: str) -> int:
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little") & _MASK


class StepState:
    """One rank's record of its step on one CP mesh (see the module docstring).

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
        self.active_watch: _ModelWatch | None = None
        self.watches: list[weakref.ref[_ModelWatch]] = []
        # id(parameter) -> (parameter, its gradient, the gradient's version) at the end of the
        # last sync that summed it (several models on one mesh: each keeps its own record)
        self.synced: dict[
            int, tuple[weakref.ref[torch.Tensor], weakref.ref[torch.Tensor], int]
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
    """The step record of this rank on ``cp_mesh`` (``None`` without a multi-rank group).

    Kept on the mesh object (one per mesh; a new mesh object starts a fresh record).
    """
    if _comm.cp_group(cp_mesh) is None:
        return None
    state = getattr(cp_mesh, _ATTR, None)
    if not isinstance(state, StepState):
        state = StepState()
        setattr(cp_mesh, _ATTR, state)
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


def params_fingerprint(model: nn.Module) -> tuple[int, int]:
    """``(values, layout)``: hashes of the trainable parameters' values and of which are trainable.

    ``values`` covers a strided sample of at most :data:`PARAM_SAMPLE` values of each trainable
    parameter (the local shard of a DTensor; meta tensors count by shape only): an optimizer step
    on gradients that differ across the ranks changes nearly every value. ``layout`` covers the
    names, shapes, dtypes and ``requires_grad`` of every parameter.
    """
    layout = []
    samples = []
    for name, p in model.named_parameters():
        layout.append(f"{name}:{tuple(p.shape)}:{p.dtype}:{p.requires_grad}")
        if not p.requires_grad:
            continue
        local = p.to_local() if isinstance(p, DTensor) else p
        if local.device.type == "meta" or local.numel() == 0:
            continue
        flat = local.detach().reshape(-1)
        samples.append(flat[:: max(1, flat.numel() // PARAM_SAMPLE)][:PARAM_SAMPLE])
    if not samples:
        return 0, _str_hash(";".join(layout))
    by_device: dict[torch.device, list[torch.Tensor]] = {}
    for t in samples:
        by_device.setdefault(t.device, []).append(t.to(torch.float64))
    # one transfer per device (not one per parameter)
    bits = torch.cat([torch.cat(ts).cpu() for ts in by_device.values()]).view(torch.int64)
    weights = torch.arange(1, 2 * bits.numel(), 2, dtype=torch.int64)
    return int((bits * weights).sum()), _str_hash(";".join(layout))


def begin_prepare(
    state: StepState | None,
    cp_mesh: DeviceMesh | None,
    *,
    check_consistency: bool,
    model: nn.Module | None,
    payload: torch.Tensor | None = None,
    synced_elsewhere: bool = False,
) -> torch.Tensor | None:
    """Start a step: raise locally if this rank left the last one midway, then agree on it.

    One header all-gather (always, whatever ``check_consistency`` says), which also carries
    ``payload`` (the batch fingerprint: one collective per prepare). ``synced_elsewhere``: the
    model's gradients are summed over the CP group by its wrapper (DDP over a group holding the
    CP ranks), so a step without ``sync_grads`` is no forgotten sync. The ranks must agree on
    the phase (every one of them starts a step), on ``check_consistency``, and on the model's
    parameters' names, shapes, dtypes and trainable pattern (whatever ``check_consistency`` says;
    a prepare without a model counts as no parameters). Each
    rank also reports whether the model's trainable parameters changed since its previous
    prepare while a CP backward since the last ``sync_grads`` was never synced (an optimizer step
    on unsynced gradients): if any rank does, every rank raises.

    Returns:
        Every rank's ``payload`` as a LongTensor ``[C, P]`` on the CPU (row ``r`` from rank
        ``r``), or ``None`` without a collective (no multi-rank group, or no payload).

    Raises:
        RuntimeError: this rank left its last step midway (locally, no collective), the ranks
            are out of step, or an optimizer step ran on unsynced gradients (on every rank).
        ValueError: the ranks disagree on ``check_consistency`` or on the model's parameters.
    """
    watch = None if model is None else _watch_of(model)
    values = layout = 0
    if model is not None and state is not None:
        values, layout = params_fingerprint(model)
    if state is None or cp_mesh is None:
        if watch is not None:
            watch.values = values
        return None
    state.check_usable("prepare_cp_forward / make_cp_batch_and_ctx")
    unsynced = (
        watch is not None
        and watch.values is not None
        and watch.values != values
        and watch.backwards > 0  # this model's own CP backward passes, not another model's
        and not synced_elsewhere
    )
    # the same slots are compared on every rank (whatever each rank's flag): the message is the
    # same everywhere. The parameters' names, shapes, dtypes and trainable pattern are no data
    # values: compared also with check_consistency=False (0 without a model).
    facts = {_A: int(bool(check_consistency)), _B: layout}
    names = {
        _A: "check_consistency (pass the same value on every rank)",
        _B: "the model's parameters (names, shapes, dtypes, which are trainable: build and "
        "freeze the model the same way on every CP rank, and pass it on every rank)",
    }
    rows = _exchange(
        state, cp_mesh, PREPARE, facts, names, carry={_C: int(unsynced)}, shown={_A: _as_bool},
        payload=payload,
    )  # fmt: skip
    if watch is not None:
        watch.values = values
    state.epoch += 1
    stale = [r for r, row in enumerate(rows) if row[_C]]
    if stale:
        state.backwards_since_sync = 0  # reported once
        if watch is not None:
            watch.backwards = 0
        raise RuntimeError(
            f"the model's trainable parameters changed since the last prepare on ranks {stale} "
            "while their last CP backward() was never summed over the CP group: "
            "cpshard.sync_grads(model, cp_mesh) was not called between loss.backward() and "
            "optimizer.step(), so each rank stepped on its own partial gradient (silently wrong, "
            "and the ranks' weights drift apart). Call cpshard.sync_grads(model, cp_mesh) after "
            "the last backward of each optimizer step"
        )
    if payload is None:
        return None
    size = HEADER_SIZE + payload.numel()
    return torch.tensor([row[HEADER_SIZE:size] for row in rows], dtype=torch.long)


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
        if task == state.bwd_task:
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
        self.values: int | None = None  # params_fingerprint values at the last prepare
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
) -> None:
    """Check a ``sync_grads`` call locally, then agree on it (one header all-gather).

    Args:
        state: The record of ``cp_mesh`` (``None`` without a multi-rank group).
        cp_mesh: The mesh given to ``sync_grads``.
        params: ``(name, parameter)`` of the trainable parameters it sums.
        prepared_on: The multi-rank CP mesh the model was last prepared on, if known.

    Raises:
        ValueError: the mesh is not the one the model was prepared on (every rank that passes
            it), or the ranks' trainable parameters differ (names, shapes, dtypes).
        RuntimeError: this rank left its step midway (locally), a doubled sync (no CP backward
            since the last one, on every rank that does it), or the ranks are out of step.
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
    if state is None or cp_mesh is None:
        return
    state.check_usable("sync_grads")
    params = list(params)
    verdict = _since_last_sync(state, [p for _, p in params])
    if verdict == "untouched":
        raise RuntimeError(
            "sync_grads was called again with no backward() since the last sync_grads (the "
            "gradients are the very tensors it summed, unchanged): it would sum the already "
            "summed gradients again (multiplied by the CP size). Call it once per optimizer "
            "step, after the last backward"
        )
    if verdict == "accumulated":
        raise RuntimeError(
            "sync_grads is summing gradients that still hold the gradients the last sync_grads "
            "already summed (a backward() accumulated into them, with no zero_grad in between): "
            "called after every micro-batch, it multiplies the earlier micro-batches' gradients "
            "by the CP size again. Accumulate over the micro-batches and call sync_grads once, "
            "after the last backward and before optimizer.step(); zero the gradients after each "
            "step with optimizer.zero_grad() / model.zero_grad()"
        )
    layout = ";".join(f"{n}:{tuple(p.shape)}:{p.dtype}" for n, p in params)
    _exchange(
        state, cp_mesh, SYNC, {_A: _str_hash(layout)},
        {_A: "the trainable parameters (names, shapes, dtypes): freeze and build the model the "
         "same way on every CP rank"},
    )  # fmt: skip


def _since_last_sync(state: StepState, params: list[torch.Tensor]) -> str:
    """What happened to ``params``' gradients since the last sync that summed them:
    ``"untouched"`` (every one is the same tensor at the same version: no backward since),
    ``"accumulated"`` (one of them is the same tensor, advanced by exactly the backward passes
    since, one in-place add each: nothing zeroed it) or ``"fresh"`` (replaced, zeroed, never
    synced, or not known).

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
    alone = all(key in mine for key, record in state.synced.items() if record[0]() is not None)
    seen = 0
    untouched = 0
    for param in params:
        if param.grad is None:
            continue
        seen += 1
        record = state.synced.get(id(param))
        if record is None:
            continue
        param_ref, grad_ref, version = record
        if param_ref() is not param or grad_ref() is not param.grad:
            continue
        delta = _compat.tensor_version(param.grad) - version
        if delta == 0:
            untouched += 1
        elif delta == expected and alone:
            return "accumulated"
    if seen and untouched == seen:
        return "untouched"
    return "fresh"


def end_sync(state: StepState | None, params: Iterable[torch.Tensor] = ()) -> None:
    """Record a completed ``sync_grads``: the identity and version of the gradients it summed."""
    if state is None:
        return
    state.backwards_since_sync = 0
    params = list(params)
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
        if record[0]() is not None and record[1]() is not None
    }
    for p in params:
        if p.grad is not None:
            state.synced[id(p)] = (
                weakref.ref(p),
                weakref.ref(p.grad),
                _compat.tensor_version(p.grad),
            )
