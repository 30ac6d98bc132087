"""Loss and gradient parity: the same training steps at cp=1 and cp=N must agree.

:func:`train_steps` runs AdamW steps of a tiny model on real text (the shipped corpus) through the
public contract: ``prepare_cp_forward`` -> ``with ctx(): model(...)`` ->
:func:`cpshard.loss.cp_cross_entropy` -> gradient all-reduce over the CP group. It has no branch
on the CP size, so one rank gives the reference and N ranks give the CP result;
:func:`compare` measures, at every step, how far apart the losses and the gradients are, and
:data:`TOLERANCES` says how far is too far.

The models a parity run can use are one table, :data:`cpshard.parity_models.MODELS`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from cpshard import _comm
from cpshard.corpus import PAD_ID
from cpshard.dispatch import LayoutName, prepare_cp_forward
from cpshard.loss import count_tokens, cp_cross_entropy, reduce_for_logging, sync_grads
from cpshard.parity_models import HEADS, KV_HEADS, MODELS, BatchSpec, ModelSpec

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


# fp32: the measured differences are ~1e-7 (summation order only), so 1e-5 leaves 100x margin
# while a real bug (a missing mask, a wrong gradient sync) is >= 1e-3. bf16 rounds every matmul
# and every weight update to 8 mantissa bits (eps 7.8e-3): cp=1 and cp=N sum in a different
# order, round differently and drift apart step by step (AdamW amplifies sign flips of tiny
# gradients): measured over 50 steps at cp=2, rel |dloss| <= 4.3e-4 and grad err <= 0.10 (the
# cp=1 reference against the model's own attention differs by as much: 1.5e-3 and 0.03), so bf16
# gets loose bounds, 1 % of the loss and 25 % of the largest gradient. They still catch a wrong
# gradient sync (error >= 1 - 1/C = 0.5); the fp32 rows are the correctness check.
TOLERANCES = {
    "float64": Tolerance(rel_loss=1e-12, grad=1e-10),
    "float32": Tolerance(rel_loss=1e-5, grad=1e-5),
    "bfloat16": Tolerance(rel_loss=1e-2, grad=0.25),
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
    """What :func:`train_steps` reports (rank 0's view; gradients are CP-reduced).

    Attributes:
        layout: The sharder's layout label.
        losses: Global loss of every step.
        grads: Per step, every parameter's gradient flattened into one CPU tensor ``[n_params]``.
        local_tokens: Length of this rank's shard (tokens per row).
    """

    layout: str
    losses: list[float]
    grads: list[torch.Tensor]
    local_tokens: int


@dataclass(frozen=True)
class StepDiff:
    """Per-step differences of a CP run against its reference (see :func:`compare`)."""

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


def _batch(case: ParityCase, step: int, device: torch.device) -> dict[str, Any]:
    spec = BatchSpec(case.batch, case.batch_size, case.seq_len, case.seed * 1000 + step)
    batch = MODELS[case.model].make_batch(spec)
    return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}


def _flat_grads(model: nn.Module) -> torch.Tensor:
    """Every parameter's gradient in one CPU vector (a missing gradient counts as zeros)."""
    keep = torch.float64 if next(model.parameters()).dtype == torch.float64 else torch.float32
    return torch.cat(
        [
            torch.zeros(p.numel(), dtype=keep)
            if p.grad is None
            else p.grad.detach().reshape(-1).to("cpu", keep)
            for p in model.parameters()
        ]
    )


def train_steps(cp_mesh: DeviceMesh | None, case: ParityCase) -> ParityResult:
    """Run ``case.steps`` AdamW steps through the CP contract; report losses and gradients.

    Args:
        cp_mesh: The CP mesh (size 1 or ``None`` gives the single-process reference).
        case: What to run.

    Returns:
        The global loss and the CP-reduced gradients of every step, and the local length.
    """
    spec = MODELS[case.model]
    device = torch.device(case.device)
    model = build_model(case.model, DTYPES[case.dtype], case.seed).to(device)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    group = _comm.cp_group(cp_mesh)
    _, cp_size = _comm.cp_rank_and_size(cp_mesh)
    losses: list[float] = []
    grads: list[torch.Tensor] = []
    layout, local_tokens = "", 0
    for step in range(case.steps):
        batch = _batch(case, step, device)
        ctx, local, sharder = prepare_cp_forward(
            model,
            cp_mesh,
            batch,
            padding_token_id=PAD_ID,
            layout=case.layout,
            # "own": the model's attention needs no CP method (its sharder's ctx decides)
            attention="all_gather" if case.method == "own" else case.method,
        )
        with ctx():
            logits = spec.forward(model, local)
        loss = cp_cross_entropy(logits, local["labels"], num_tokens=count_tokens(batch["labels"]))
        loss.backward()  # type: ignore[no-untyped-call]
        if case.grad_sync == "sum":
            sync_grads(model, cp_mesh)  # the contract's gradient sync
        elif case.grad_sync == "mean":  # injected mistake: averaged, loss not rescaled
            for p in model.parameters():
                if p.grad is not None:
                    _comm.all_reduce_sum_(p.grad, group)
                    p.grad.div_(cp_size)
        grads.append(_flat_grads(model))
        losses.append(float(reduce_for_logging(loss, cp_mesh)))
        opt.step()
        opt.zero_grad(set_to_none=True)
        layout, local_tokens = sharder.layout, int(local["labels"].shape[-1])
    return ParityResult(layout, losses, grads, local_tokens)


def native_steps(case: ParityCase) -> ParityResult:
    """The same steps as :func:`train_steps` without cpshard: the model's own attention (its
    ``native_loss``: e.g. dense rows causal with right padding, packed rows one document at a
    time). An independent check of the cp=1 reference.

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
    grads: list[torch.Tensor] = []
    for step in range(case.steps):
        batch = _batch(case, step, device)
        loss = spec.native_loss(model, batch)
        loss.backward()  # type: ignore[no-untyped-call]
        grads.append(_flat_grads(model))
        losses.append(float(loss.detach()))
        opt.step()
        opt.zero_grad(set_to_none=True)
    return ParityResult("native", losses, grads, int(batch["labels"].shape[-1]))


def compare(ref: ParityResult, got: ParityResult) -> StepDiff:
    """Per step: ``|dloss|``, ``|dloss| / |ref loss|`` and ``max|dg| / max|g_ref|``.

    Args:
        ref: The reference run (cp=1).
        got: The run to check, same number of steps.

    Returns:
        The per-step differences (NaN where a loss or gradient is not finite).
    """
    if len(ref.losses) != len(got.losses) or len(ref.grads) != len(got.grads):
        raise ValueError(
            f"runs differ in length: {len(ref.losses)} vs {len(got.losses)} steps; compare runs "
            "of the same case"
        )
    abs_d, rel_d, gerr = [], [], []
    for a, b in zip(ref.losses, got.losses, strict=True):
        d = abs(a - b)
        abs_d.append(d)
        rel_d.append(d / abs(a) if a != 0 else d)
    for g_ref, g_got in zip(ref.grads, got.grads, strict=True):
        if g_ref.shape != g_got.shape:
            raise ValueError(f"gradient sizes differ: {g_ref.numel()} vs {g_got.numel()}")
        g_ref, g_got = g_ref.double(), g_got.double()
        scale = float(g_ref.abs().max()) if g_ref.numel() else 0.0
        err = float((g_ref - g_got).abs().max()) if g_ref.numel() else 0.0
        gerr.append(err / scale if scale > 0 else err)
    return StepDiff(abs_d, rel_d, gerr)
