"""The attention plan's run table of a placement that describes its documents, without a
per-token pass.

A closed-form placement (``contiguous``, ``round_robin``, ``none``) knows its stream as a few
contiguous runs of positions (:attr:`~cpshard.layouts.placement.Placement.stream_runs`) and its
documents by their pads alone (:class:`~cpshard.layouts.placement.PaddedRows`: each row's real
tokens are one document, every pad its own); a packed plan knows its documents as runs of
positions (:class:`~cpshard.layouts.placement.DocumentRuns`), and its stream's runs are found in
one pass over the rank map. The runs the plan needs (maximal stretches of one document, or of
pads, with consecutive positions, cut at the rank blocks) are then the stream runs cut where a
row's class changes (:func:`piece_table`), instead of a pass over the ``[B, P]`` int64 ids in
stream order (two fresh 2 MB tensors at ``[8, 32768]``). The tables and row groups are those of
the token pass of :func:`cpshard.attention.plan.host_rows` (tests compare them).

Import rules: the rows of ``RULES`` in tests/unit/test_architecture.py that cover this module.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import numpy.typing as npt

from cpshard.attention.pieces import PAD_CLASS, RunTable, join_runs
from cpshard.layouts.index import run_starts, runs_over

__all__ = [
    "blocked_runs",
    "pad_table",
    "piece_table",
    "rank_map_runs",
    "row_groups_by_pads",
    "runs_table",
]

_I64 = npt.NDArray[np.int64]


def row_groups_by_pads(pad: npt.NDArray[np.bool_]) -> tuple[list[list[int]], list[_I64]]:
    """Rows with equal pads, in order of first appearance, and the pad changes of each group.

    Args:
        pad: ``[R, W]`` bools, ``True`` = pad (a read-only broadcast is fine).

    Returns:
        ``(groups, changes)``: the rows of every group, and per group the positions ``p`` (in
        ``1..W-1``) where its first row's pad state differs from position ``p - 1``.
    """
    n_rows, width = pad.shape
    if n_rows == 1 or pad.strides[0] == 0 or width < 2:
        first = np.flatnonzero(pad[0, 1:] != pad[0, :-1]) + 1 if width > 1 else np.zeros(0, int)
        return [list(range(n_rows))], [first.astype(np.int64)]
    flat = np.flatnonzero(pad[:, 1:] != pad[:, :-1])
    row = flat // (width - 1)
    col = flat - row * (width - 1) + 1
    bounds = np.searchsorted(row, np.arange(n_rows + 1)).tolist()
    seen: dict[bytes, int] = {}
    groups: list[list[int]] = []
    changes: list[_I64] = []
    for r in range(n_rows):
        mine = col[bounds[r] : bounds[r + 1]]
        key = bytes([int(pad[r, 0])]) + mine.tobytes()
        g = seen.get(key)
        if g is None:
            seen[key] = len(groups)
            groups.append([r])
            changes.append(mine.astype(np.int64, copy=False))
        else:
            groups[g].append(r)
    return groups, changes


def blocked_runs(runs: tuple[tuple[int, int], ...], cut: int) -> tuple[_I64, _I64]:
    """``(slot, pos)``: the first slot and position of every stream run given as
    ``(start position, length)`` in stream order, each run cut at the multiples of ``cut``
    slots (a closed-form layout's few runs)."""
    slot, pos = [], []
    seen = 0
    for start, length in runs:
        done = 0
        while done < length:
            here = seen + done
            take = min(length - done, cut - here % cut)
            slot.append(here)
            pos.append(start + done)
            done += take
        seen += length
    return np.array(slot, dtype=np.int64), np.array(pos, dtype=np.int64)


def rank_map_runs(stream: _I64, cut: int) -> tuple[_I64, _I64]:
    """``(slot, pos)`` of the runs of consecutive positions of a flattened rank map, cut at the
    multiples of ``cut`` slots (one pass over its ``P`` positions,
    :func:`~cpshard.layouts.index.run_starts`)."""
    slot = run_starts(stream, cut)
    return slot, stream[slot]


def piece_table(
    changes: list[_I64],
    cls_at: Callable[[_I64, _I64], _I64],
    runs: tuple[_I64, _I64],
    width: int,
    cut: int,
) -> RunTable:
    """The run table of the row groups' streams (slots numbered ``g * W + i``), pads merged.

    Args:
        changes: Per row group, the positions (``1..W-1``) where its class may change.
        cls_at: ``(groups, positions) -> classes`` of pieces that start there (``0`` or a
            document id for real tokens, :data:`~cpshard.attention.pieces.PAD_CLASS` for pads).
        runs: ``(slot, pos)`` of the stream's runs of consecutive positions (they tile
            ``0..W-1``, none crossing a multiple of ``cut`` slots).
        width: ``W``, slots per row group.
        cut: Runs never cross a multiple of ``cut`` slots (the local length ``L``).

    Returns:
        The table ``run_table(pos, doc, True, breaks=cut)`` finds from the groups' positions and
        document ids in stream order.
    """
    r_slot, r_pos = runs
    by_pos = np.argsort(r_pos, kind="stable")
    s_pos, s_slot = r_pos[by_pos], r_slot[by_pos]
    n_groups = len(changes)
    # every group's cut points in position order: its class changes and the runs' starts
    stride = width + 1
    keys = np.unique(np.concatenate([
        *(g * stride + c for g, c in enumerate(changes)),
        (np.arange(n_groups, dtype=np.int64)[:, None] * stride + r_pos[None, :]).reshape(-1),
    ]))  # fmt: skip
    grp = keys // stride
    p0 = keys - grp * stride
    end = np.append(p0[1:], width)
    end[:-1][grp[1:] != grp[:-1]] = width  # a group's last piece ends at W
    j = np.searchsorted(s_pos, p0, side="right") - 1
    slot = s_slot[j] + p0 - s_pos[j]
    cls = cls_at(grp, p0)
    order = np.lexsort((slot, grp))
    grp, slot, p0, n, cls = grp[order], slot[order], p0[order], (end - p0)[order], cls[order]
    table = RunTable(grp * width + slot, n, p0, cls.astype(np.int64, copy=False), grp)
    return join_runs(table, width, cut)


def pad_table(
    pad: npt.NDArray[np.bool_],
    firsts: list[int],
    changes: list[_I64],
    runs: tuple[_I64, _I64],
    cut: int,
) -> RunTable:
    """:func:`piece_table` of rows given by their pads (class ``0`` for real tokens).

    Args:
        pad: ``[R, W]`` bools in global position order, ``True`` = pad.
        firsts: The first row of every group.
        changes: Per group, the positions where its pad state changes
            (:func:`row_groups_by_pads`).
        runs: ``(slot, pos)`` of the stream's runs (:func:`blocked_runs`, :func:`rank_map_runs`).
        cut: The local length ``L``.
    """
    rows = np.asarray(firsts, dtype=np.int64)

    def cls_at(grp: _I64, pos: _I64) -> _I64:
        out: _I64 = np.where(pad[rows[grp], pos], PAD_CLASS, 0)
        return out

    return piece_table(changes, cls_at, runs, pad.shape[1], cut)


def runs_table(
    stream: _I64 | None,
    starts: _I64,
    ids: _I64,
    cut: int,
    min_run: int = 1,
    runs: tuple[_I64, _I64] | None = None,
    length: int | None = None,
) -> RunTable | None:
    """The run table of one row given by its document runs (run ``k`` from ``starts[k]``,
    document ``ids[k]``, pads where negative: :class:`~cpshard.layouts.placement.DocumentRuns`)
    and its stream order ``stream`` (the rank map flattened): the stream's runs of consecutive
    positions, cut at the multiples of ``cut`` slots and at the document runs' starts
    (:func:`~cpshard.layouts.index.runs_over`: no sort, no pass over the tokens but the one that
    finds the stream's runs), neighbours that continue each other joined (pad stretches
    merged): the table :func:`~cpshard.attention.pieces.run_table` finds token by token.

    Args:
        stream: ``[P]`` int64 positions in stream order.
        starts: ``[K]`` int64 document run starts (``0`` first, increasing).
        ids: ``[K]`` int64 document of each run, negative for pads.
        cut: The local length ``L``.
        min_run: ``None`` where the stream has more than one run of consecutive positions per
            ``min_run`` slots (the caller then takes the token pass).
        runs: ``(first, count)``: the stream's runs of consecutive positions in slot order,
            none across a multiple of ``cut`` (:func:`blocked_runs`), where known; ``stream``
            is then ``None`` (no pass over it).
        length: ``P`` where ``stream`` is ``None``.
    """
    width = stream.size if stream is not None else length
    assert width is not None, "runs_table: give the stream or its length"
    got = runs_over(stream, starts, width, min_run, cut, runs)
    if got is None:
        return None
    k, first, count = got
    slot = np.cumsum(count) - count  # the pieces tile the stream in order
    cls = np.where(ids < 0, PAD_CLASS, ids)[k]
    table = RunTable(slot, count, first, cls, np.zeros(slot.size, dtype=np.int64))
    return join_runs(table, width, cut)
