"""The attention plan's run table of a placement given by its pads, without a per-token pass.

A closed-form placement (``contiguous``, ``round_robin``, ``none``) knows its stream as a few
contiguous runs of positions (:attr:`~cpshard.layouts.placement.Placement.stream_runs`) and its
documents by their pads alone (:class:`~cpshard.layouts.placement.PaddedRows`: each row's real
tokens are one document, every pad its own). The runs the plan needs (maximal stretches of one
document, or of pads, with consecutive positions, cut at the rank blocks) are then the stream
runs cut where a row's pad state changes: found from those changes (one pass over the ``[B, P]``
bools) instead of from the ``[B, P]`` int64 ids in stream order (two fresh 2 MB tensors and a
pass over them at ``[8, 32768]``). :func:`pad_table` returns the same row groups and the same
table as the token pass of :func:`cpshard.attention.plan.host_rows` (tests compare them).

Import rules: the rows of ``RULES`` in tests/unit/test_architecture.py that cover this module.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from cpshard.attention.pieces import PAD_CLASS, RunTable, join_runs

__all__ = ["pad_table", "row_groups_by_pads"]

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


def _blocked_runs(runs: tuple[tuple[int, int], ...], cut: int) -> tuple[_I64, _I64]:
    """``(slot, pos)``: the first slot and position of every stream run, each run cut at the
    multiples of ``cut`` slots."""
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


def pad_table(
    pad: npt.NDArray[np.bool_],
    firsts: list[int],
    changes: list[_I64],
    runs: tuple[tuple[int, int], ...],
    cut: int,
) -> RunTable:
    """The run table of the row groups' streams (slots numbered ``g * W + i``), pads merged.

    Args:
        pad: ``[R, W]`` bools in global position order, ``True`` = pad.
        firsts: The first row of every group.
        changes: Per group, the positions where its pad state changes
            (:func:`row_groups_by_pads`).
        runs: The stream as ``(start position, length)`` runs in stream order (they tile
            ``0..W-1``).
        cut: Runs never cross a multiple of ``cut`` slots (the local length ``L``).

    Returns:
        The table ``run_table(pos, doc, True, breaks=cut)`` finds from the groups' positions and
        document ids in stream order (class ``0`` for real tokens, :data:`~cpshard.attention.
        pieces.PAD_CLASS` for pads).
    """
    width = pad.shape[1]
    r_slot, r_pos = _blocked_runs(runs, cut)
    by_pos = np.argsort(r_pos, kind="stable")
    s_pos, s_slot = r_pos[by_pos], r_slot[by_pos]
    n_groups = len(firsts)
    # every group's cut points in position order: its pad changes and the runs' starts
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
    is_pad = pad[np.asarray(firsts, dtype=np.int64)[grp], p0]
    order = np.lexsort((slot, grp))
    grp, slot, p0, n, is_pad = grp[order], slot[order], p0[order], (end - p0)[order], is_pad[order]
    cls = np.where(is_pad, PAD_CLASS, 0).astype(np.int64)
    table = RunTable(grp * width + slot, n, p0, cls, grp)
    return join_runs(table, width, cut)
