"""The token gather's one collective: the cross-rank check rides in the data all-gather.

Every rank sends one buffer of ``HEADER_BYTES + slot`` bytes: a header (the int64 descriptor of
the call: type, dtype, shape, ``seq_dim``, ``trim``, ``fill``, ``grad``), then its payload when
the payload fits the slot. The slot size is one every rank agrees on without communicating: the
byte size of the previous gather of the same sharder (or the seed chosen at shard time), so the
collective's size can never differ between ranks, even when their tensors do. When the headers
agree and the payload fit, that one collective *is* the gather; when the payload is larger (a new
shape), a second, exact all-gather follows and the slot grows to it. A mismatch raises the same
``ValueError`` on every rank (every rank holds every header).

Differentiable: the backward of the payload is the adjoint of the all-gather (a reduce-scatter,
``grad="sum"``) or this rank's own slice (``"replicated"``), as for
:func:`cpshard._comm.all_gather_dim0`.

Import rules: the rows of ``RULES`` in tests/unit/test_architecture.py that cover this module.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed import ProcessGroup

from cpshard import _comm

__all__ = ["HEADER_BYTES", "gather_with_header", "slot_bytes"]

HEADER_BYTES = 128
"""Bytes of the header: up to 16 int64 values (a multiple of 16, so every dtype stays aligned)."""


def slot_bytes(nbytes: int) -> int:
    """The slot a payload of ``nbytes`` needs: rounded up to 16 bytes (dtype alignment)."""
    return (nbytes + 15) // 16 * 16


class _HeaderGather(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        t: torch.Tensor,
        header: torch.Tensor,
        group: ProcessGroup,
        slot: int,
        with_payload: bool,
        grad_mode: str,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        world = _comm.group_rank_and_size(group)[1]
        buf = torch.empty(HEADER_BYTES + slot, dtype=torch.uint8, device=header.device)
        raw = header.to(torch.long).reshape(-1).view(torch.uint8)
        buf[: raw.numel()] = raw
        n = t.numel() * t.element_size() if with_payload else 0
        buf[raw.numel() : HEADER_BYTES].zero_()
        buf[HEADER_BYTES + n :].zero_()  # only the unused tail of the slot
        if n:
            buf[HEADER_BYTES : HEADER_BYTES + n] = (
                t.detach().contiguous().reshape(-1).view(torch.uint8)
            )
        got = _comm.all_gather_stacked(buf, group)  # [C, HEADER_BYTES + slot]
        headers = got[:, :HEADER_BYTES].contiguous().view(torch.long)
        if with_payload:
            payload = got[:, HEADER_BYTES : HEADER_BYTES + n].view(t.dtype).reshape(world, *t.shape)
        else:
            payload = t.new_empty((world, *t.shape))
        ctx.group, ctx.grad_mode, ctx.with_payload = group, grad_mode, with_payload
        ctx.mark_non_differentiable(headers)
        return payload, headers

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor | None, _: Any) -> tuple[torch.Tensor | None, ...]:
        if grad is None or not ctx.with_payload:
            return (None,) * 6
        group: ProcessGroup = ctx.group
        if ctx.grad_mode == "replicated":
            rank = _comm.group_rank_and_size(group)[0]
            return (grad[rank].contiguous(), *([None] * 5))
        return (_comm.reduce_scatter_stacked(grad.contiguous(), group), *([None] * 5))


def gather_with_header(
    t: object,
    header: list[int],
    group: ProcessGroup,
    slot: int,
    grad_mode: str,
    device: torch.device,
) -> tuple[torch.Tensor | None, list[list[int]]]:
    """One all-gather of ``header`` + ``t``'s bytes (when they fit ``slot``).

    Args:
        t: The rank's local tensor (anything else sends the header alone).
        header: At most ``HEADER_BYTES / 8`` int64 values describing the call.
        group: The CP process group.
        slot: Payload bytes of the buffer, the same on every rank (a multiple of 16).
        grad_mode: ``"sum"`` or ``"replicated"`` (the payload's backward).
        device: Device of the buffer when ``t`` is not a tensor.

    Returns:
        ``(stacked, headers)``: ``[C, *t.shape]`` (every rank's payload, differentiable) or
        ``None`` when the payload did not fit; every rank's header, rank order.
    """
    if len(header) * 8 > HEADER_BYTES:
        raise ValueError(f"a header holds at most {HEADER_BYTES // 8} values, got {len(header)}")
    is_tensor = isinstance(t, torch.Tensor) and t.device.type != "meta"
    tensor = t if is_tensor else torch.zeros(0, device=device)
    assert isinstance(tensor, torch.Tensor)
    fits = is_tensor and tensor.numel() * tensor.element_size() <= slot
    head = torch.tensor(header, dtype=torch.long, device=tensor.device)
    payload, headers = _HeaderGather.apply(  # type: ignore[no-untyped-call]
        tensor, head, group, slot, fits, grad_mode
    )
    return (payload if fits else None), headers.cpu().tolist()
