"""Label shifting on the *global* sequence, before sharding.

Labels are pre-shifted by the caller (``labels[t]`` is the target of input ``t``): after CP
sharding, the next token of a local token usually lives on another rank, so the shift must happen
while every rank still holds the whole sequence.
"""

from __future__ import annotations

import torch

__all__ = ["shift_labels"]


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
