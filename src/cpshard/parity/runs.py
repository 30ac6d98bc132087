"""Loss and gradient parity: the same training steps at cp=1 and cp=N must agree.

:func:`train_steps` runs AdamW steps of a tiny model on real text (the shipped corpus) through the
public contract: ``prepare_cp_forward`` -> ``with ctx(): model(...)`` ->
:func:`cpshard.loss.cp_cross_entropy` -> gradient all-reduce over the CP group. It has no branch
on the CP size, so one rank gives the reference and N ranks give the CP result;
:func:`compare` measures, at every step, how far apart the losses and the gradients are, and
:data:`TOLERANCES` says how far is too far.

The models a parity run can use are one table, :data:`cpshard.parity.models.MODELS`.

Import rules: the rows of ``RULES`` in tests/unit/test_architecture.py that cover this module.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from cpshard import _comm
from cpshard.dispatch import prepare_cp_forward
from cpshard.loss import count_tokens, cp_cross_entropy, reduce_for_logging, sync_grads
from cpshard.names import LayoutName
from cpshard.parity.models import HEADS, KV_HEADS, MODELS, BatchSpec, ModelSpec
from cpshard.tools.corpus import PAD_ID

__all__ = [
    "DTYPES",
    "GRAD_SYNCS",
    "HEADS",
    "KV_HEADS",
    "MODELS",
    "TOLERANCES",
    "ModelSpec",
    "ParityCase",
    "ParityResult",
    "StepDiff",
    "Tolerance",
    "build_model",
    "compare",
    "grad_error",
    "native_steps",
    "train_steps",
]

DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16}
GradSync = Literal["sum", "mean", "none"]
# "sum" is right; "mean" (averaging over the CP group without cp_loss_scale) and "none" (no
# all-reduce) are the two classic mistakes, there to show that the check catches them.
GRAD_SYNCS: tuple[GradSync, ...] = ("sum", "mean", "none")


@dataclass(frozen=True)
class Tolerance:
    """Pass thresholds of one dtype, applied at every step.

    Attributes:
        rel_loss: Max ``|loss_cp - loss_ref| / |loss_ref|``.
        grad: Max ``max|g_cp - g_ref| / max|g_ref|`` over all parameters.
    """

    rel_loss: float
    grad: float


# What is compared (see train_steps): the losses of two independent runs (cp=N and cp=1, each on
# its own weights, like a branch-vs-base validation run), and at every step the cp=N gradient
# against the cp=1 gradient computed on the SAME weights (rank 0 recomputes it each step), so the
# gradient check measures that step's CP error, not the drift of two trajectories.
# fp32: measured over 50 steps at cp=4 (24 rows), rel |dloss| <= 3.0e-7 and grad err <= 8.9e-7
# (summation order only): 1e-5 leaves a wide margin while a real bug (a missing mask, a wrong
# gradient sync) is >= 1e-3. bf16 rounds every matmul and weight update to 8 mantissa bits (eps
# 7.8e-3): the two runs round differently and drift apart, and one step's gradients on the same
# weights differ by a few eps of the largest gradient. Measured over 50 steps at cp=4: rel
# |dloss| <= 3.3e-3 and grad err <= 2.5e-2 (cp=1 against the model's own attention: 1.5e-3,
# 1.1e-2), so bf16 gets 1e-2 and 0.1. That still catches a wrong gradient sync (>= 1 - 1/C =
# 0.5); the fp32 rows are the correctness check.
TOLERANCES = {
    "float64": Tolerance(rel_loss=1e-12, grad=1e-10),
    "float32": Tolerance(rel_loss=1e-5, grad=1e-5),
    "bfloat16": Tolerance(rel_loss=1e-2, grad=0.1),
}


@dataclass(frozen=True)
class ParityCase:
    """One parity run: model, batch kind, layout, attention method, sizes and the grad sync."""

    model: str = "llama"
    batch: str = "dense"
    layout: LayoutName = "auto"
    method: str = "all_gather"
    steps: int = 3
    seq_len: int = 256
    batch_size: int = 2
    dtype: str = "float32"
    seed: int = 0
    grad_sync: GradSync = "sum"
    device: str = "cpu"


@dataclass(frozen=True)
class ParityResult:
    """What :func:`train_steps` reports (the main rank's view).

    Attributes:
        layout: The sharder's layout label.
        losses: Global loss of every step.
        grad_errs: Per step, ``max|g - g_shadow| / max|g_shadow|`` of the CP-reduced gradients
            against the shadow gradient on the same weights (empty without a shadow).
        local_tokens: Length of this rank's shard (tokens per row).
    """

    layout: str
    losses: list[float]
    grad_errs: list[float]
    local_tokens: int


@dataclass(frozen=True)
class StepDiff:
    """Per-step differences of a run against its reference (see :func:`compare`)."""

    abs_dloss: list[float]
    rel_dloss: list[float]
    grad_err: list[float]

    def passed(self, tol: Tolerance) -> bool:
        """Every step within ``tol`` (NaN never passes)."""
        return all(d <= tol.rel_loss for d in self.rel_dloss) and all(
            g <= tol.grad for g in self.grad_err
        )


def build_model(kind: str, dtype: torch.dtype, seed: int = 0) -> nn.Module:
    """The model ``kind`` of :data:`MODELS` with a fixed random init; no downloads."""
    if kind not in MODELS:
        raise ValueError(f"model must be one of {sorted(MODELS)}, got model={kind!r}")
    return MODELS[kind].build(dtype, seed)


# --- running and comparing ---------------------------------------------------------------------

Shadow = Literal["none", "cp1", "native"]


def _batch(case: ParityCase, step: int, device: torch.device) -> dict[str, Any]:
    spec = BatchSpec(case.batch, case.batch_size, case.seq_len, case.seed * 1000 + step)
    batch = MODELS[case.model].make_batch(spec)
    return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}


def _flat(grads: list[torch.Tensor | None], params: list[nn.Parameter]) -> torch.Tensor:
    """One float64 vector of every parameter's gradient (a missing gradient counts as zeros)."""
    return torch.cat(
        [
            torch.zeros(p.numel(), dtype=torch.float64, device=p.device)
            if g is None
            else g.detach().reshape(-1).double()
            for g, p in zip(grads, params, strict=True)
        ]
    )


def grad_error(got: torch.Tensor, ref: torch.Tensor) -> float:
    """``max|got - ref| / max|ref|`` (``max|got - ref|`` when ``ref`` is all zeros)."""
    if got.shape != ref.shape:
        raise ValueError(f"gradient sizes differ: {got.numel()} vs {ref.numel()}")
    if ref.numel() == 0:
        return 0.0
    scale = float(ref.abs().max())
    err = float((got - ref).abs().max())
    return err / scale if scale > 0 else err


def _cp_loss(
    model: nn.Module, cp_mesh: DeviceMesh | None, case: ParityCase, batch: dict[str, Any]
) -> tuple[torch.Tensor, Any]:
    """This rank's share of the global mean loss through the CP contract, and the sharder."""
    ctx, local, sharder = prepare_cp_forward(
        model,
        cp_mesh,
        batch,
        padding_token_id=PAD_ID,
        layout=case.layout if cp_mesh is not None else "auto",
        # "own": the model's attention needs no CP method (its sharder's ctx decides)
        attention="all_gather" if case.method == "own" else case.method,
    )
    with ctx():
        logits = MODELS[case.model].forward(model, local)
    loss = cp_cross_entropy(logits, local["labels"], num_tokens=count_tokens(batch["labels"]))
    return loss, (sharder, local)


def _shadow_grads(
    model: nn.Module, case: ParityCase, batch: dict[str, Any], shadow: Shadow
) -> torch.Tensor:
    """The gradient the shadow path gives on the model's current weights (``.grad`` untouched)."""
    params = [p for p in model.parameters() if p.requires_grad]
    if shadow == "cp1":
        loss, _ = _cp_loss(model, None, case, batch)
    else:
        native = MODELS[case.model].native_loss
        if native is None:
            raise ValueError(f"model {case.model!r} has no native-attention check")
        loss = native(model, batch)
    grads = torch.autograd.grad(loss, params, allow_unused=True)
    return _flat(list(grads), params)


def train_steps(
    cp_mesh: DeviceMesh | None, case: ParityCase, shadow: Shadow = "cp1"
) -> ParityResult:
    """Run ``case.steps`` AdamW steps through the CP contract; report losses and gradient errors.

    Every rank trains the same way (no branch on the CP size). Before each optimizer step, rank 0
    also computes the shadow gradient on the same weights, without any collective: ``"cp1"`` the
    same contract on one process (cp_mesh ``None``), ``"native"`` the model's own attention
    without cpshard; ``"none"`` skips it (a reference run that only needs its losses).

    Args:
        cp_mesh: The CP mesh (size 1 or ``None`` gives the single-process run).
        case: What to run.
        shadow: The gradient to compare with at every step (rank 0 only).

    Returns:
        The global loss of every step, the per-step gradient errors (rank 0; empty elsewhere or
        without a shadow) and the local length.
    """
    device = torch.device(case.device)
    model = build_model(case.model, DTYPES[case.dtype], case.seed).to(device)
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-3)
    rank, cp_size = _comm.cp_rank_and_size(cp_mesh)
    losses: list[float] = []
    errs: list[float] = []
    layout, local_tokens = "", 0
    for step in range(case.steps):
        batch = _batch(case, step, device)
        loss, (sharder, local) = _cp_loss(model, cp_mesh, case, batch)
        loss.backward()  # type: ignore[no-untyped-call]
        if case.grad_sync == "sum":
            sync_grads(model, cp_mesh)  # the contract's gradient sync
        elif case.grad_sync == "mean":  # injected mistake: averaged, loss not rescaled
            sync_grads(model, cp_mesh)  # (a sum the step record sees, then the DDP-habit mean)
            for p in params:
                if p.grad is not None:
                    p.grad.div_(cp_size)
        if shadow != "none" and rank == 0:
            ref = _shadow_grads(model, case, batch, shadow)
            errs.append(grad_error(_flat([p.grad for p in params], params), ref))
        losses.append(float(reduce_for_logging(loss, cp_mesh)))
        opt.step()
        opt.zero_grad(set_to_none=True)
        layout, local_tokens = sharder.layout, int(local["labels"].shape[-1])
    return ParityResult(layout, losses, errs, local_tokens)


def native_steps(case: ParityCase) -> ParityResult:
    """The same steps as :func:`train_steps` without cpshard: the model's own attention (its
    ``native_loss``: e.g. dense rows causal with right padding, packed rows one document at a
    time). Its losses are an independent check of the cp=1 reference's.

    Raises:
        ValueError: the model has no native check (``native_loss`` is ``None``).
    """
    spec = MODELS[case.model]
    if spec.native_loss is None:
        raise ValueError(f"model {case.model!r} has no native-attention check")
    device = torch.device(case.device)
    model = build_model(case.model, DTYPES[case.dtype], case.seed).to(device)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses: list[float] = []
    for step in range(case.steps):
        batch = _batch(case, step, device)
        loss = spec.native_loss(model, batch)
        loss.backward()  # type: ignore[no-untyped-call]
        losses.append(float(loss.detach()))
        opt.step()
        opt.zero_grad(set_to_none=True)
    return ParityResult("native", losses, [], int(batch["labels"].shape[-1]))


def compare(ref: ParityResult, got: ParityResult) -> StepDiff:
    """Per step: ``|dloss|`` and ``|dloss| / |ref loss|`` of two runs, and ``got``'s gradient
    errors against its shadow on the same weights.

    Args:
        ref: The reference run (its losses).
        got: The run to check (losses and per-step gradient errors), same number of steps.

    Returns:
        The per-step differences (NaN where a loss or gradient is not finite).
    """
    if len(ref.losses) != len(got.losses) or len(got.grad_errs) != len(got.losses):
        raise ValueError(
            f"runs differ in length: {len(ref.losses)} vs {len(got.losses)} steps with "
            f"{len(got.grad_errs)} gradient checks; compare runs of the same case"
        )
    abs_d, rel_d = [], []
    for a, b in zip(ref.losses, got.losses, strict=True):
        d = abs(a - b)
        abs_d.append(d)
        rel_d.append(d / abs(a) if a != 0 else d)
    return StepDiff(abs_d, rel_d, list(got.grad_errs))
