"""CP-correct losses: token means whose gradients, summed over CP ranks, equal one process's.

Under CP each rank holds a slice of every sequence, so a per-rank ``mean`` over local tokens is
wrong twice: ranks hold different numbers of real tokens, and the gradient reduction over the CP
group then sums (or averages) already-averaged values. The fix is to divide each rank's *sum* by
the *global* token count, which every rank knows before sharding (it holds the global batch), and
to undo the averaging of a mean-reducing gradient sync (e.g. FSDP over a flattened ``dp x cp``
group) by the CP size.

Example:
    >>> n = count_tokens(batch["labels"])                    # doctest: +SKIP
    >>> loss = cp_cross_entropy(logits, local["labels"], num_tokens=n)  # doctest: +SKIP
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh

from cpshard import _comm

__all__ = [
    "count_tokens",
    "cp_cross_entropy",
    "cp_loss_scale",
    "cp_token_mean",
    "reduce_for_logging",
]

GradReduction = Literal["sum", "mean"]


def count_tokens(labels: torch.Tensor, *, ignore_index: int = -100) -> int:
    """Number of supervised tokens in the *global* (unsharded) labels; no collective.

    Args:
        labels: LongTensor ``[B, S]`` of pre-shifted global labels.
        ignore_index: Label of unsupervised tokens.

    Returns:
        The count, the same on every CP rank.
    """
    return int((labels != ignore_index).sum())


def cp_loss_scale(cp_mesh: DeviceMesh | None, grad_reduction: GradReduction = "sum") -> float:
    """Factor that makes per-rank partial losses right for the gradient sync in use.

    Args:
        cp_mesh: The CP mesh (``None`` = no CP).
        grad_reduction: How gradients are reduced across the CP ranks: ``"sum"`` (all-reduce sum,
            the exact adjoint) or ``"mean"`` (e.g. FSDP/DDP averaging over a group that includes
            the CP ranks), which divides by the CP size and must be undone.

    Returns:
        ``1.0`` for ``"sum"``, the CP size for ``"mean"``.
    """
    if grad_reduction not in ("sum", "mean"):
        raise ValueError(
            f"grad_reduction must be 'sum' or 'mean', got grad_reduction={grad_reduction!r}"
        )
    return float(_comm.cp_rank_and_size(cp_mesh)[1]) if grad_reduction == "mean" else 1.0


def _check_count(num_tokens: int | torch.Tensor) -> None:
    if isinstance(num_tokens, int) and num_tokens < 0:
        raise ValueError(f"num_tokens must be >= 0, got num_tokens={num_tokens}")


def cp_token_mean(
    values: torch.Tensor,
    mask: torch.Tensor,
    *,
    num_tokens: int | torch.Tensor,
    scale: float = 1.0,
) -> torch.Tensor:
    """This rank's share of a global token mean: ``scale * sum(values * mask) / num_tokens``.

    Summed over CP ranks it is the mean over every supervised token of the global batch.

    Args:
        values: Per-token values of the local shard, ``[B, L]`` (e.g. ``-logp * advantages``).
        mask: ``[B, L]`` bool/0-1 mask of the tokens that count (local shard).
        num_tokens: Global number of counted tokens (:func:`count_tokens`); ``0`` gives ``0``.
        scale: :func:`cp_loss_scale` for the gradient reduction in use.

    Returns:
        A scalar fp32 tensor.
    """
    _check_count(num_tokens)
    if values.shape != mask.shape:
        raise ValueError(
            f"values {tuple(values.shape)} and mask {tuple(mask.shape)} must have the same shape"
        )
    total = (values.float() * mask.float()).sum()
    denom = torch.as_tensor(num_tokens, dtype=torch.float32, device=total.device).clamp(min=1)
    return total * scale / denom


def cp_cross_entropy(
    logits: torch.Tensor,
    labels: torch.Tensor,
    *,
    num_tokens: int | torch.Tensor,
    ignore_index: int = -100,
    scale: float = 1.0,
) -> torch.Tensor:
    """This rank's share of the global mean next-token cross-entropy (fp32).

    Args:
        logits: ``[B, L, V]`` local logits.
        labels: ``[B, L]`` local pre-shifted labels (``ignore_index`` = not supervised).
        num_tokens: Global number of supervised tokens (:func:`count_tokens`).
        ignore_index: Label of unsupervised tokens (CP padding carries it too).
        scale: :func:`cp_loss_scale` for the gradient reduction in use.

    Returns:
        A scalar fp32 tensor; summed over CP ranks it is the global mean loss.
    """
    if logits.shape[:-1] != labels.shape:
        raise ValueError(f"logits {tuple(logits.shape)} must be labels {tuple(labels.shape)} + [V]")
    _check_count(num_tokens)
    per_token = F.cross_entropy(
        logits.float().reshape(-1, logits.shape[-1]),
        labels.reshape(-1),
        ignore_index=ignore_index,
        reduction="sum",
    )
    denom = torch.as_tensor(num_tokens, dtype=torch.float32, device=per_token.device).clamp(min=1)
    return per_token * scale / denom


def reduce_for_logging(partial: torch.Tensor, cp_mesh: DeviceMesh | None) -> torch.Tensor:
    """Sum per-rank partial losses over the CP group (detached), e.g. to log the global loss."""
    out = partial.detach().clone()
    return _comm.all_reduce_sum_(out, _comm.cp_group(cp_mesh))
