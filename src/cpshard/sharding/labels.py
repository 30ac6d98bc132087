"""Label shifting on the *global* sequence, before sharding.

Labels are pre-shifted by the caller (``labels[t]`` is the target of input ``t``): after CP
sharding, the next token of a local token usually lives on another rank, so the shift must happen
while every rank still holds the whole sequence.

Import rule: :mod:`cpshard.layouts` only (like all of :mod:`cpshard.sharding`, never
:mod:`cpshard.attention`, :mod:`cpshard.dispatch`, :mod:`cpshard.tools`, :mod:`cpshard.cli` or
:mod:`cpshard.models`).
"""

from __future__ import annotations

import torch

from cpshard.layouts.documents import PackSpec

__all__ = ["shift_labels", "shift_labels_packed"]


def shift_labels(
    input_ids: torch.Tensor,
    *,
    ignore_index: int = -100,
    padding_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Next-token targets of a dense batch: ``labels[:, t] = input_ids[:, t + 1]``.

    Args:
        input_ids: LongTensor ``[B, S]`` (or labels to shift), global order.
        ignore_index: Target of the last token, and of tokens whose next token is a pad.
        padding_mask: Optional BoolTensor ``[B, S]``, ``True`` = pad. Pads get ``ignore_index``
            and so does a real token followed by a pad.

    Returns:
        LongTensor ``[B, S]``; a new tensor (the input is not modified).

    Example:
        >>> shift_labels(torch.tensor([[5, 6, 7]])).tolist()
        [[6, 7, -100]]
    """
    if input_ids.dim() != 2:
        raise ValueError(
            f"shift_labels expects [B, S] token ids, got shape {tuple(input_ids.shape)}"
        )
    out = torch.full_like(input_ids, ignore_index)
    out[:, :-1] = input_ids[:, 1:]
    if padding_mask is not None:
        if padding_mask.shape != input_ids.shape:
            raise ValueError(
                f"padding_mask shape {tuple(padding_mask.shape)} must equal input_ids shape "
                f"{tuple(input_ids.shape)}"
            )
        pad = padding_mask.bool()
        nxt_pad = torch.ones_like(pad)
        nxt_pad[:, :-1] = pad[:, 1:]
        out = out.masked_fill(pad | nxt_pad, ignore_index)
    return out


def shift_labels_packed(
    labels: torch.Tensor, spec: PackSpec, ignore_index: int = -100
) -> torch.Tensor:
    """Shift labels (or input ids) left by one inside each document, on the global batch.

    ``out[b, s] = labels[b, s + 1]`` when tokens ``s`` and ``s + 1`` belong to the same
    document; the last token of every document and every pad get ``ignore_index``. Call it before
    sharding: after sharding, neighbours may live on other ranks.

    Args:
        labels: Tensor ``[B, S]`` (e.g. ``input_ids``), caller coordinates.
        spec: Document structure of the batch, ``spec.num_rows == B``, ``spec.row_len == S``.
        ignore_index: Target value that the loss ignores.

    Returns:
        Tensor ``[B, S]`` of ``labels``' dtype and device; the input is not modified.
    """
    if labels.dim() != 2 or tuple(labels.shape) != (spec.num_rows, spec.row_len):
        raise ValueError(
            f"labels: must be [B, S] = [{spec.num_rows}, {spec.row_len}] to match the pack spec; "
            f"got shape {tuple(labels.shape)}. Fix: pass the unsharded [B, S] tensor"
        )
    doc = spec.document_ids().to(labels.device)
    same = (doc[:, 1:] == doc[:, :-1]) & (doc[:, :-1] >= 0)
    out = torch.full_like(labels, ignore_index)
    out[:, :-1] = torch.where(same, labels[:, 1:], out[:, :-1])
    return out
