"""Index helpers shared by every layout: padded lengths, rank-map checks, inverse permutations and
runs of consecutive indices. Pure index math (torch and numpy only).

Import rules: the rows of ``RULES`` in tests/unit/test_architecture.py that cover this module.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt
import torch

__all__ = [
    "arange_runs",
    "check_map_runs",
    "check_rank_map",
    "consecutive_runs",
    "inverse_permutation",
    "padded_length",
    "run_starts",
    "runs_over",
]

_I64 = npt.NDArray[np.int64]

_PASS_CHUNK = 1 << 15
"""Values per chunk of :func:`run_starts`' pass (a 256 KiB int64 temporary)."""


def padded_length(seq_len: int, divisor: int) -> int:
    """Smallest multiple of ``divisor`` that holds ``seq_len`` tokens.

    Args:
        seq_len: Number of real tokens, ``>= 0``.
        divisor: Required divisor of the padded length, ``>= 1``.

    Returns:
        ``seq_len + (-seq_len) % divisor``.
    """
    if seq_len < 0:
        raise ValueError(f"seq_len must be >= 0, got seq_len={seq_len}")
    if divisor < 1:
        raise ValueError(f"divisor must be >= 1, got divisor={divisor}")
    return seq_len + (-seq_len) % divisor


def inverse_permutation(order: torch.Tensor) -> torch.Tensor:
    """Inverse of a permutation of ``arange(n)``.

    Args:
        order: LongTensor ``[n]``; ``order[i]`` is the global position held at stream slot ``i``.

    Returns:
        LongTensor ``[n]`` ``inv`` with ``inv[order[i]] = i``, so ``stream[inv]`` is global order.
    """
    inv = torch.empty_like(order)
    inv[order] = torch.arange(order.numel(), dtype=order.dtype, device=order.device)
    return inv


def check_rank_map(rank_map: torch.Tensor, padded_seq_len: int) -> None:
    """Check that a ``[C, L]`` map is a bijection onto ``arange(padded_seq_len)``.

    Args:
        rank_map: LongTensor ``[C, L]``; row ``r`` holds the global positions of rank ``r``.
        padded_seq_len: Expected length of the padded global stream, ``C * L``.

    Raises:
        ValueError: When the map does not cover every position exactly once.
    """
    if rank_map.dim() != 2 or rank_map.numel() != padded_seq_len:
        raise ValueError(
            f"a rank map must be [C, L] with C*L == padded_seq_len={padded_seq_len}, "
            f"got shape {tuple(rank_map.shape)}"
        )
    flat = rank_map.reshape(-1)
    if flat.numel():
        lo, hi = (int(v) for v in torch.aminmax(flat))
        if lo < 0 or hi >= padded_seq_len:
            raise ValueError(
                f"a rank map holds positions outside [0, {padded_seq_len}): min={lo}, max={hi}"
            )
    # C * L == P positions in range: a bijection iff every position is hit (pigeonhole)
    if flat.device.type == "cpu":
        hit = np.zeros(padded_seq_len, dtype=bool)
        hit[flat.numpy()] = True
        covered = bool(hit.all())
    else:
        seen = torch.zeros(padded_seq_len, dtype=torch.bool, device=flat.device)
        covered = bool(seen.index_fill_(0, flat, True).all())
    if not covered:
        counts = torch.bincount(flat, minlength=padded_seq_len)
        bad = int((counts != 1).nonzero()[0])
        raise ValueError(
            f"a rank map must cover each of the {padded_seq_len} positions exactly once; "
            f"position {bad} appears {int(counts[bad])} times"
        )


def check_map_runs(
    first: _I64, count: _I64, padded_seq_len: int, world_size: int, *, tiling: bool = True
) -> None:
    """Check in ``O(runs log runs)`` that the rank map ``arange_runs(first, count, 1)``,
    reshaped to ``[C, L]``, is a bijection onto ``arange(padded_seq_len)`` whose runs stay
    inside their rank's row (what :func:`check_rank_map` checks on the map, token by token).

    Args:
        first: ``[K]`` int64, the first position of each run, in slot order.
        count: ``[K]`` int64 run lengths (``> 0``).
        padded_seq_len: ``P``.
        world_size: ``C`` (``P`` divisible by it).
        tiling: ``False``: leave out the tiling of ``arange(P)`` (the sort; the caller checks
            the map itself with :func:`check_rank_map`), check the rest in ``O(runs)``.

    Raises:
        ValueError: an empty run, runs that do not tile ``arange(P)`` (a gap or an overlap), a
            run across two ranks' rows, or ``P`` not divisible by ``C``.
    """
    if world_size < 1 or padded_seq_len % world_size or int(count.sum()) != padded_seq_len:
        raise ValueError(
            f"rank map runs must cover P={padded_seq_len} slots, P divisible by the CP size "
            f"{world_size}; got {int(count.sum())} slots"
        )
    if count.size and int(count.min()) <= 0:
        raise ValueError(f"rank map runs must be non-empty, got a run of {int(count.min())}")
    if tiling:
        by_first = np.argsort(first, kind="stable")
        lo, n = first[by_first], count[by_first]
        ends = np.empty_like(lo)
        ends[:1] = 0
        ends[1:] = (lo + n)[:-1]
        gaps = np.flatnonzero(lo != ends)
        if gaps.size:
            raise ValueError(
                f"a rank map must cover each of the {padded_seq_len} positions exactly once; "
                f"its runs leave a gap or overlap at position {int(lo[gaps[0]])}"
            )
    local = max(padded_seq_len // world_size, 1)
    slot = np.cumsum(count) - count
    across = np.flatnonzero(slot // local != (slot + count - 1) // local)
    if across.size:
        raise ValueError(
            f"rank map run {int(across[0])} (slots {int(slot[across[0]])}.."
            f"{int(slot[across[0]] + count[across[0]] - 1)}) crosses a rank's row of L={local}"
        )


def consecutive_runs(idx: torch.Tensor, *, split_every: int | None = None) -> list[tuple[int, int]]:
    """Maximal runs of consecutive values in an index vector.

    Closed-form layouts are unions of a few contiguous chunks, so a shard or a gather can copy
    whole slices (one ``cat``) instead of indexing element by element.

    Args:
        idx: LongTensor ``[n]``.
        split_every: Also end a run at every multiple of this many *values* (e.g. the local
            length, so that no run crosses from one rank's gathered shard into the next).

    Returns:
        ``[(first_value, length), ...]`` covering ``idx`` in order.

    Example:
        >>> consecutive_runs(torch.tensor([0, 1, 6, 7]))
        [(0, 2), (6, 2)]
    """
    n = idx.numel()
    if n == 0:
        return []
    brk = idx[1:] != idx[:-1] + 1
    if split_every is not None:
        brk = brk | (idx[1:] % split_every == 0)
    cut = (brk.nonzero().reshape(-1) + 1).tolist()
    starts = [0, *cut]
    ends = [*cut, n]
    firsts = idx[starts].tolist()
    return [(v, e - s) for v, s, e in zip(firsts, starts, ends, strict=True)]


_LONG_RUNS = 2048
""":func:`arange_runs` writes runs that average at least this many values one slice each (one
pass over the output); shorter ones in a repeat and a cumsum (two passes, no Python step per
run)."""

_RAMP = 1 << 16
"""Runs this long or longer are written by ``torch.arange`` into their slice, shorter ones from
one shared ``arange`` of at most this many values."""


def arange_runs(first: _I64, counts: _I64, step: _I64 | int, out: _I64 | None = None) -> _I64:
    """``concat(first[i] + step[i] * arange(counts[i]))`` as one int64 array, built in place
    (runs that average :data:`_LONG_RUNS` values or more: one slice each; shorter ones: a repeat
    and a cumsum over the output; no temporaries of its size), into ``out`` if given (only with
    a scalar ``step``).

    Example:
        >>> arange_runs(np.array([5, 0]), np.array([2, 3]), 1).tolist()
        [5, 6, 0, 1, 2]
    """
    keep = counts > 0
    first, counts = first[keep], counts[keep]
    total = int(counts.sum())
    if counts.size and total >= _LONG_RUNS * counts.size:
        steps = [step] * counts.size if isinstance(step, int) else step[keep].tolist()
        if out is None:
            out = np.empty(total, dtype=np.int64)
        return _slices(first.tolist(), counts.tolist(), steps, out)
    if isinstance(step, int):
        if out is None:
            out = np.empty(total, dtype=np.int64)
        out.fill(step)
        step_kept: _I64 | int = step
    else:
        step_kept = step[keep]
        out = np.repeat(step_kept, counts)
    if not counts.size:
        return out
    offsets = np.cumsum(counts) - counts
    jump = first.copy()
    jump[1:] -= first[:-1] + (counts[:-1] - 1) * (
        step_kept if isinstance(step_kept, int) else step_kept[:-1]
    )
    out[offsets] = jump
    np.cumsum(out, out=out)
    return out


def _slices(first: list[int], counts: list[int], steps: list[int], out: _I64) -> _I64:
    """:func:`arange_runs` of long runs, each written into its slice of ``out``."""
    ramp = np.arange(min(max(counts), _RAMP), dtype=np.int64)
    flat = torch.from_numpy(out)
    at = 0
    for f, n, s in zip(first, counts, steps, strict=True):
        dst = out[at : at + n]
        if s == 0:
            dst.fill(f)
        elif n >= _RAMP:  # one pass, no ramp of its size
            torch.arange(f, f + s * n, s, dtype=torch.long, out=flat[at : at + n])
        elif s == 1:
            np.add(ramp[:n], f, out=dst)
        else:
            np.multiply(ramp[:n], s, out=dst)
            dst += f
        at += n
    return out


def run_starts(values: _I64, cut: int | None = None) -> _I64:
    """The slots where a run of consecutive values starts (``values[i] != values[i - 1] + 1``),
    and every multiple of ``cut`` slots: one pass in chunks of :data:`_PASS_CHUNK` (no
    temporary of ``values``' size but one bool per value).

    Example:
        >>> run_starts(np.array([0, 1, 2, 3, 8, 9, 4, 5]), cut=3).tolist()
        [0, 3, 4, 6]
    """
    n = values.size
    brk = np.empty(n, dtype=bool)
    if n:
        brk[0] = True
    nxt = np.empty(min(_PASS_CHUNK, max(n - 1, 0)), dtype=np.int64)
    for lo in range(1, n, _PASS_CHUNK):
        hi = min(lo + _PASS_CHUNK, n)
        step = nxt[: hi - lo]
        np.add(values[lo - 1 : hi - 1], 1, out=step)
        np.not_equal(values[lo:hi], step, out=brk[lo:hi])
    if cut is not None:
        brk[::cut] = True
    return np.flatnonzero(brk)


def runs_over(
    values: _I64 | None,
    starts: _I64,
    end: int,
    min_run: int,
    cut: int | None = None,
    runs: tuple[_I64, _I64] | None = None,
) -> tuple[_I64, _I64, _I64] | None:
    """``values`` (any order) as pieces of consecutive values, each inside one run of a tiling
    whose runs start at ``starts``: the runs of consecutive values (:func:`run_starts`) cut at
    the tiling's starts, in ``values``' order.

    Args:
        values: ``[N]`` int64 values in ``[starts[0], end)``; ``None`` with ``runs``.
        starts: ``[K]`` int64, strictly increasing: run ``k`` of the tiling is
            ``[starts[k], starts[k + 1])``, the last one up to ``end``.
        end: Where the tiling ends.
        min_run: Give up (``None``) where ``values`` has more than one run of consecutive
            values per ``min_run`` of them (indexing whole arrays is then cheaper).
        cut: Also cut at every multiple of ``cut`` slots of ``values`` (:func:`run_starts`);
            with ``runs``, theirs must not cross one.
        runs: ``(first, count)`` of ``values``' runs of consecutive values in slot order
            (``values`` is ``arange_runs(first, count, 1)``; they need not be maximal), where
            known: no pass over the values.

    Returns:
        ``(k, first, count)`` per piece: the tiling's run it lies in, its first value and its
        length; ``arange_runs(first, count, 1)`` is ``values`` (the pieces tile its slots in
        order). Or ``None``.

    Raises:
        ValueError: a value outside ``[starts[0], end)`` (checked on the runs: ``O(runs)``).
    """
    if runs is not None:
        a, b = runs[0], runs[0] + runs[1]  # each run covers the values [a, b)
        if min_run * a.size > int(runs[1].sum()):
            return None
    else:
        assert values is not None
        n = values.size
        first_slot = run_starts(values, cut)
        if min_run * first_slot.size > n:
            return None
        a = values[first_slot]
        b = a + np.diff(first_slot, append=n)
    if a.size and (int(a.min()) < int(starts[0]) or int(b.max()) > end):
        least, most = int(a.min()), int(b.max()) - 1
        raise ValueError(
            f"positions must lie in [{int(starts[0])}, {end}), got values from {least} to {most}; "
            "pass positions of the stream these runs describe (e.g. its rank map)"
        )
    k0 = np.searchsorted(starts, a, side="right") - 1
    k1 = np.searchsorted(starts, b - 1, side="right") - 1
    pieces = k1 - k0 + 1  # tiling runs each run overlaps
    offsets = np.cumsum(pieces) - pieces
    k = np.arange(int(pieces.sum()), dtype=np.int64)
    k += np.repeat(k0 - offsets, pieces)
    lo = np.maximum(np.repeat(a, pieces), starts[k])
    hi = np.repeat(b, pieces)
    inner = k + 1 < starts.size
    np.minimum(hi, starts[np.minimum(k + 1, starts.size - 1)], out=hi, where=inner)
    return k, lo, hi - lo
