"""Index math for the closed-form CP layouts. No process group is touched here.

Owns ``none``, ``contiguous`` and ``round_robin`` (:class:`ClosedFormLayout` and its local index
functions).

A *layout* says which tokens of the padded global stream each CP rank owns, in which local
order. Everything else (sharding, gathering, attention masks) derives from that map:

* the forward map ``local_indices(rank)``: global position of every local token, local order;
* the stream order ``concat_r local_indices(r)``: what an all-gather of the local shards yields;
* its inverse permutation, which turns an all-gathered tensor back into global order.

Closed-form layouts (``none``, ``contiguous``, ``round_robin``) are defined here. Data-dependent
layouts (``packed``, ``balanced``) capture an explicit ``[C, L]`` map at shard time and reuse the
same helpers (:func:`~cpshard.layouts.index.inverse_permutation`,
:func:`~cpshard.layouts.index.check_rank_map`).

Diagrams for C=2 ranks, padded length P=8 (``a`` = rank 0, ``b`` = rank 1)::

    contiguous    a a a a b b b b     r0 [0,1,2,3]  r1 [4,5,6,7]
    round_robin   a a b b b b a a     r0 [0,1,6,7]  r1 [2,3,4,5]

``round_robin`` is torch's head-tail load balancer, Megatron's "DualChunkSwap" and
ring-flash-attention's "zigzag": rank ``r`` of ``C`` owns chunks ``r`` and ``2C-1-r`` of ``2C``,
which makes causal attention work equal on every rank. It is NOT striped (token ``t`` on rank
``t % C``), whatever the name suggests: no striped layout exists here.

Import rules: the rows of ``RULES`` in tests/unit/test_architecture.py that cover this module.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from cpshard.layouts.coordinates import CallerCoordinates
from cpshard.layouts.index import padded_length
from cpshard.layouts.placement import PaddedRows, Placement

__all__ = [
    "MAX_RUNS",
    "ClosedFormLayout",
    "ContiguousLayout",
    "NoneLayout",
    "RoundRobinLayout",
    "contiguous_local_indices",
    "round_robin_local_indices",
]


def _check_rank(rank: int, world_size: int) -> None:
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got world_size={world_size}")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank must be in [0, world_size={world_size}), got rank={rank}")


def _check_none(rank: int, world_size: int) -> None:
    if world_size != 1:
        raise ValueError(
            f"the 'none' layout is for cp_size == 1, got cp_size={world_size}; "
            "use round_robin or contiguous for CP"
        )
    _check_rank(rank, world_size)


def _check_divisible(padded_seq_len: int, divisor: int, what: str) -> None:
    if padded_seq_len % divisor != 0:
        raise ValueError(
            f"{what} needs padded_seq_len divisible by {divisor}, got "
            f"padded_seq_len={padded_seq_len}; pad the sequence to "
            f"{padded_length(padded_seq_len, divisor)}"
        )


def contiguous_local_indices(
    rank: int, world_size: int, padded_seq_len: int, device: torch.device | str | None = None
) -> torch.Tensor:
    """Global positions owned by ``rank`` in the contiguous layout.

    Args:
        rank: CP rank, ``0 <= rank < world_size``.
        world_size: CP size ``C``.
        padded_seq_len: Global padded length ``P``, divisible by ``C``.
        device: Device of the result.

    Returns:
        LongTensor ``[P // C]``: ``arange(r * P/C, (r + 1) * P/C)``.
    """
    _check_rank(rank, world_size)
    _check_divisible(padded_seq_len, world_size, f"the contiguous layout at cp_size={world_size}")
    local = padded_seq_len // world_size
    return torch.arange(rank * local, (rank + 1) * local, dtype=torch.long, device=device)


def round_robin_local_indices(
    rank: int, world_size: int, padded_seq_len: int, device: torch.device | str | None = None
) -> torch.Tensor:
    """Global positions owned by ``rank`` in the round-robin (head-tail) layout.

    Args:
        rank: CP rank, ``0 <= rank < world_size``.
        world_size: CP size ``C``.
        padded_seq_len: Global padded length ``P``, divisible by ``2 * C``.
        device: Device of the result.

    Returns:
        LongTensor ``[P // C]``: chunk ``rank`` then chunk ``2C - 1 - rank`` of ``2C`` chunks.

    Example:
        >>> round_robin_local_indices(0, 2, 8).tolist()
        [0, 1, 6, 7]
    """
    _check_rank(rank, world_size)
    _check_divisible(
        padded_seq_len, 2 * world_size, f"the round_robin layout at cp_size={world_size}"
    )
    chunk = padded_seq_len // (2 * world_size)
    head = torch.arange(rank * chunk, (rank + 1) * chunk, dtype=torch.long, device=device)
    tail_start = (2 * world_size - 1 - rank) * chunk
    tail = torch.arange(tail_start, tail_start + chunk, dtype=torch.long, device=device)
    return torch.cat([head, tail])


MAX_RUNS = 64
"""A rank map of more contiguous runs than this per rank is copied by index, not by runs."""


def index_runs(indices: torch.Tensor) -> tuple[tuple[int, int], ...]:
    """The contiguous runs of an index: ``((start, length), ...)`` whose ``arange`` ranges,
    concatenated in order, are ``indices`` (one pass over the small index).

    Args:
        indices: LongTensor ``[N]``.
    """
    if indices.numel() == 0:
        return ()
    flat = indices.reshape(-1).to("cpu")
    breaks = (torch.nonzero(flat[1:] - flat[:-1] != 1).reshape(-1) + 1).tolist()
    bounds = [0, *breaks, flat.numel()]
    starts = flat[bounds[:-1]].tolist()
    return tuple((int(st), b - a) for st, a, b in zip(starts, bounds[:-1], bounds[1:], strict=True))


@dataclass(frozen=True)
class ClosedFormLayout(ABC):
    """A layout whose map depends only on ``(rank, world_size, padded_seq_len)``."""

    @property
    @abstractmethod
    def name(self) -> str:
        """Diagnostic label, e.g. ``"round_robin"``."""

    @abstractmethod
    def divisor(self, world_size: int) -> int:
        """The padded global length must be a multiple of this."""

    @abstractmethod
    def local_indices(
        self,
        rank: int,
        world_size: int,
        padded_seq_len: int,
        device: torch.device | str | None = None,
    ) -> torch.Tensor:
        """LongTensor ``[P // C]``: global position of each local token of ``rank``."""

    def padded_length(self, seq_len: int, world_size: int) -> int:
        """Padded global length this layout needs for ``seq_len`` tokens."""
        return padded_length(seq_len, self.divisor(world_size))

    def local_runs(
        self, rank: int, world_size: int, padded_seq_len: int
    ) -> tuple[tuple[int, int], ...]:
        """``((start, length), ...)``: rank ``rank``'s local tokens as contiguous runs of global
        positions, in local order (the runs of :meth:`local_indices`; the built-in layouts
        know them in closed form, 1 or 2 runs)."""
        return index_runs(self.local_indices(rank, world_size, padded_seq_len))

    def rank_map(
        self, world_size: int, padded_seq_len: int, device: torch.device | str | None = None
    ) -> torch.Tensor:
        """LongTensor ``[C, P // C]``: every rank's local indices, row ``r`` for rank ``r``."""
        return torch.stack(
            [self.local_indices(r, world_size, padded_seq_len, device) for r in range(world_size)]
        )

    def placement(
        self,
        world_size: int,
        rows: int,
        seq_len: int,
        padding_mask: torch.Tensor | None,
        device: torch.device,
    ) -> Placement:
        """The :class:`~cpshard.layouts.placement.Placement` of ``[B, S]`` rows (CP pads at the
        row end, each its own document; the real tokens of a row are one document).

        Args:
            world_size: ``C``.
            rows: ``B``.
            seq_len: ``S``, the caller's length.
            padding_mask: BoolTensor ``[B or 1, S]`` (``True`` = pad) or ``None``.
            device: Device of the maps.
        """
        padded = self.padded_length(seq_len, world_size)
        every = tuple(
            run for r in range(world_size) for run in self.local_runs(r, world_size, padded)
        )
        runs = every if len(every) <= MAX_RUNS * world_size else None
        # the documents by their pads (bools; the int64 ids are made only if read), in a
        # tensor of their own (a copy, or the cat with the CP pads), so a caller who reuses the
        # mask's buffer cannot change this shard's documents
        tail = padded - seq_len
        if padding_mask is None:
            pad = torch.zeros(rows if tail else 1, seq_len, dtype=torch.bool, device=device)
        else:
            mask = padding_mask.to(device=device, dtype=torch.bool, copy=not tail)
            pad = mask.expand(rows, seq_len)
        if tail:  # CP pads at the row end, each its own document
            ones = torch.ones(rows, tail, dtype=torch.bool, device=device)
            pad = torch.cat([pad, ones], dim=1)
        docs = PaddedRows(pad)
        coordinates = CallerCoordinates(seq_len, padded)
        if runs is not None:  # the rank map from its runs
            return Placement.of_runs(runs, world_size, docs, coordinates, device)
        return Placement(self.rank_map(world_size, padded, device), docs, coordinates)


@dataclass(frozen=True)
class NoneLayout(ClosedFormLayout):
    """No CP: one rank owns the whole sequence (``cp_size == 1``)."""

    @property
    def name(self) -> str:
        return "none"

    def divisor(self, world_size: int) -> int:
        return 1

    def local_indices(
        self,
        rank: int,
        world_size: int,
        padded_seq_len: int,
        device: torch.device | str | None = None,
    ) -> torch.Tensor:
        _check_none(rank, world_size)
        return torch.arange(padded_seq_len, dtype=torch.long, device=device)

    def local_runs(
        self, rank: int, world_size: int, padded_seq_len: int
    ) -> tuple[tuple[int, int], ...]:
        _check_none(rank, world_size)
        return ((0, padded_seq_len),)


@dataclass(frozen=True)
class ContiguousLayout(ClosedFormLayout):
    """Rank ``r`` owns ``[r*L, (r+1)*L)``; the stream is padded to ``C * max(pad_multiple, 2)``.

    Used by models that own their CP transport (local or compressed attention), where each rank
    needs a contiguous window. ``pad_multiple`` is the per-rank length multiple the model needs.
    """

    pad_multiple: int = 1

    def __post_init__(self) -> None:
        if self.pad_multiple < 1:
            raise ValueError(
                f"pad_multiple must be >= 1, got pad_multiple={self.pad_multiple}; pass 1 for none"
            )

    @property
    def name(self) -> str:
        return "contiguous"

    def divisor(self, world_size: int) -> int:
        return world_size * max(self.pad_multiple, 2)

    def local_indices(
        self,
        rank: int,
        world_size: int,
        padded_seq_len: int,
        device: torch.device | str | None = None,
    ) -> torch.Tensor:
        return contiguous_local_indices(rank, world_size, padded_seq_len, device)

    def local_runs(
        self, rank: int, world_size: int, padded_seq_len: int
    ) -> tuple[tuple[int, int], ...]:
        _check_rank(rank, world_size)
        _check_divisible(
            padded_seq_len, world_size, f"the contiguous layout at cp_size={world_size}"
        )
        local = padded_seq_len // world_size
        return ((rank * local, local),)


@dataclass(frozen=True)
class RoundRobinLayout(ClosedFormLayout):
    """Head-tail pairing: rank ``r`` owns chunks ``r`` and ``2C-1-r`` of ``2C`` (not striped).

    Aliases: *head-tail* (torch CP), *DualChunkSwap* (Megatron), *zigzag* (ring-flash-attention).
    """

    @property
    def name(self) -> str:
        return "round_robin"

    def divisor(self, world_size: int) -> int:
        return 2 * world_size

    def local_indices(
        self,
        rank: int,
        world_size: int,
        padded_seq_len: int,
        device: torch.device | str | None = None,
    ) -> torch.Tensor:
        return round_robin_local_indices(rank, world_size, padded_seq_len, device)

    def local_runs(
        self, rank: int, world_size: int, padded_seq_len: int
    ) -> tuple[tuple[int, int], ...]:
        _check_rank(rank, world_size)
        _check_divisible(
            padded_seq_len, 2 * world_size, f"the round_robin layout at cp_size={world_size}"
        )
        chunk = padded_seq_len // (2 * world_size)
        head, tail = rank * chunk, (2 * world_size - 1 - rank) * chunk
        if tail == head + chunk:  # the middle rank's two chunks touch: one run
            return ((head, 2 * chunk),)
        return ((head, chunk), (tail, chunk))
