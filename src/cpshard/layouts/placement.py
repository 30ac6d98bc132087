"""The placement of one batch: the one frozen record of where every token lives.

Every layout ends in a :class:`Placement`: the closed-form ones
(``ClosedFormLayout.placement``), the packed ones (``PackedPlan.placement`` wraps the plan of
``packed`` and ``balanced``) and a model's own (built directly, e.g.
``cpshard.models.global_prefix``). Everything else is
derived from it and cached by its consumer, keyed by the placement object (identity): the
sharder's facts and token index (:mod:`cpshard.sharding`) and the per-token facts attention
reads (``TokenMeta``, whose ``positions`` are ``rank_map`` flattened, by construction).

Import rules: the rows of ``RULES`` in tests/unit/test_architecture.py that cover this module.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from cpshard.layouts.coordinates import CallerCoordinates
from cpshard.layouts.index import arange_runs, runs_over

__all__ = ["DocumentRuns", "PaddedRows", "Placement", "pad_document_ids"]


def pad_document_ids(document_ids: torch.Tensor, padding_mask: torch.Tensor) -> torch.Tensor:
    """Give each pad token its own negative document id.

    Args:
        document_ids: LongTensor ``[B, P]`` of global document ids (``>= 0``), global order, or
            any shape that broadcasts to ``padding_mask``'s (a 0-d ``0``: one document per row).
        padding_mask: BoolTensor ``[B, P]``, ``True`` = pad, global order.

    Returns:
        LongTensor ``[B, P]``: ``document_ids`` where real, ``-1 - position`` where pad (one
        pass: the negative positions are one ``[P]`` row, broadcast).
    """
    padded = padding_mask.shape[-1]
    neg = torch.arange(-1, -padded - 1, -1, dtype=torch.long, device=padding_mask.device)
    return torch.where(padding_mask, neg, document_ids)


@dataclass(frozen=True, eq=False)
class PaddedRows:
    """Document ids by their pads alone: each row's real tokens are one document (id ``0``) and
    every pad its own (``-1 - position``, :func:`pad_document_ids`): the documents of the
    closed-form layouts, described by ``[B or 1, P]`` bools instead of as many int64 ids.

    Attributes:
        padding_mask: BoolTensor ``[B or 1, P]``, ``True`` = pad, global order.
    """

    padding_mask: torch.Tensor

    def __post_init__(self) -> None:
        if self.padding_mask.dim() != 2 or self.padding_mask.dtype != torch.bool:
            raise ValueError(
                "PaddedRows needs a bool padding_mask [B or 1, P] (True = pad); got "
                f"{self.padding_mask.dtype} of shape {tuple(self.padding_mask.shape)}"
            )

    @property
    def shape(self) -> torch.Size:
        """``[B or 1, P]``, the shape of the ids."""
        return self.padding_mask.shape

    def make_ids(self) -> torch.Tensor:
        """LongTensor ``[B or 1, P]``: the document ids (one pass)."""
        zero = torch.zeros((), dtype=torch.long, device=self.padding_mask.device)
        return pad_document_ids(zero, self.padding_mask)


@dataclass(frozen=True, eq=False)
class DocumentRuns:
    """Document ids of one row as runs in global order: run ``k`` covers positions
    ``[starts[k], starts[k + 1])`` (the last one up to ``length``) of document ``ids[k]``, or
    pads where ``ids[k] < 0`` (each pad its own document, ``-1 - position``): the documents of a
    packed plan, described by its ``K`` runs instead of ``P`` int64 ids.

    Attributes:
        starts: LongTensor ``[K]`` (CPU): ``0`` first, strictly increasing, below ``length``.
        ids: LongTensor ``[K]`` (CPU): each run's document (``>= 0``) or ``-1`` for pads.
        length: ``P``.
        device: Device of the ids when made.
        per_position: LongTensor ``[P]``: the same runs, one id per position (``-1`` for pads),
            where the caller has them already (a packed plan's ``stream_document_ids``), or
            ``None``: made from the runs when the ids are.
    """

    starts: torch.Tensor
    ids: torch.Tensor
    length: int
    device: torch.device
    per_position: torch.Tensor | None = None

    def __post_init__(self) -> None:
        st = self.starts
        ok = st.dim() == 1 and st.shape == self.ids.shape and st.numel() > 0 and int(st[0]) == 0
        if not ok or bool((st[1:] <= st[:-1]).any()) or int(st[-1]) >= self.length:
            raise ValueError(
                "DocumentRuns needs starts [K] from 0, strictly increasing below length="
                f"{self.length}, and ids [K]; got starts {st.tolist()[:8]} and ids of shape "
                f"{tuple(self.ids.shape)}"
            )

    @property
    def shape(self) -> torch.Size:
        """``[1, P]``, the shape of the ids."""
        return torch.Size((1, self.length))

    def make_ids(self) -> torch.Tensor:
        """LongTensor ``[1, P]`` on :attr:`device`: the document ids (pads ``-1 - position``)."""
        per = self.per_position
        if per is None:
            counts = torch.diff(self.starts, append=torch.tensor([self.length]))
            per = torch.repeat_interleave(self.ids, counts, output_size=self.length)
        per = per.to(self.device)
        return pad_document_ids(per[None], per[None] < 0)

    def in_order(
        self, order: torch.Tensor, runs: tuple[tuple[int, int], ...] | None = None
    ) -> torch.Tensor | None:
        """The ids at the positions ``order`` (pads ``-1 - position``), made from the runs cut at
        the runs of consecutive positions in ``order`` (no ``[P]`` ids in global order), or
        ``None`` where ``order`` is cut finer than one run per :data:`_IN_ORDER_MIN_RUN`
        positions (indexing the made ids is then cheaper).

        Args:
            order: LongTensor ``[N]``: positions in ``[0, P)``, any order (e.g. the rank map
                flattened: the rank-major stream).
            runs: ``order`` as runs of consecutive positions, ``((first, length), ...)`` in
                order, where known (:attr:`Placement.stream_runs`): no pass over ``order``.

        Returns:
            LongTensor ``[N]`` on :attr:`device`, or ``None``.
        """
        given = None
        if runs is not None:
            pairs = np.array(runs, dtype=np.int64).reshape(-1, 2)
            given = (pairs[:, 0].copy(), pairs[:, 1].copy())
        at = None
        if given is None:
            at = order.detach().cpu().numpy().astype(np.int64, copy=False)
        cut = runs_over(at, self.starts.numpy(), self.length, _IN_ORDER_MIN_RUN, runs=given)
        if cut is None:
            return None
        k, first, count = cut
        ids = self.ids.numpy()[k]
        pad = ids < 0
        step = np.negative(pad, dtype=np.int64)  # a pad's id falls by one per position
        out = arange_runs(np.where(pad, -1 - first, ids), count, step)
        return torch.from_numpy(out).to(self.device)


_IN_ORDER_MIN_RUN = 4
""":meth:`DocumentRuns.in_order` cuts the order into runs where they average at least this many
positions (TE's ``packed`` at C = 64 and 1M tokens: about 8)."""

Documents = PaddedRows | DocumentRuns
"""Documents described without their ``[B or 1, P]`` int64 ids."""


@dataclass(frozen=True, eq=False, init=False)
class Placement:
    """Where every token of one batch lives over ``C`` CP ranks (frozen; one per shard).

    Equality and hashing are by identity: a placement is the key of the caches derived from it.

    Args:
        rank_map: LongTensor ``[C, L]``: global (padded-stream) positions of rank ``r``'s local
            tokens in local order; a bijection onto ``arange(P)``, ``P = C * L``.
        document_ids: LongTensor ``[B or 1, P]`` in *global* order: the document of each
            position; pads are negative and unique (:func:`pad_document_ids`), so a pad sees
            only itself. Or :class:`PaddedRows` (one document per row, every pad its own) or
            :class:`DocumentRuns` (one row's documents as runs): the ids are then made on first
            read of :attr:`document_ids`, and readers that need only the runs (the attention
            plan's) read :attr:`documents` instead.
        coordinates: How the caller addresses the tokens (original length, row shape, input
            positions; :class:`~cpshard.layouts.coordinates.CallerCoordinates`), with
            ``coordinates.padded_seq_len == P``.
        stream_runs: ``rank_map`` flattened as contiguous runs of global positions,
            ``((start, length), ...)`` in stream order (the closed-form layouts: 1 or 2 per
            rank), or ``None``; where given, copies in stream or local order slice the runs
            instead of indexing token by token (:meth:`local_runs`). Must describe
            ``rank_map`` exactly (checked here, one pass over the small map).

    Raises:
        ValueError: shapes that do not fit (``[C, L]``, ``[B or 1, P]``, ``P`` everywhere), or
            ``stream_runs`` that do not describe ``rank_map``.
    """

    rank_map: torch.Tensor
    coordinates: CallerCoordinates
    stream_runs: tuple[tuple[int, int], ...] | None
    documents: Documents | None
    _ids: list[torch.Tensor] = field(repr=False)  # the ids once made (at most one)

    def __init__(
        self,
        rank_map: torch.Tensor,
        document_ids: torch.Tensor | Documents,
        coordinates: CallerCoordinates,
        stream_runs: tuple[tuple[int, int], ...] | None = None,
    ) -> None:
        rows = document_ids if isinstance(document_ids, PaddedRows | DocumentRuns) else None
        object.__setattr__(self, "rank_map", rank_map)
        object.__setattr__(self, "coordinates", coordinates)
        object.__setattr__(self, "stream_runs", stream_runs)
        object.__setattr__(self, "documents", rows)
        object.__setattr__(self, "_ids", [] if rows is not None else [document_ids])
        self._check(document_ids.shape)

    @classmethod
    def of_runs(
        cls,
        stream_runs: tuple[tuple[int, int], ...],
        world_size: int,
        document_ids: torch.Tensor | Documents,
        coordinates: CallerCoordinates,
        device: torch.device,
    ) -> Placement:
        """The placement whose rank map is made from ``stream_runs`` (one ``arange`` and a
        gather of its slices), so the runs describe it by construction: only their tiling is
        checked (``O(runs)``), not the rank map against them.

        Args:
            stream_runs: ``((start, length), ...)`` in stream order, tiling ``arange(P)``.
            world_size: ``C`` (``P`` divisible by it).
            document_ids: As for the constructor.
            coordinates: As for the constructor.
            device: Device of the rank map.

        Raises:
            ValueError: runs that do not tile ``arange(P)`` (a gap, an overlap, an empty run),
                or ``P`` not divisible by ``world_size``.
        """
        padded = _tiled_length(stream_runs)
        if padded is None or world_size < 1 or padded % world_size:
            raise ValueError(
                "Placement.of_runs needs stream_runs ((start, length), ...) with lengths > 0 that "
                f"tile arange(P), P divisible by world_size={world_size}; got "
                f"{tuple(stream_runs)[:8]} (P={sum(n for _, n in stream_runs)}). Pass the runs "
                "of a rank map flattened"
            )
        ar = torch.arange(padded, dtype=torch.long, device=device)
        rank_map = torch.cat([ar[a : a + n] for a, n in stream_runs]).reshape(world_size, -1)
        out = cls(rank_map, document_ids, coordinates)  # checked without runs
        object.__setattr__(out, "stream_runs", stream_runs)
        return out

    def _check(self, doc_shape: torch.Size) -> None:
        if self.rank_map.dim() != 2 or len(doc_shape) != 2:
            raise ValueError(
                f"a Placement needs rank_map [C, L] and document_ids [B or 1, P]; got shapes "
                f"{tuple(self.rank_map.shape)} and {tuple(doc_shape)}"
            )
        padded = self.rank_map.numel()
        if doc_shape[-1] != padded or self.coordinates.padded_seq_len != padded:
            raise ValueError(
                f"a Placement's rank_map covers P={padded} positions, but document_ids has "
                f"{doc_shape[-1]} and coordinates.padded_seq_len is "
                f"{self.coordinates.padded_seq_len}; they must all be P"
            )
        if self.stream_runs is not None and not self._runs_match():
            raise ValueError(
                f"a Placement's stream_runs {self.stream_runs[:8]} do not describe its rank_map "
                "flattened; pass the runs of rank_map.reshape(-1) or None"
            )

    @property
    def document_ids(self) -> torch.Tensor:
        """LongTensor ``[B or 1, P]`` in global order: the document of each position (made from
        :attr:`documents` on first read where the placement was given those)."""
        if not self._ids:
            docs = self.documents
            assert docs is not None
            self._ids.append(docs.make_ids())
        return self._ids[0]

    @property
    def document_rows(self) -> int:
        """``B or 1``: the rows of :attr:`document_ids` (without making them)."""
        docs = self.documents
        return int(docs.shape[0] if docs is not None else self._ids[0].shape[0])

    def _runs_match(self) -> bool:
        runs = self.stream_runs
        assert runs is not None
        flat = self.rank_map.reshape(-1)
        if any(n <= 0 for _, n in runs) or sum(n for _, n in runs) != flat.numel():
            return False
        if not runs:
            return True
        want = torch.cat([torch.arange(a, a + n, device=flat.device) for a, n in runs])
        return bool(torch.equal(flat.to(torch.long), want))

    @property
    def world_size(self) -> int:
        """CP size ``C``."""
        return int(self.rank_map.shape[0])

    @property
    def padded_len(self) -> int:
        """``P``, length of the padded global stream."""
        return int(self.rank_map.numel())

    @property
    def local_len(self) -> int:
        """``L = P / C`` local tokens per rank."""
        return int(self.rank_map.shape[1])

    def stream_positions(self) -> torch.Tensor:
        """LongTensor ``[B or 1, P]``: global position of each slot of the rank-major stream
        (``rank_map`` flattened, with ``document_ids``' batch dim; a view, no copy)."""
        return self.rank_map.reshape(1, -1).expand(self.document_rows, -1)

    def local_runs(self, rank: int) -> tuple[tuple[int, int], ...] | None:
        """Rank ``rank``'s local tokens as contiguous runs of global positions (local order),
        or ``None`` when the placement has no runs."""
        runs = self.stream_runs
        if runs is None:
            return None
        local, seen, out = self.local_len, 0, []
        for start, n in runs:  # cut the stream's runs at the rank's bounds
            lo, hi = max(seen, rank * local), min(seen + n, (rank + 1) * local)
            if lo < hi:
                out.append((start + lo - seen, hi - lo))
            seen += n
        return tuple(out)

    def stream_document_ids(self) -> torch.Tensor:
        """LongTensor ``[B or 1, P]``: ``document_ids`` in rank-major stream order (documents as
        runs not yet made into ids: from their runs, :meth:`DocumentRuns.in_order`)."""
        runs = self.stream_runs
        docs = self.documents
        if not self._ids and isinstance(docs, DocumentRuns):
            got = docs.in_order(self.rank_map.reshape(-1), runs)
            if got is not None:
                return got[None]
        if runs is not None:
            return torch.cat([self.document_ids[:, a : a + n] for a, n in runs], dim=1)
        return self.document_ids.index_select(1, self.rank_map.reshape(-1))


def attach_stream_runs(placement: Placement, runs: tuple[tuple[int, int], ...]) -> None:
    """Give ``placement`` the runs its rank map was made from (:attr:`Placement.stream_runs`).

    For a map made from ``runs`` by its maker (a packed plan's,
    :func:`cpshard.layouts.packed.plan_from_runs`, which checked them): their tiling of
    ``arange(P)`` is checked here in ``O(runs)``, not the map against them (the constructor's
    pass over the map, which made them moot).

    Raises:
        ValueError: runs that do not tile ``arange(P)`` of this placement's ``P``.
    """
    if _tiled_length(runs) != placement.padded_len:
        raise ValueError(
            f"stream runs must tile arange(P) with P={placement.padded_len}, got "
            f"{tuple(runs)[:8]}; pass the runs the rank map was made from"
        )
    object.__setattr__(placement, "stream_runs", runs)


def _tiled_length(runs: tuple[tuple[int, int], ...]) -> int | None:
    """``P`` where ``runs`` (``(start, length)``, any order, lengths ``> 0``) tile
    ``arange(P)`` exactly (no gap, no overlap, at least one run), else ``None``; ``O(runs)``
    after a sort of the runs."""
    ordered = sorted(runs)
    ends = [0] + [a + n for a, n in ordered]
    tiles = all(n > 0 and a == end for (a, n), end in zip(ordered, ends, strict=False))
    return ends[-1] if runs and tiles else None
