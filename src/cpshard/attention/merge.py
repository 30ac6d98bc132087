"""Online-softmax merge math for blockwise attention.

A block of keys gives each query a partial output ``o_b`` (softmax-normalised over that block
only) and the block's log-sum-exp ``lse_b`` of the scaled scores (natural log). Two blocks merge
exactly:

    lse = logaddexp(lse_a, lse_b)
    o   = o_a * exp(lse_a - lse) + o_b * exp(lse_b - lse)

The form above never exponentiates a positive number, so it cannot overflow. An *empty* block (no
visible key for a query) carries ``lse = -inf`` and must get weight ``0``; when both sides are empty
the naive form computes ``exp(-inf - -inf) = nan``. :func:`merge` handles that case explicitly.

All math here runs in the accumulation dtype (fp32, or fp64 for fp64 inputs): callers pass
accumulators in that dtype and partial results in any floating dtype.

Import rules: the rows of ``RULES`` in tests/unit/test_architecture.py that cover this module.
"""

from __future__ import annotations

import torch

__all__ = ["accumulation_dtype", "add_sinks", "empty_partial", "merge", "merge_into", "sink_grad"]


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """Dtype in which blockwise results are merged: fp64 stays fp64, everything else fp32.

    Args:
        dtype: The dtype of the attention inputs.

    Returns:
        ``torch.float64`` for fp64 inputs, ``torch.float32`` otherwise.
    """
    return torch.float64 if dtype == torch.float64 else torch.float32


def empty_partial(
    shape: tuple[int, ...], dtype: torch.dtype, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """The neutral element of :func:`merge`: output ``0`` and ``lse = -inf``.

    Args:
        shape: Output shape ``[B, H, L, D]``.
        dtype: Accumulation dtype.
        device: Device.

    Returns:
        ``(out [B, H, L, D], lse [B, H, L])``.
    """
    out = torch.zeros(shape, dtype=dtype, device=device)
    lse = torch.full(shape[:-1], float("-inf"), dtype=dtype, device=device)
    return out, lse


def _weights(
    lse_a: torch.Tensor, lse_b: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    lse = torch.logaddexp(lse_a, lse_b)
    # Rows where both sides are empty: lse is -inf and both weights would be nan; make them 0.
    both_empty = torch.isneginf(lse)
    safe = torch.where(both_empty, torch.zeros_like(lse), lse)
    w_a = torch.exp(lse_a - safe)
    w_b = torch.exp(lse_b - safe)
    return lse, w_a, w_b


def merge(
    out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge two partial attention results over disjoint key sets.

    Args:
        out_a: ``[B, H, L, D]`` partial output of key set A (any float dtype).
        lse_a: ``[B, H, L]`` log-sum-exp of key set A; ``-inf`` where A is empty for a query.
        out_b: ``[B, H, L, D]`` partial output of key set B.
        lse_b: ``[B, H, L]`` log-sum-exp of key set B.

    Returns:
        ``(out [B, H, L, D], lse [B, H, L])`` over A ∪ B, in the promoted dtype of the ``lse``
        inputs (pass fp32/fp64 ``lse`` to get fp32/fp64 accumulation). Rows empty in both stay
        ``out = 0, lse = -inf``; no nan is produced.
    """
    acc = torch.promote_types(lse_a.dtype, lse_b.dtype)
    lse_a = lse_a.to(acc)
    lse_b = lse_b.to(acc)
    lse, w_a, w_b = _weights(lse_a, lse_b)
    out = out_a.to(acc) * w_a.unsqueeze(-1) + out_b.to(acc) * w_b.unsqueeze(-1)
    return out, lse


def merge_into(
    out_acc: torch.Tensor, lse_acc: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor
) -> None:
    """In-place :func:`merge` of a partial result into accumulators.

    Args:
        out_acc: ``[B, H, L, D]`` accumulator (fp32/fp64), updated in place. May be a view.
        lse_acc: ``[B, H, L]`` accumulator in the same dtype, updated in place. May be a view.
        out_b: ``[B, H, L, D]`` partial output to add (any float dtype).
        lse_b: ``[B, H, L]`` its log-sum-exp, ``-inf`` where empty.
    """
    lse, w_a, w_b = _weights(lse_acc, lse_b.to(lse_acc.dtype))
    out_acc.mul_(w_a.unsqueeze(-1)).add_(out_b.to(out_acc.dtype) * w_b.unsqueeze(-1))
    lse_acc.copy_(lse)


def add_sinks(out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor) -> None:
    """Merge per-head attention sinks into a *final* partial result, in place.

    A sink is one extra logit per head in the softmax denominator whose value row is zero
    (gpt-oss ``s_aux``): ``p_ij = exp(s_ij) / (exp(sink_h) + sum_j' exp(s_ij'))``. It is the
    partial ``(out = 0, lse = sink_h)``, merged once after every key block has been merged.

    Args:
        out: ``[B, H, L, D]`` merged output over every key (accumulation dtype), updated.
        lse: ``[B, H, L]`` its log-sum-exp (``-inf`` where no key is visible), updated to
            include the sink.
        sinks: ``[H]`` sink logits of these heads.
    """
    s = sinks.detach().to(lse.dtype).view(1, -1, 1).expand_as(lse)
    total = torch.logaddexp(lse, s)  # finite: a sink is finite
    out.mul_(torch.exp(lse - total).unsqueeze(-1))
    lse.copy_(total)


def sink_grad(
    grad_out: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor
) -> torch.Tensor:
    """Gradient of the sink logits: ``-sum_{b,i} exp(sink_h - lse_i) * <dO_i, O_i>``.

    The q/k/v gradients need no change: given the output and LSE *with* the sink, the usual
    flash backward is exact (the sink's value row is zero).

    Args:
        grad_out: ``[B, H, L, D]`` upstream gradient of these queries.
        out: ``[B, H, L, D]`` output with the sink.
        lse: ``[B, H, L]`` log-sum-exp with the sink.
        sinks: ``[H]`` sink logits.

    Returns:
        ``[H]`` in ``sinks``' dtype: this rank's queries' share (CP sums it like any parameter
        gradient).
    """
    acc = lse.dtype
    row = (grad_out.to(acc) * out.to(acc)).sum(-1)
    p = torch.exp(sinks.detach().to(acc).view(1, -1, 1) - lse)
    return (-(p * row).sum(dim=(0, 2))).to(sinks.dtype)
