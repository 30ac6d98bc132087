"""Caller coordinates <-> the padded global stream: the one place that maps between them.

A layout shards a *padded global stream* of ``P`` tokens. The caller addresses tokens in its
own coordinates, which a shard describes with :class:`CallerCoordinates`:

* the padded length ``P`` itself (``[..., P, ...]`` on the sequence dim);
* the original length ``S <= P`` of dense rows (CP padding appended at the end: the padded slots
  need an explicit ``fill``);
* the pre-flatten row shape ``[B, S, ...]`` of a layout that flattened the rows into one stream by
  a pure reshape (``input_row_shape`` and no input positions);
* input positions ``[B, S]`` for layouts that reposition tokens (packed documents, a model's own
  layout): the stream slot of every caller token, ``-1`` for a slot the layout dropped.

:func:`positions_to_stream` and :func:`stream_to_positions` are the two directions of the input
position map (used by :class:`~cpshard.layouts.packed.PackedPlan` and by the sharder's token
verbs); :meth:`CallerCoordinates.to_stream` and :meth:`CallerCoordinates.from_stream` choose the
coordinate system of a tensor from its shape, never ambiguously: a length that maps to no
captured coordinate raises ``ValueError`` naming the ones that would.

Import rules: the rows of ``RULES`` in tests/unit/test_architecture.py that cover this module.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from cpshard.layouts.deferred import DeferredField

__all__ = ["CallerCoordinates", "positions_to_stream", "stream_to_positions"]

Fill = float | int | bool


def positions_to_stream(
    x: torch.Tensor, positions: torch.Tensor, padded_len: int, fill: Fill
) -> torch.Tensor:
    """Scatter caller tokens into the padded stream (differentiable, never a view of ``x``).

    Args:
        x: ``[B, S, *F]`` in caller coordinates.
        positions: LongTensor ``[B, S]``: stream slot of each caller token, ``-1`` = dropped;
            injective on its non-negative entries.
        padded_len: ``P``.
        fill: Value of the stream slots no caller token maps to.

    Returns:
        ``[P, *F]``.
    """
    pos = positions.to(x.device)
    valid = pos >= 0
    out = x.new_full((padded_len, *x.shape[2:]), fill)
    return out.index_put((pos[valid],), x[valid])


def stream_to_positions(stream: torch.Tensor, positions: torch.Tensor, fill: Fill) -> torch.Tensor:
    """Gather caller tokens back from the padded stream (differentiable).

    Args:
        stream: ``[P, *F]``.
        positions: LongTensor ``[B, S]`` as in :func:`positions_to_stream`.
        fill: Value of the caller slots whose token the layout dropped.

    Returns:
        ``[B, S, *F]``.
    """
    pos = positions.to(stream.device)
    picked = stream.index_select(0, pos.clamp(min=0).reshape(-1))
    picked = picked.reshape(*pos.shape, *stream.shape[1:])
    dropped = (pos < 0).reshape(*pos.shape, *([1] * (stream.dim() - 1)))
    return picked.masked_fill(dropped, fill)


@dataclass(frozen=True)
class CallerCoordinates:
    """The caller's coordinates of one shard (see the module docstring).

    Attributes:
        original_seq_len: Caller's sequence length before CP padding (``None`` when there is no
            single one, e.g. packed rows addressed by input positions).
        padded_seq_len: ``P``, length of the padded global stream (``None`` before any shard).
        input_row_shape: ``(B, S)`` of the caller's rows when a layout flattened them into one
            stream. Without input positions the flattening is a pure reshape (row ``b``, column
            ``s`` is stream slot ``b * S + s``); with them, the positions are the map.
        input_token_stream_positions: LongTensor ``[B, S]``: stream slot of each caller token for
            layouts that reposition tokens; ``-1`` = dropped pad slot. Given as a value or a
            :class:`~cpshard.layouts.deferred.Deferred` maker (a packed plan's: made on first
            read, which a prepare does not do).
    """

    original_seq_len: int | None
    padded_seq_len: int | None
    input_row_shape: tuple[int, ...] | None = None
    # a value or a Deferred maker, read as the value (cpshard.layouts.deferred)
    input_token_stream_positions: torch.Tensor | None = DeferredField(default=None)  # type: ignore[assignment]  # noqa: RUF009

    def to_stream(
        self, t: torch.Tensor, seq_dim: int, fill: Fill | None, layout: str = "custom"
    ) -> tuple[torch.Tensor, int]:
        """A caller-coordinate tensor on the padded stream.

        Args:
            t: ``[..., P, ...]``, ``[..., S, ...]`` (needs ``fill``), ``[B, S, *F]`` in input
                positions (needs ``fill``) or in the row shape of a flattening layout.
            seq_dim: Non-negative sequence dim of ``t`` (ignored for input positions and row
                shapes).
            fill: Value of the padded slots.
            layout: Label named in errors.

        Returns:
            ``(stream, dim)``: ``stream`` has ``P`` tokens on ``dim`` (``t`` itself when it
            already had them; input positions and row shapes give ``[1, P, *F]`` with
            ``dim = 1``).

        Raises:
            ValueError: a coordinate that needs ``fill`` without one, or a length that maps to
                no captured coordinate.
        """
        positions = self.input_token_stream_positions
        if positions is not None and tuple(t.shape[:2]) == tuple(positions.shape):
            if fill is None:
                raise ValueError(
                    "sharding a tensor in input coordinates "
                    f"{tuple(positions.shape)} on a layout that repositions tokens "
                    f"(layout={layout!r}) requires `fill` for the padded slots; pass e.g. "
                    "fill=0"
                )
            assert self.padded_seq_len is not None
            return positions_to_stream(t, positions, self.padded_seq_len, fill).unsqueeze(0), 1
        row = self.input_row_shape
        if row is not None and tuple(t.shape[: len(row)]) == tuple(row):
            t = t.reshape(1, math.prod(row), *t.shape[len(row) :])
            seq_dim = 1
        length = t.shape[seq_dim]
        padded = self.padded_seq_len
        if padded is None or length == padded:
            return t, seq_dim
        if length == self.original_seq_len and fill is not None:
            pad_shape = list(t.shape)
            pad_shape[seq_dim] = padded - length
            return torch.cat([t, t.new_full(pad_shape, fill)], dim=seq_dim), seq_dim
        accepted = [f"padded_seq_len={padded}"]
        if self.original_seq_len is not None and self.original_seq_len != padded:
            accepted.append(f"original_seq_len={self.original_seq_len} (with `fill`)")
        if row is not None:
            accepted.append(f"leading row shape {tuple(row)}")
        if positions is not None:
            accepted.append(f"input positions shape {tuple(positions.shape)} (with `fill`)")
        hint = (
            " An original-length tensor needs an explicit `fill` for the padded slots."
            if length == self.original_seq_len
            else ""
        )
        raise ValueError(
            f"this sharder last sharded a batch with {', '.join(accepted)}; got a tensor of "
            f"shape {tuple(t.shape)} whose length on dim {seq_dim} is {length}.{hint} Pass a "
            "tensor in one of those coordinates, or pre-pad it yourself."
        )

    def check_from_stream(
        self, shape: tuple[int, ...], seq_dim: int, fill: Fill | None, layout: str = "custom"
    ) -> None:
        """Raise unless a local shard of ``shape`` can be trimmed (checked before any collective).

        Raises:
            ValueError: no caller coordinates captured; input positions without ``fill``, or a
                shard that is not ``[1, L, ...]`` on ``seq_dim=1`` for input positions.
        """
        if self.input_token_stream_positions is None:
            if self.input_row_shape is None and self.original_seq_len is None:
                raise ValueError(
                    f"this sharder (layout={layout!r}) captured no caller coordinates to trim "
                    "to; gather with trim=False, or shard a batch first"
                )
            return
        if fill is None:
            raise ValueError(
                "trimming to input coordinates on a layout that repositions tokens "
                f"(layout={layout!r}) requires `fill` for dropped slots; pass e.g. fill=0"
            )
        if seq_dim != 1 or shape[0] != 1:
            raise ValueError(
                "trimming to input coordinates needs a local [1, L, ...] stream shard "
                f"(seq_dim=1), got shape {shape} with seq_dim={seq_dim}; gather the "
                "tensor the way the batch was sharded, or use trim=False"
            )

    def from_stream(
        self, full: torch.Tensor, seq_dim: int, fill: Fill | None, layout: str = "custom"
    ) -> torch.Tensor:
        """The padded stream back in the caller's coordinates (input positions, else row shape,
        else original length).

        Args:
            full: ``[..., P, ...]`` (``[1, P, *F]`` with ``seq_dim = 1`` for input positions, see
                :meth:`check_from_stream`).
            seq_dim: Non-negative sequence dim of ``full``.
            fill: Value of dropped caller slots (input positions only).
            layout: Label named in errors.

        Raises:
            ValueError: as :meth:`check_from_stream`.
        """
        self.check_from_stream(tuple(full.shape), seq_dim, fill, layout)
        positions = self.input_token_stream_positions
        if positions is not None:
            assert fill is not None
            return stream_to_positions(full.select(0, 0), positions, fill)
        row = self.input_row_shape
        if row is not None:
            n = math.prod(row)
            return full.narrow(seq_dim, 0, n).reshape(*row, *full.shape[seq_dim + 1 :])
        assert self.original_seq_len is not None
        return full.narrow(seq_dim, 0, self.original_seq_len)
