"""One attention plan per batch: which query rows meet which key rows, cut into kernel calls.

Not to be confused with :class:`~cpshard.layouts.packed.PackedPlan` (where tokens live): an
:class:`AttentionPlan` says which blocks attention computes. Imports :mod:`.pieces` and the token
meta (:mod:`cpshard.sharding.meta`); never a collective.

The plan is built on the host from the token meta (global position and document id of every
token of every rank) once per batch and reused by every layer and by the backward; the per-layer
code only runs kernels and collectives over the plan's static slices (no host-device sync, no
data-dependent Python branching).

For a query set and a key set (the local shard and the gathered stream, one ring block, or the
whole stream for Ulysses) the plan finds the *runs* of each side (maximal stretches of one
document with consecutive positions, contiguous in the tensor), pairs every query run with the key
runs of its document, and cuts each pair into *pieces* whose pairs are all visible:

* ``FULL``: every key at or before every query (and inside the window) -> kernel without a mask;
* ``CAUSAL``: the same positions on both sides -> the kernel's own ``is_causal``;
* ``EDGE``: a bounded piece on the border of a sliding window (at most :data:`TILE` square).

Visibility: ``same document & k_pos <= q_pos`` (causal) ``& q_pos - k_pos < window`` (sliding
window). Pieces too small to be worth a kernel call (many tiny documents, 1-token documents,
padding, window borders) are grouped into *masked tiles* of at most :data:`TILE` x :data:`TILE`
slots, whose bool mask is the union of their pieces' patterns, prepared once here. So no dense
``[Lq, Lk]`` mask is ever built for document structure; memory stays ``O(L * D)`` plus one tile.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from cpshard.attention.pieces import SMALL_PAIRS, TILE, Cutter, Task, runs, tasks_of
from cpshard.sharding.meta import TokenMeta

__all__ = [
    "SMALL_PAIRS",
    "TILE",
    "AttentionPlan",
    "PairPlan",
    "Task",
    "attention_plan",
    "check_window",
    "pair_plan",
]


@dataclass(frozen=True)
class PairPlan:
    """The kernel calls of one (query set, key set) pair.

    Attributes:
        groups: ``(rows, tasks)`` per group of batch rows that share one structure; ``rows`` is a
            LongTensor of batch indices, or ``None`` for every row (meta batch 1 or all equal).
        computed: Query-key pairs the kernels compute (causal pieces count their triangle).
        needed: Query-key pairs the mask makes visible (per meta row, summed).
        empty: No query sees any key (a plain bool, so compiled code reads a constant).
    """

    groups: tuple[tuple[torch.Tensor | None, tuple[Task, ...]], ...]
    computed: int
    needed: int
    empty: bool


def check_window(window: int | None, causal: bool) -> None:
    """Raise ``ValueError`` for a window that cannot be honoured.

    Args:
        window: Sliding window (``None`` = none): query ``q`` sees key ``k`` iff
            ``0 <= q_pos - k_pos < window`` (and both in one document).
        causal: Whether the attention is causal (windows need it).
    """
    if window is None:
        return
    if isinstance(window, bool) or not isinstance(window, int) or window <= 0:
        raise ValueError(
            f"sliding_window must be a positive int (query sees key iff 0 <= q_pos - k_pos < "
            f"window), got {window!r}; pass None for no window"
        )
    if not causal:
        raise ValueError(
            f"sliding_window={window} needs causal attention, got is_causal=False; CP attention "
            "supports windows only with causal masking"
        )


def pair_plan(
    q_pos: np.ndarray,
    q_doc: np.ndarray,
    k_pos: np.ndarray,
    k_doc: np.ndarray,
    rows: list[list[int]] | None,
    *,
    causal: bool,
    window: int | None,
    device: torch.device,
    skip_keys: tuple[int, int] | None = None,
) -> PairPlan:
    """Plan one (query set, key set) pair from host arrays.

    Args:
        q_pos: ``[G, Nq]`` global positions of the query slots, one row per row group.
        q_doc: ``[G, Nq]`` document ids of the query slots.
        k_pos: ``[G, Nk]`` global positions of the key slots.
        k_doc: ``[G, Nk]`` document ids of the key slots.
        rows: Batch rows of every group, or ``None`` (one group serving every row).
        causal: Causal masking by global position.
        window: Sliding window or ``None``.
        device: Device of the masks and row indices.
        skip_keys: Key slots ``[start, end)`` that no query attends to in this plan (the
            all-gather's local block, planned apart), or ``None``.

    Returns:
        The :class:`PairPlan`.
    """
    if skip_keys is not None:
        # A document id that no query slot has: the skipped keys form runs that meet no query.
        k_doc = k_doc.copy()
        k_doc[:, skip_keys[0] : skip_keys[1]] = min(int(q_doc.min()), int(k_doc.min())) - 1
    groups = []
    computed = needed = 0
    for g in range(q_pos.shape[0]):
        by_doc: dict[int, list[tuple[int, int, int]]] = defaultdict(list)
        for s, e, d, p in runs(k_pos[g], k_doc[g]):
            by_doc[d].append((s, p, e - s))
        cut = Cutter(causal, window)
        for s, e, d, p in runs(q_pos[g], q_doc[g]):
            for ks, kp, nk in by_doc.get(d, ()):
                cut.pair(s, p, e - s, ks, kp, nk)
        tasks, c, n = tasks_of(cut.pieces, causal, window, device)
        weight = 1 if rows is None else len(rows[g])
        computed += c * weight
        needed += n * weight
        idx = None if rows is None else torch.tensor(rows[g], dtype=torch.long, device=device)
        groups.append((idx, tasks))
    return PairPlan(tuple(groups), computed, needed, all(not t for _, t in groups))


@dataclass(frozen=True)
class AttentionPlan:
    """The attention plan of one sharded batch, for one CP rank.

    Built from the :class:`~cpshard.sharding.meta.TokenMeta` once (host copies of its positions and
    document ids); the per-method plans (:meth:`all_gather`, :meth:`ring`, :meth:`ulysses`) are
    made on first use for each ``(causal, window, device)`` and then reused by every layer and
    by the backward.

    Attributes:
        meta: The token meta the plan belongs to.
    """

    meta: TokenMeta
    _rows: list[list[int]] | None = field(init=False, repr=False, compare=False)
    _pos: np.ndarray = field(init=False, repr=False, compare=False)
    _doc: np.ndarray = field(init=False, repr=False, compare=False)
    _cache: dict[tuple[Any, ...], Any] = field(
        init=False, repr=False, compare=False, default_factory=dict
    )

    def __post_init__(self) -> None:
        pos = self.meta.positions.detach().cpu().numpy().astype(np.int64)
        doc = self.meta.document_ids.detach().cpu().numpy().astype(np.int64)
        groups: dict[bytes, list[int]] = {}
        for r in range(pos.shape[0]):
            groups.setdefault(pos[r].tobytes() + b"|" + doc[r].tobytes(), []).append(r)
        firsts = [g[0] for g in groups.values()]
        rows = None if len(groups) == 1 else list(groups.values())
        object.__setattr__(self, "_rows", rows)
        object.__setattr__(self, "_pos", pos[firsts])
        object.__setattr__(self, "_doc", doc[firsts])

    @property
    def rank(self) -> int:
        """This rank's index in the CP group."""
        return self.meta.rank

    @property
    def world_size(self) -> int:
        """CP size."""
        return self.meta.world_size

    @property
    def local_len(self) -> int:
        """Local tokens per rank."""
        return self.meta.local_len

    def _slots(self, rank: int | None) -> tuple[np.ndarray, np.ndarray]:
        if rank is None:
            return self._pos, self._doc
        n = self.local_len
        return self._pos[:, rank * n : (rank + 1) * n], self._doc[:, rank * n : (rank + 1) * n]

    def _pair(
        self,
        q: int | None,
        k: int | None,
        causal: bool,
        window: int | None,
        device: torch.device,
        skip: int | None = None,
    ) -> PairPlan:
        key = self._key(q, k, causal, window, device, skip)
        hit = self._cache.get(key)
        if hit is None:
            n = self.local_len
            hit = pair_plan(
                *self._slots(q), *self._slots(k), self._rows, causal=causal, window=window,
                device=device, skip_keys=None if skip is None else (skip * n, (skip + 1) * n),
            )  # fmt: skip
            self._cache[key] = hit
        assert isinstance(hit, PairPlan)
        return hit

    @staticmethod
    def _key(
        q: int | None,
        k: int | None,
        causal: bool,
        window: int | None,
        device: torch.device,
        skip: int | None,
    ) -> tuple[Any, ...]:
        return ("pair", q, k, causal, window, str(device), skip)

    def planned(self, method: str, causal: bool, window: int | None, device: torch.device) -> bool:
        """Whether :meth:`for_method` would only read cached plans (no host work to build one)."""
        me = self.rank
        if method == "ring":
            keys = [self._key(me, r, causal, window, device, None) for r in range(self.world_size)]
        elif method == "ulysses":
            keys = [self._key(None, None, causal, window, device, None)]
        else:
            keys = [
                self._key(me, me, causal, window, device, None),
                self._key(me, None, causal, window, device, me),
            ]
        return all(key in self._cache for key in keys)

    def all_gather(self, causal: bool, window: int | None, device: torch.device) -> PairPlan:
        """Local queries against the whole gathered stream."""
        return self._pair(self.rank, None, causal, window, device)

    def all_gather_split(
        self, causal: bool, window: int | None, device: torch.device
    ) -> tuple[PairPlan, PairPlan]:
        """:meth:`all_gather` cut in two: ``(local, remote)``.

        ``local``: local queries against this rank's own block ``[L]`` (available before the
        all-gather completes; the same plan as ``ring(...)[rank]``). ``remote``: local queries
        against the whole stream ``[C * L]`` with this rank's block skipped (empty at ``C = 1``).
        Together they cover exactly the pairs of :meth:`all_gather`.
        """
        return (
            self._pair(self.rank, self.rank, causal, window, device),
            self._pair(self.rank, None, causal, window, device, skip=self.rank),
        )

    def ring(self, causal: bool, window: int | None, device: torch.device) -> tuple[PairPlan, ...]:
        """Local queries against each rank's block, index ``r`` for rank ``r``."""
        return tuple(
            self._pair(self.rank, r, causal, window, device) for r in range(self.world_size)
        )

    def ulysses(self, causal: bool, window: int | None, device: torch.device) -> PairPlan:
        """The whole stream against itself (each rank holds a slice of the heads)."""
        return self._pair(None, None, causal, window, device)

    def for_method(
        self, method: str, causal: bool, window: int | None, device: torch.device
    ) -> PairPlan | tuple[PairPlan, ...]:
        """The plan(s) ``method`` runs: :meth:`all_gather_split`, :meth:`ring`, :meth:`ulysses`."""
        if method == "ring":
            return self.ring(causal, window, device)
        if method == "ulysses":
            return self.ulysses(causal, window, device)
        return self.all_gather_split(causal, window, device)

    def pair_counts(
        self, method: str, causal: bool = True, window: int | None = None
    ) -> tuple[int, int]:
        """``(computed, needed)`` query-key pairs this rank's kernels run for ``method``.

        For Ulysses the counts are per head slice over the whole stream (every rank runs them).
        """
        plans = self.for_method(method, causal, window, torch.device("cpu"))
        seq = plans if isinstance(plans, tuple) else (plans,)
        return sum(p.computed for p in seq), sum(p.needed for p in seq)


def attention_plan(meta: TokenMeta) -> AttentionPlan:
    """The plan of ``meta``'s batch, built on first call and cached on the meta.

    Args:
        meta: Token meta of a sharded batch.

    Returns:
        The same :class:`AttentionPlan` for every call with this meta object.
    """
    plan = meta.plan_cache.get("attention")
    if plan is None:
        plan = AttentionPlan(meta)
        meta.plan_cache["attention"] = plan
    assert isinstance(plan, AttentionPlan)
    return plan
