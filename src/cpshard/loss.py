"""CP-correct losses and gradient sync: per-rank partials whose sum is one process's loss.

Under CP each rank holds a slice of every sequence, so a per-rank ``mean`` over local tokens is
wrong twice: ranks hold different numbers of real tokens, and the gradient reduction over the CP
group then sums (or averages) already-averaged values. The fix is to divide each rank's *sum* by
the *global* token count (:func:`count_tokens`: of the global batch without a collective, or of
the local shards over a ``dp x cp`` mesh), sum the gradients over the CP group
(:func:`sync_grads`), and undo the averaging of a mean-reducing gradient sync (FSDP2 over ``dp``
or over the flattened ``dp x cp`` ranks) with :func:`grad_mean_scale`.
:func:`reduce_for_logging` turns the partials back into the true global loss.

Example:
    >>> n = count_tokens(batch["labels"])                    # doctest: +SKIP
    >>> loss = cp_cross_entropy(logits, local["labels"], num_tokens=n)  # doctest: +SKIP
    >>> loss.backward(); sync_grads(model, cp_mesh)          # doctest: +SKIP

Import rules: the rows of ``RULES`` in tests/unit/test_architecture.py that cover this module.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from cpshard import _comm
from cpshard.guards.step import begin_sync, end_sync, prepared_mesh, step_state

__all__ = [
    "count_tokens",
    "cp_cross_entropy",
    "cp_loss_scale",
    "cp_token_mean",
    "grad_mean_scale",
    "reduce_for_logging",
    "sync_grads",
]

GradReduction = Literal["sum", "mean"]


def count_tokens(
    labels: torch.Tensor, *, ignore_index: int = -100, group: DeviceMesh | None = None
) -> int:
    """Number of supervised tokens: of these labels, or summed over the ranks of ``group``.

    Two uses, one call each:

    * ``count_tokens(batch["labels"])``: the global (unsharded) labels of one CP group; no
      collective, the same on every CP rank.
    * ``count_tokens(local["labels"], group=mesh)``: the *local* (sharded) labels summed over
      every rank of ``mesh`` (1-D, or e.g. the 2-D ``dp x cp`` mesh: all its ranks). Each real
      token lives on exactly one rank (CP pads and replicated copies carry ``ignore_index``),
      so this is the token count of the whole ``dp x cp`` step. Do not pass the *global* labels
      with a group that contains CP ranks: every CP rank would count them again.

    Args:
        labels: LongTensor ``[B, S]`` of pre-shifted labels (global, or local with ``group``),
            or a bool mask ``[B, S]`` whose ``True`` entries are counted (e.g. response tokens).
        ignore_index: Label of unsupervised tokens.
        group: Mesh whose ranks' counts are summed (one all-reduce per mesh dim), or ``None``.

    Returns:
        The count, the same on every rank of ``group``.

    Raises:
        ValueError: this rank is not part of ``group``.
    """
    n = labels.sum() if labels.dtype == torch.bool else (labels != ignore_index).sum()
    if group is None:
        return int(n)
    _check_member(group, "count_tokens")
    total = n.to(torch.int64).reshape(1).clone()
    return int(_comm.all_reduce_sum_mesh_(total, group)[0])


def _check_member(mesh: DeviceMesh, what: str) -> None:
    if not isinstance(mesh, DeviceMesh):
        raise TypeError(f"{what} takes a DeviceMesh or None, got {type(mesh).__name__}")
    if not _comm.mesh_contains_this_rank(mesh):
        raise ValueError(
            f"{what} was given a mesh {mesh.mesh.tolist()} (dims {mesh.mesh_dim_names}) that does "
            "not contain this rank; pass the sub-mesh this rank belongs to (e.g. mesh['cp'] of "
            "its own 2-D mesh)"
        )


def grad_mean_scale(averaged_over: DeviceMesh | None) -> float:
    """Factor that undoes a mean-reducing gradient sync: the number of ranks it averages over.

    Normalise the loss by the token count of everything the sync covers (:func:`count_tokens`
    with ``group``) and multiply it by this factor; the averaged gradient is then the gradient of
    the global per-token mean. FSDP2 ``fully_shard`` over ``mesh["dp"]`` (CP synced with
    :func:`sync_grads`): ``grad_mean_scale(mesh["dp"])``; ``fully_shard`` over the flattened
    ``dp x cp`` mesh: ``grad_mean_scale(mesh)`` (all its ranks).

    Args:
        averaged_over: The mesh the gradient mean runs over (any number of dims), or ``None``.

    Returns:
        ``float(mesh.size())`` (``1.0`` for ``None``).
    """
    return 1.0 if averaged_over is None else float(averaged_over.size())


def sync_grads(
    module: nn.Module | Iterable[torch.nn.Parameter], cp_mesh: DeviceMesh | None
) -> None:
    """Sum every parameter gradient over the CP group (in place): the CP half of a grad sync.

    Each CP rank's backward gives the gradient of its partial loss; the full gradient is their
    sum. DTensor gradients (FSDP2 shards over a ``dp`` mesh) reduce their local shards, so use it
    after ``loss.backward()`` with ``fully_shard(model, mesh=mesh["dp"])``. Gradients are
    coalesced into one all-reduce per dtype. A parameter whose gradient is ``None`` on some CP
    ranks but not others gets a zero gradient first (one small all-reduce learns which), so every
    rank steps the same parameters. Without CP (``None`` or a size-1 mesh) this is a no-op.

    Call it once per optimizer step, after the last backward: accumulating over micro-batches
    (several ``backward()`` calls, then one ``sync_grads``) is the same sum. Checked (see
    :mod:`cpshard.guards.step`): a second call with no CP backward since the last one raises; a
    mesh other than the one ``module`` was prepared on (e.g. the dp mesh) raises; a new step
    prepared without a sync after an optimizer step shows as parameters that differ across the
    CP ranks at the next :func:`cpshard.prepare_cp_forward` (compared unless it is given
    ``check_consistency=False``, which reads no values and so catches no forgotten sync);
    gradients that no CP forward made (a forward outside ``ctx()``, a model never run under CP)
    raise on every rank; a rank that skips the call while its peers make it raises together with
    them. Two models sharing a
    module, each synced: the shared gradients are summed once (the second sync skips gradients
    the first summed, unchanged since). Not detectable: averaging instead of summing under
    a scale-invariant optimizer (AdamW hides it from the loss); ``cpshard parity`` compares the
    gradients with a cp=1 run and shows it.

    Args:
        module: A module, or an iterable of its parameters.
        cp_mesh: The 1-D CP mesh, or ``None``, or the 2-D ``("cp_outer", "cp_inner")`` CP mesh
            given to ``prepare_cp_forward``: it sums over the mesh's flattening, the CP group the
            batch was sharded over (the same as passing the sharder's ``cp_mesh``).

    Raises:
        TypeError, ValueError: ``cp_mesh`` is neither a 1-D nor a 2-D CP mesh, does not contain
            this rank, or is not the mesh ``module`` was prepared on; the CP ranks' trainable
            parameters differ.
        RuntimeError: no CP backward since the last sync, gradients no CP forward made, this
            rank left its step midway, or the CP ranks are in different phases of their step.
    """
    mesh = _comm.validate_cp_mesh(cp_mesh, grid=True)
    if mesh is not None:
        _check_member(mesh, "sync_grads")
    # a 2-D CP mesh: its flattening, which the prepare shards over (torch caches it: one mesh)
    mesh, _ = _comm.split_cp_mesh(mesh)
    group = _comm.cp_group(mesh)
    named = (
        list(module.named_parameters())
        if isinstance(module, nn.Module)
        else [(str(i), p) for i, p in enumerate(module)]
    )
    state = step_state(mesh)
    trainable = [(n, p) for n, p in named if p.requires_grad]
    done = begin_sync(
        state,
        mesh,
        trainable,
        prepared_on=prepared_mesh(module) if isinstance(module, nn.Module) else None,
    )
    if group is None:
        return
    params = [p for _, p in trainable]
    with torch.no_grad():
        # per parameter: how many ranks hold a gradient to sum, and how many hold one an earlier
        # sync on this group already summed (a module shared by two models, each synced)
        flags = torch.tensor(
            [
                [p.grad is not None and not d for p, d in zip(params, done, strict=True)],
                done,
            ],
            dtype=torch.int32,
        ).reshape(2, len(params))
        _comm.all_reduce_sum_(flags, group)
        fresh, summed = flags.tolist()
        size = _comm.cp_rank_and_size(mesh)[1]
        mixed = [n for (n, _), s in zip(trainable, summed, strict=True) if 0 < s < size]
        if mixed:  # every rank saw the same flags: every rank raises here
            raise RuntimeError(
                f"sync_grads: the gradient of {mixed[0]!r} (and {len(mixed) - 1} more) was "
                "already summed by an earlier sync_grads on some CP ranks but not on others (a "
                "backward or zero_grad that ran on some ranks only): the CP ranks' gradients "
                "no longer belong to one step. Run every backward, zero_grad and sync_grads on "
                "every CP rank alike"
            )
        grads = []
        for p, h, s in zip(params, fresh, summed, strict=True):
            if h == 0 or s:
                continue
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            g = p.grad
            grads.append(g.to_local() if isinstance(g, DTensor) else g)
        _comm.all_reduce_sum_coalesced_(grads, group)
    end_sync(
        state, params, [s == 0 for s in summed], module if isinstance(module, nn.Module) else None
    )


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


def reduce_for_logging(
    partial: torch.Tensor, mesh: DeviceMesh | None, *, scale: float = 1.0
) -> torch.Tensor:
    """The true global loss for logging: partial losses summed over ``mesh``, divided by ``scale``.

    Args:
        partial: This rank's partial loss (e.g. from :func:`cp_cross_entropy`).
        mesh: The ranks whose partials make up the loss: the CP mesh, or the 2-D ``dp x cp``
            mesh when the loss was normalised by the token count over ``dp x cp``.
        scale: The ``scale`` the partial losses were multiplied by (undone here).

    Returns:
        A detached scalar tensor, the same on every rank of ``mesh``.
    """
    if mesh is not None:
        _check_member(mesh, "reduce_for_logging")
    out = partial.detach().clone()
    return _comm.all_reduce_sum_mesh_(out, mesh) / scale
