"""Where each token of the CP stream sits when a mixer runs over whole documents in global order.

A token mixer outside attention (a scan, a causal convolution) must see every token of its
document, in global order, and nothing of other documents. The generic path gathers the local
inputs of all ranks (the *stream*: rank 0's tokens, then rank 1's, ...) and lays them out as a
batch of *segments*: one row per document of each batch row (a run of equal document ids in
global position order; a run of pad tokens is one segment of its own), right-padded with zero
rows to the longest segment. A causal mixer run over that batch gives every document exactly
what it gives the document alone (right padding never reaches earlier outputs), and no state or
convolution crosses a document boundary.

:func:`segment_plan` computes the two index maps from the token meta once per batch (host work,
no collective).

Import rules: the rows of ``RULES`` in tests/unit/test_architecture.py that cover this module.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from cpshard.sharding.meta import TokenMeta

__all__ = ["SegmentPlan", "segment_plan"]


@dataclass(frozen=True)
class SegmentPlan:
    """Index maps between the gathered stream and the batch of segments.

    Attributes:
        source: LongTensor ``[N, T]``: for each segment row and offset, the flat index
            ``b * C * L + s`` of the stream token it holds (``b`` batch row, ``s`` stream slot),
            or ``B * C * L`` (a zero row) past the segment's end.
        local: LongTensor ``[B, L]``: for each of this rank's local tokens, its flat index
            ``n * T + t`` in the segment batch.
        lengths: LongTensor ``[N]``: tokens of each segment.
        trivial: Every batch row is one segment already in stream order (cp = 1, one document
            per row, no pads): the mixer can run on the local rows as they are.
    """

    source: torch.Tensor
    local: torch.Tensor
    lengths: torch.Tensor
    trivial: bool

    @property
    def num_segments(self) -> int:
        """Rows ``N`` of the segment batch."""
        return int(self.source.shape[0])

    @property
    def max_len(self) -> int:
        """Columns ``T`` of the segment batch (the longest segment)."""
        return int(self.source.shape[1])


def segment_plan(meta: TokenMeta, rows: int, device: torch.device) -> SegmentPlan:
    """The segment layout of a batch of ``rows`` rows under ``meta``.

    Args:
        meta: Token meta of the sharded batch (positions and document ids of the stream,
            ``[1 or B, C * L]``).
        rows: Batch rows ``B`` of the mixer's input.
        device: Device of the index tensors.

    Returns:
        The :class:`SegmentPlan`.

    Raises:
        ValueError: ``meta`` has per-row facts for another number of rows than ``rows``.
    """
    pos, doc = meta.positions, meta.document_ids
    if pos.shape[0] not in (1, rows):
        raise ValueError(
            f"the mixer's input has {rows} batch rows but the CP token meta describes "
            f"{pos.shape[0]}: a token mixer outside attention must get the sharded batch's rows"
        )
    stream = pos.shape[-1]
    pos = pos.to("cpu").expand(rows, stream)
    doc = doc.to("cpu").expand(rows, stream)
    order = torch.argsort(pos, dim=1, stable=True)  # stream slots in global order, per row
    key = torch.where(doc < 0, torch.full_like(doc, -1), doc).gather(1, order)
    starts = torch.ones_like(key, dtype=torch.bool)
    starts[:, 1:] = key[:, 1:] != key[:, :-1]
    flat_starts = starts.reshape(-1)
    seg_id = torch.cumsum(flat_starts.long(), 0) - 1  # [B * stream]
    num = int(seg_id[-1].item()) + 1 if seg_id.numel() else 0
    first = torch.nonzero(flat_starts).reshape(-1)  # flat index where each segment starts
    lengths = torch.diff(torch.cat([first, torch.tensor([flat_starts.numel()])]))
    offset = torch.arange(flat_starts.numel()) - first[seg_id]
    width = int(lengths.max().item()) if num else 0
    grid = seg_id * width + offset  # flat segment-batch index, per (row, sorted slot)
    src_flat = (order + torch.arange(rows).unsqueeze(1) * stream).reshape(-1)
    source = torch.full((num * width,), rows * stream, dtype=torch.long)
    source[grid] = src_flat
    by_slot = torch.empty_like(grid)
    by_slot[src_flat] = grid  # flat (row, stream slot) -> segment-batch index
    n = meta.local_len
    local = by_slot.reshape(rows, stream)[:, meta.rank * n : (meta.rank + 1) * n]
    trivial = (
        meta.world_size == 1
        and num == rows
        and bool(torch.equal(order, torch.arange(stream).expand(rows, stream)))
    )
    return SegmentPlan(
        source.reshape(num, width).to(device),
        local.contiguous().to(device),
        lengths.to(device),
        trivial,
    )
