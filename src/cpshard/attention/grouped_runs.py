"""The visibility facts of several row groups at once: one code space for every group and rank.

A batch whose rows differ in structure (``[B, S]`` rows padded to different lengths: one row
group per distinct row) has one :class:`~cpshard.attention.visibility.RankRuns` per group, and
the facts of ``attention="auto"`` and the selective exchange were asked group by group: a few
dozen small numpy calls per group, which at ``[8, 32768]`` cost more than the runs' work. Here
the real runs of every group are laid out in one code space, group ``g``'s rank ``r`` block at
``(g * C + r) * stride`` (the rank blocks of :meth:`RankRuns.shift`, one set per group), so
every question is one vectorized pass over the runs of all groups:

* :meth:`GroupedRuns.pairs`: the visible pairs of each rank's queries (weighted by the meta rows
  each group stands for), and those against its own keys;
* :meth:`GroupedRuns.matrix`: ``m[t, o]``, the slots of rank ``o`` some query of rank ``t`` sees
  in any group (what the selective exchange moves);
* :meth:`GroupedRuns.needed_spans` and :meth:`GroupedRuns.wanted`: one rank's side of it.

Codes of one group stay below ``stride`` above its block, queries only see keys of their own
document, so no group sees another's keys. Only where ``2 * G * C * stride < 2**62``
(:attr:`GroupedRuns.fits`); the callers ask group by group otherwise.

Import rules: the rows of ``RULES`` in tests/unit/test_architecture.py that cover this module.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from cpshard.attention.visibility import (
    KeyCounts,
    RankRuns,
    StreamRuns,
    Union,
    per_rank,
    query_intervals,
    remote_slot_matrix,
    visible_pairs,
    wanted_slots,
)

__all__ = ["GroupedRuns"]

_I64 = npt.NDArray[np.int64]


class GroupedRuns:
    """The real runs of every row group in one code space (see the module doc).

    Args:
        groups: One :class:`RankRuns` per row group, of one frame and CP size.
        real: The real runs of every group, group after group (default: joined from
            ``groups``).
        grp: ``[R]`` the group of each of them (with ``real``).

    Attributes:
        groups: The groups' runs it was made of.
        real: The real runs of every group, group after group.
        grp: ``[R]`` the group of each run of :attr:`real`.
        pad_tokens: ``[G, C]`` pad tokens of each group and rank.
        lanes: Rank blocks of every group, ``G * C``.
        fits: The codes of every group and rank block fit int64, twice over.
    """

    def __init__(
        self,
        groups: tuple[RankRuns, ...],
        real: StreamRuns | None = None,
        grp: _I64 | None = None,
    ) -> None:
        first = groups[0]
        self.groups = groups
        self.world = first.world
        self.frame = first.frame
        self.stride = first.stride
        if real is None or grp is None:
            reals = [g.real for g in groups]
            fields = StreamRuns.__dataclass_fields__
            real = StreamRuns(*(np.concatenate([getattr(r, f) for r in reals]) for f in fields))
            sizes = [r.n.size for r in reals]
            grp = np.repeat(np.arange(len(groups), dtype=np.int64), sizes)
        self.real = real
        self.grp: _I64 = grp
        self.pad_tokens = _pad_tokens(groups)
        self.lanes = len(groups) * self.world  # rank blocks of every group
        self.fits = 2 * self.lanes * self.stride < 1 << 62  # twice: see :meth:`pairs`
        self._lane = self.grp * self.world  # the block of each run's group and rank 0
        self._seen: dict[tuple[bool, int | None], Union] = {}

    def shift(self, rank: _I64 | int, sel: _I64 | npt.NDArray[np.bool_] | None = None) -> _I64:
        """Code shift of the runs ``sel`` (default: all) into the block of ``rank`` of their
        group."""
        lane = self._lane if sel is None else self._lane[sel]
        out: _I64 = (lane + rank) * self.stride
        return out

    def seen(self, causal: bool, window: int | None) -> Union:
        """The codes every rank's real queries see, each group and rank in its block."""
        hit = self._seen.get((causal, window))
        if hit is None:
            lo, hi = query_intervals(self.real, self.frame, causal, window)
            at = self.shift(self.real.rank)
            hit = self._seen[(causal, window)] = Union(lo + at, hi + at)
        return hit

    def pairs(
        self, weights: _I64, causal: bool, window: int | None
    ) -> tuple[_I64, _I64]:  # fmt: skip
        """``([C], [C])``: visible pairs of each rank's queries against every key and against its
        own keys, each group's weighted by ``weights[g]`` (a pad sees itself, on its rank)."""
        c, q = self.world, self.real
        pads = (weights[:, None] * self.pad_tokens).sum(axis=0)
        w = weights[self.grp]
        # one key set for both questions: every rank's keys of a group in the group's rank-0
        # block, and each rank's own keys in its block past every group's (lanes G * C on)
        every_at = self.shift(0)
        own_at = self.shift(q.rank + self.lanes)
        lo = np.concatenate([q.code + every_at, q.code + own_at])
        keys = KeyCounts(lo, lo + np.concatenate([q.n, q.n]))
        both = StreamRuns(
            *(
                np.concatenate([col, col])
                for col in (q.start, q.n, q.pos, q.doc, q.rank, q.pad, q.code)
            )
        )
        seen = visible_pairs(
            both, keys, self.frame, causal, window, np.concatenate([every_at, own_at])
        )
        r = q.n.size
        pairs = pads + per_rank(q.rank, w * seen[:r], c)
        return pairs, pads + per_rank(q.rank, w * seen[r:], c)

    def matrix(self, causal: bool, window: int | None, local_len: int) -> _I64:
        """``[C, C]``: ``m[t, o]`` = slots of rank ``o`` some query of rank ``t`` sees in any
        group (0 on the diagonal). Every run is tiled once per rank ``t`` (a few ranks per pass,
        at most ~2**21 runs at once) and found in ``t``'s block of its group; the slot ranges,
        moved to ``t * C * L + slot``, form one union measured at every ``(t * C + o) * L``."""
        return remote_slot_matrix(
            [(self.real, self.seen(causal, window), self.shift)], self.world, local_len
        )

    def needed_spans(self, rank: int, causal: bool, window: int | None) -> tuple[_I64, _I64]:
        """``(lo, hi)``: the stream slots off ``rank`` some query of ``rank`` sees in any group,
        as sorted disjoint ranges (touching ranges joined)."""
        sel = np.flatnonzero(self.real.rank != rank)
        s0, s1, _ = self.seen(causal, window).covered_spans(
            self.real.take(sel), self.shift(rank, sel)
        )
        u = Union(s0, s1)
        return u.lo, u.hi

    def wanted(self, rank: int, causal: bool, window: int | None, local_len: int) -> list[_I64]:
        """Per rank ``t``: the sorted local slots of ``rank`` some query of ``t`` sees in any
        group (none for ``rank`` itself): what ``rank`` sends to ``t``."""
        return wanted_slots(
            [(self.real, self.seen(causal, window), self.shift)], rank, self.world, local_len
        )


def _pad_tokens(groups: tuple[RankRuns, ...]) -> _I64:
    """``[G, C]`` pad tokens of each group and rank, every group's runs in one pass (not each
    group's :attr:`~cpshard.attention.visibility.RankRuns.pad_tokens`)."""
    c = groups[0].world
    runs = [g.runs for g in groups]
    pad = np.concatenate([r.pad for r in runs])
    lane = np.concatenate([r.rank + g * c for g, r in enumerate(runs)])
    n = np.concatenate([r.n for r in runs])
    return per_rank(lane[pad], n[pad], len(groups) * c).reshape(len(groups), c)
