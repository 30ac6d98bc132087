"""Which key slots each rank's queries can see: the plan of the selective K/V exchange.

Host side, numpy, from the token meta alone. Every rank holds the global meta (positions and
document ids of every rank's tokens), so every rank derives the same facts about every other rank:
what it sends to each peer equals what that peer expects from it, without exchanging split sizes.

Visibility is the plan's rule (:mod:`cpshard.attention.plan`): query ``q`` sees key ``k`` iff both
have the same document id and (causal) ``k_pos <= q_pos`` (and ``q_pos - k_pos < window``). So
the keys one query sees are the positions ``[lo, hi)`` of its document, with ``hi = q_pos + 1``
and ``lo = q_pos - window + 1`` (causal; ``lo`` unbounded without a window) or the whole document
(bidirectional). A rank's queries see the union of their intervals; encoded as
``(document, position)`` on one int64 axis the union is a sorted set of disjoint intervals, and a
key is needed iff a binary search finds it inside one. Cost ``O(S log S)`` per rank for a stream of
``S`` tokens, no ``[Lq, Lk]`` matrix.

Batch rows: the exchange moves whole key slots ``[B, H, ., D]``, shared by every row, so a slot is
sent when a query of *any* row group needs it (the union over row groups). With one meta row (the
packed batch) that is exactly the needed set.

Owns :class:`SelectivePlan` (this rank's exchange and kernel plans) and :func:`exchange_counts`
(the ``[C, C]`` matrix of key slots each rank needs from each other, for the cost model).

Import rules: the rows of ``RULES`` in tests/unit/test_architecture.py that cover this module.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from cpshard.attention.plan import PairPlan, pair_plan
from cpshard.sharding.meta import TokenMeta

__all__ = [
    "MetaArrays",
    "SelectivePlan",
    "covered",
    "exchange_counts",
    "intervals",
    "meta_arrays",
    "needed_by",
    "query_bounds",
    "selective_plan",
]


@dataclass(frozen=True)
class MetaArrays:
    """Host copies of a token meta, one row per group of batch rows with equal structure.

    Attributes:
        pos: ``[G, C * L]`` global positions, rank-major stream.
        doc: ``[G, C * L]`` document ids.
        rows: Batch rows of every group, or ``None`` (one group serving every row).
        weights: ``[G]`` how many meta rows each group stands for.
        world: CP size ``C``.
        local_len: Tokens per rank ``L``.
        frame: ``(lowest document id, lowest position, position span)`` of the encoding.
    """

    pos: np.ndarray
    doc: np.ndarray
    rows: list[list[int]] | None
    weights: np.ndarray
    world: int
    local_len: int
    frame: tuple[int, int, int]

    def enc(self, doc: np.ndarray, x: np.ndarray) -> np.ndarray:
        """``(document, position)`` -> one sortable int64 (positions clipped to the span)."""
        lo_doc, lo_pos, span = self.frame
        codes: np.ndarray = (doc - lo_doc) * span + np.clip(x - lo_pos, 0, span - 1)
        return codes

    def rank_slice(self, rank: int) -> slice:
        """Stream slots of ``rank``'s local tokens."""
        return slice(rank * self.local_len, (rank + 1) * self.local_len)


def meta_arrays(meta: TokenMeta) -> MetaArrays:
    """The :class:`MetaArrays` of ``meta`` (cached on it: one host copy per batch)."""
    hit = meta.plan_cache.get("meta_arrays")
    if isinstance(hit, MetaArrays):
        return hit
    pos = meta.positions.detach().cpu().numpy().astype(np.int64)
    doc = meta.document_ids.detach().cpu().numpy().astype(np.int64)
    groups: dict[bytes, list[int]] = {}
    for r in range(pos.shape[0]):
        groups.setdefault(pos[r].tobytes() + b"|" + doc[r].tobytes(), []).append(r)
    firsts = [g[0] for g in groups.values()]
    rows = None if len(groups) == 1 else list(groups.values())
    weights = np.array([len(g) for g in groups.values()], dtype=np.int64)
    p, d = pos[firsts], doc[firsts]
    frame = (int(d.min()), int(p.min()), int(p.max()) - int(p.min()) + 2) if p.size else (0, 0, 2)
    arrays = MetaArrays(p, d, rows, weights, meta.world_size, meta.local_len, frame)
    meta.plan_cache["meta_arrays"] = arrays
    return arrays


def query_bounds(
    a: MetaArrays, g: int, rank: int, causal: bool, window: int | None
) -> tuple[np.ndarray, np.ndarray]:
    """Per query of ``rank`` (row group ``g``): the encoded keys it sees, ``[lo, hi)``.

    Returns:
        ``(lo, hi)``: int64 ``[L]`` each, in ``rank``'s local order.
    """
    sl = a.rank_slice(rank)
    qp, qd = a.pos[g, sl], a.doc[g, sl]
    far = np.iinfo(np.int32).max  # clipped to the document's ends by enc
    if causal:
        lo_pos = qp - window + 1 if window is not None else np.full_like(qp, -far)
        hi_pos = qp + 1
    else:
        lo_pos, hi_pos = np.full_like(qp, -far), np.full_like(qp, far)
    return a.enc(qd, lo_pos), a.enc(qd, hi_pos)


def intervals(
    a: MetaArrays, g: int, rank: int, causal: bool, window: int | None
) -> tuple[np.ndarray, np.ndarray]:
    """The keys ``rank``'s queries of row group ``g`` see, as disjoint encoded intervals.

    Returns:
        ``(lo, hi)``: sorted int64 arrays; a key with code ``c`` is seen iff
        ``lo[i] <= c < hi[i]`` for some ``i``.
    """
    lo, hi = query_bounds(a, g, rank, causal, window)
    order = np.argsort(lo, kind="stable")
    lo, hi = lo[order], np.maximum.accumulate(hi[order])
    if lo.size == 0:
        return lo, hi
    start = np.ones(lo.size, dtype=bool)
    start[1:] = lo[1:] > hi[:-1]  # a gap before it: a new disjoint interval starts here
    first = np.flatnonzero(start)
    last = np.append(first[1:], lo.size) - 1
    return lo[first], hi[last]


def covered(codes: np.ndarray, lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
    """Bool mask: which ``codes`` fall inside one of the disjoint intervals ``[lo, hi)``."""
    idx = np.searchsorted(lo, codes, side="right") - 1
    inside = idx >= 0
    inside[inside] = codes[inside] < hi[idx[inside]]
    return inside


def needed_by(
    a: MetaArrays, rank: int, causal: bool, window: int | None, slots: slice | None = None
) -> np.ndarray:
    """Bool mask over stream ``slots`` (default all ``C * L``): the slots some query of ``rank``
    sees (any row group), own included."""
    sl = slice(0, a.pos.shape[1]) if slots is None else slots
    need = np.zeros(sl.stop - sl.start, dtype=bool)
    for g in range(a.pos.shape[0]):
        lo, hi = intervals(a, g, rank, causal, window)
        need |= covered(a.enc(a.doc[g, sl], a.pos[g, sl]), lo, hi)
    return need


def exchange_counts(a: MetaArrays, causal: bool, window: int | None) -> np.ndarray:
    """``[C, C]`` int64: ``m[t, o]`` = key slots of rank ``o`` some query of rank ``t`` sees.

    The diagonal holds each rank's own keys it attends to (not exchanged). Row sums off the
    diagonal are what the selective exchange receives, column sums what it sends. With several
    row groups the count is the sum over groups capped at ``L``: an upper bound of the union the
    exchange moves (exact for one row group).
    """
    c, n = a.world, a.local_len
    out = np.zeros((c, c), dtype=np.int64)
    for g in range(a.pos.shape[0]):
        codes = a.enc(a.doc[g], a.pos[g])
        owned = [np.sort(codes[a.rank_slice(o)]) for o in range(c)]
        for t in range(c):
            lo, hi = intervals(a, g, t, causal, window)
            for o in range(c):
                keys = owned[o]
                out[t, o] += int(
                    (np.searchsorted(keys, hi, "left") - np.searchsorted(keys, lo, "left")).sum()
                )
    return np.minimum(out, n)


@dataclass(frozen=True)
class SelectivePlan:
    """This rank's side of the selective K/V exchange, and its kernel plans.

    Attributes:
        send_index: LongTensor ``[sum(send_splits)]`` of local slots, grouped by destination rank
            (a slot needed by several ranks appears once per rank).
        send_splits: Slots sent to each rank, ``C`` entries (0 for this rank).
        recv_splits: Slots received from each rank, ``C`` entries (0 for this rank).
        recv_slots: Stream slots of the received keys, in the order they arrive (rank-major).
        local: Local queries against this rank's own keys ``[L]``.
        remote: Local queries against the received keys ``[sum(recv_splits)]``.
    """

    send_index: torch.Tensor
    send_splits: tuple[int, ...]
    recv_splits: tuple[int, ...]
    recv_slots: np.ndarray
    local: PairPlan
    remote: PairPlan

    @property
    def sent(self) -> int:
        """Key slots this rank sends per layer (forward)."""
        return sum(self.send_splits)

    @property
    def received(self) -> int:
        """Key slots this rank receives per layer (forward): what its queries need, no more."""
        return sum(self.recv_splits)


def selective_plan(
    meta: TokenMeta, causal: bool, window: int | None, device: torch.device
) -> SelectivePlan:
    """The :class:`SelectivePlan` of ``meta``'s rank, cached on the meta per mask and device.

    Args:
        meta: Token meta of the sharded batch (global: every rank's positions and documents).
        causal: Causal masking by global position.
        window: Sliding window or ``None``.
        device: Device of the index tensor and the kernel masks.

    Returns:
        The same plan object for every call with these arguments.
    """
    key = f"selective|{causal}|{window}|{device}"
    hit = meta.plan_cache.get(key)
    if isinstance(hit, SelectivePlan):
        return hit
    a = meta_arrays(meta)
    rank, world, n = meta.rank, a.world, a.local_len
    own = a.rank_slice(rank)
    need = needed_by(a, rank, causal, window)
    need[own] = False
    recv_slots = np.flatnonzero(need)
    recv_splits = tuple(int(x) for x in np.bincount(recv_slots // max(n, 1), minlength=world))
    sends: list[np.ndarray] = []
    for t in range(world):
        if t == rank:
            sends.append(np.zeros(0, dtype=np.int64))
            continue
        sends.append(np.flatnonzero(needed_by(a, t, causal, window, own)))
    send_index = np.concatenate(sends) if sends else np.zeros(0, dtype=np.int64)
    q_pos, q_doc = a.pos[:, own], a.doc[:, own]
    k_pos, k_doc = a.pos[:, recv_slots], a.doc[:, recv_slots]
    plan = SelectivePlan(
        send_index=torch.from_numpy(send_index).to(device),
        send_splits=tuple(int(s.size) for s in sends),
        recv_splits=recv_splits,
        recv_slots=recv_slots,
        local=pair_plan(
            q_pos, q_doc, q_pos, q_doc, a.rows, causal=causal, window=window, device=device
        ),
        remote=pair_plan(
            q_pos, q_doc, k_pos, k_doc, a.rows, causal=causal, window=window, device=device
        ),
    )
    meta.plan_cache[key] = plan
    return plan
