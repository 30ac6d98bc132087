"""Per-token facts that CP attention needs, computed once at shard time.

Every rank holds the whole (unsharded) batch when it shards, so it can compute these facts for
*all* ranks without a collective: CP attention then knows the global position and document of
every key it receives, whatever the layout.

Masking rule (layout-agnostic): query ``q`` sees key ``k`` iff
``document_ids[k] == document_ids[q]`` and, for causal attention, ``positions[k] <= positions[q]``.
Padding gets a unique negative document id (``-1 - position``), so a pad token sees only itself:
no real token ever sees a pad, and no row is fully masked.

A shard's token meta is derived from its :class:`~cpshard.layouts.placement.Placement`
(:meth:`TokenMeta.of`): ``positions`` are the placement's ``rank_map`` flattened and
``document_ids`` its document ids in stream order, never a second copy of the layout.

Import rules: the rows of ``RULES`` in tests/unit/test_architecture.py that cover this module.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from cpshard.layouts.placement import Documents, PaddedRows, Placement, pad_document_ids

__all__ = ["PaddedRows", "TokenMeta", "pad_document_ids"]


@dataclass(frozen=True, eq=False, init=False)
class TokenMeta:
    """Global positions and document ids of every token, in rank-major stream order.

    The *stream* is what an all-gather of the local shards yields: rank 0's local tokens, then
    rank 1's, and so on. Slot ``r * L + i`` describes local token ``i`` of rank ``r``.
    Equality and hashing are by identity (:func:`cpshard.sharding.facts.same_shard` compares
    two metas by content).

    Args:
        rank: This rank's index in the CP group.
        world_size: CP size ``C``.
        positions: LongTensor ``[B or 1, C * L]``: global (padded-stream) position of each token;
            the causal order.
        document_ids: LongTensor ``[B or 1, C * L]``: document of each token; pads are negative
            and unique (see :func:`pad_document_ids`). ``None`` with a ``placement``: the
            placement's, in stream order, made on first read of :attr:`document_ids` (the
            attention plan of a placement given by its pads never reads them).
        plan_cache: Per-batch cache of derived plans (the attention plan of
            :func:`cpshard.attention.plan.attention_plan`), filled by attention; a shard has one
            meta per placement and rank (:meth:`of`), so it is keyed by the placement.
        local_record: ``{key: (shape, tensor or (content hash, its device))}`` of this rank's local
            ``input_ids`` and ``position_ids`` as the sharder returned them (filled by
            :meth:`cpshard.CPSharder.shard`, each hashed on its first comparison): the batch
            identity that survives ``.clone()`` and ``.to()`` of the local tensors (see
            :func:`cpshard.sharding.facts.matches_record`).
        placement: The placement this meta was derived from (:meth:`of`), or ``None`` for a
            meta built by hand.

    Invariant: a meta derived from a placement has ``positions == placement.rank_map``
    flattened (a view of it) and ``document_ids == placement.stream_document_ids()``.

    Raises:
        ValueError: tensors that are not ``[B or 1, C * L]`` alike, a stream length that ``C``
            does not divide, or neither ``document_ids`` nor a ``placement``.
    """

    rank: int
    world_size: int
    positions: torch.Tensor
    plan_cache: dict[str, Any] = field(repr=False)
    local_record: dict[str, tuple[tuple[int, ...], torch.Tensor | tuple[int, torch.device]]] = (
        field(repr=False)
    )
    placement: Placement | None = field(repr=False)
    _ids: list[torch.Tensor] = field(repr=False)  # the document ids once made (at most one)
    _given_ids: bool = field(repr=False)  # document_ids were given (not the placement's)

    def __init__(
        self,
        rank: int,
        world_size: int,
        positions: torch.Tensor,
        document_ids: torch.Tensor | None = None,
        plan_cache: dict[str, Any] | None = None,
        local_record: dict[str, tuple[tuple[int, ...], torch.Tensor | tuple[int, torch.device]]]
        | None = None,
        placement: Placement | None = None,
    ) -> None:
        if document_ids is None and placement is None:
            raise ValueError(
                "a TokenMeta needs its document_ids, or the placement it comes from "
                "(TokenMeta.of(placement, rank))"
            )
        for name, value in (
            ("rank", rank),
            ("world_size", world_size),
            ("positions", positions),
            ("plan_cache", {} if plan_cache is None else plan_cache),
            ("local_record", {} if local_record is None else local_record),
            ("placement", placement),
            ("_ids", [] if document_ids is None else [document_ids]),
            ("_given_ids", document_ids is not None),
        ):
            object.__setattr__(self, name, value)
        self._check()

    @classmethod
    def of(cls, placement: Placement, rank: int) -> TokenMeta:
        """Rank ``rank``'s token meta of ``placement`` (positions: its rank map, flattened; the
        document ids in stream order are made on first read)."""
        return cls(rank, placement.world_size, placement.stream_positions(), placement=placement)

    @property
    def document_ids(self) -> torch.Tensor:
        """LongTensor ``[B or 1, C * L]``: the document of each token (see the class)."""
        if not self._ids:
            assert self.placement is not None
            self._ids.append(self.placement.stream_document_ids())
        return self._ids[0]

    @property
    def documents(self) -> Documents | None:
        """The placement's documents as described without their ids (its pads, or its
        document runs), where this meta's documents are that placement's; else ``None``."""
        place = self.placement
        return None if place is None or self._given_ids else place.documents

    def _check(self) -> None:
        if self._given_ids:
            doc = self._ids[0].shape
        else:  # the placement's (its own checks ran), in stream order
            assert self.placement is not None
            doc = torch.Size((self.placement.document_rows, self.placement.padded_len))
        if self.positions.dim() != 2 or len(doc) != 2:
            raise ValueError(
                "TokenMeta tensors must be [B, C*L]; got positions "
                f"{tuple(self.positions.shape)} and document_ids {tuple(doc)}"
            )
        if self.positions.shape[-1] != doc[-1]:
            raise ValueError(
                "TokenMeta positions and document_ids must have the same length; got "
                f"{self.positions.shape[-1]} and {doc[-1]}"
            )
        if self.positions.shape[-1] % self.world_size != 0:
            raise ValueError(
                f"TokenMeta stream length {self.positions.shape[-1]} is not divisible by "
                f"world_size={self.world_size}"
            )

    @property
    def local_len(self) -> int:
        """Number of local tokens ``L`` per rank."""
        return self.positions.shape[-1] // self.world_size

    def rank_slice(self, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(positions, document_ids)`` of rank ``rank``'s local tokens, each ``[B or 1, L]``."""
        n = self.local_len
        return (
            self.positions[:, rank * n : (rank + 1) * n],
            self.document_ids[:, rank * n : (rank + 1) * n],
        )

    def local(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(positions, document_ids)`` of this rank's local tokens, each ``[B or 1, L]``."""
        return self.rank_slice(self.rank)

    def to(self, device: torch.device | str) -> TokenMeta:
        """A copy on ``device``."""
        return TokenMeta(
            self.rank, self.world_size, self.positions.to(device), self.document_ids.to(device)
        )
