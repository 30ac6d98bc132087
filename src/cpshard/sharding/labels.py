"""Label shifting on the *global* sequence, before sharding.

Labels are pre-shifted by the caller (``labels[t]`` is the target of input ``t``): after CP
sharding, the next token of a local token usually lives on another rank, so the shift must happen
while every rank still holds the whole sequence.

Import rules: the rows of ``RULES`` in tests/unit/test_architecture.py that cover this module.
"""

from __future__ import annotations

from collections.abc import Sequence

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
    labels: torch.Tensor,
    spec: PackSpec | Sequence[Sequence[int]] | Sequence[int] | torch.Tensor | None = None,
    ignore_index: int = -100,
    *,
    seq_lens: Sequence[Sequence[int]] | Sequence[int] | torch.Tensor | None = None,
    cu_seqlens: Sequence[int] | torch.Tensor | None = None,
    position_ids: torch.Tensor | None = None,
    padding_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Shift labels (or input ids) left by one inside each document, on the global batch.

    ``out[b, s] = labels[b, s + 1]`` when tokens ``s`` and ``s + 1`` belong to the same
    document; the last token of every document and every pad get ``ignore_index``. Call it before
    sharding: after sharding, neighbours may live on other ranks.

    The documents are given as the batch gives them (exactly one spelling): a
    :class:`~cpshard.layouts.documents.PackSpec` or per-row ``seq_lens`` (second argument or
    keyword), ``cu_seqlens`` offsets of a ``[1, T]`` stream, or ``position_ids`` (a document
    starts wherever they do not step by +1, as transformers reads them; with an optional
    ``padding_mask``, ``True`` = pad).

    Args:
        labels: Tensor ``[B, S]`` (e.g. ``input_ids``), caller coordinates.
        spec: A ``PackSpec`` (``spec.num_rows == B``, ``spec.row_len == S``), or ``seq_lens``:
            per-row document lengths (lists or an int tensor; a flat list is one row).
        ignore_index: Target value that the loss ignores.
        seq_lens: Per-row document lengths (keyword spelling of ``spec``).
        cu_seqlens: Offsets ``[D + 1]`` (list or tensor) of one ``[1, T]`` stream (``B == 1``).
        position_ids: ``[B, S]`` per-document positions.
        padding_mask: ``[B, S]`` bool (``True`` = pad, a row suffix), with ``position_ids``.

    Returns:
        Tensor ``[B, S]`` of ``labels``' dtype and device; the input is not modified.

    Raises:
        ValueError: ``labels`` is not ``[B, S]``, not exactly one spelling of the documents, or
            documents that do not fit ``[B, S]``.

    Example:
        >>> shift_labels_packed(torch.tensor([[5, 6, 7, 8, 9]]), [[3, 2]]).tolist()
        [[6, 7, -100, 9, -100]]
    """
    if labels.dim() != 2:
        raise ValueError(
            f"labels: must be [B, S]; got shape {tuple(labels.shape)}. Fix: pass the unsharded "
            "[B, S] tensor"
        )
    if isinstance(spec, PackSpec) or spec is None:
        pack_spec = spec
    else:  # a positional seq_lens
        if seq_lens is not None:
            raise ValueError(
                "documents: seq_lens given twice (second argument and seq_lens=); pass one"
            )
        pack_spec, seq_lens = None, spec
    if pack_spec is not None and tuple(labels.shape) != (pack_spec.num_rows, pack_spec.row_len):
        raise ValueError(
            f"labels: must be [B, S] = [{pack_spec.num_rows}, {pack_spec.row_len}] to match the "
            f"pack spec; got shape {tuple(labels.shape)}. Fix: pass the unsharded [B, S] tensor"
        )
    resolved = PackSpec.from_documents(
        (labels.shape[0], labels.shape[1]),
        spec=pack_spec,
        seq_lens=seq_lens,
        cu_seqlens=cu_seqlens,
        position_ids=position_ids,
        padding_mask=padding_mask,
    )
    doc = resolved.document_ids().to(labels.device)
    same = (doc[:, 1:] == doc[:, :-1]) & (doc[:, :-1] >= 0)
    out = torch.full_like(labels, ignore_index)
    out[:, :-1] = torch.where(same, labels[:, 1:], out[:, :-1])
    return out
