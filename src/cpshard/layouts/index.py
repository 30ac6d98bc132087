"""Index helpers shared by every layout: padded lengths, rank-map checks, inverse permutations and
runs of consecutive indices. Pure index math (torch and numpy only).

Import rules: the rows of ``RULES`` in tests/unit/test_architecture.py that cover this module.
"""

from __future__ import annotations

import numpy as np
import torch

__all__ = ["check_rank_map", "consecutive_runs", "inverse_permutation", "padded_length"]


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
