"""The gather/scatter index of one padded length: which slices a token verb copies, from where.

Built once per (padded length, device) from a rank map and cached with the shard's facts, so
``shard_token_tensor`` is a copy of a few slices (or one ``index_select``) and
``gather_token_tensor`` reorders the all-gathered ranks with a precomputed inverse permutation.

Import rules: the rows of ``RULES`` in tests/unit/test_architecture.py that cover this module.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from cpshard.layouts.index import consecutive_runs, inverse_permutation

__all__ = ["TokenIndex"]

Runs = list[tuple[int, int]]

# Above this many contiguous runs a shard/gather indexes element-wise instead of copying slices.
_MAX_RUNS = 256


def _take(t: torch.Tensor, dim: int, idx: torch.Tensor, runs: Runs | None) -> torch.Tensor:
    """``t.index_select(dim, idx)`` as a copy of a few slices when ``idx`` is a few runs."""
    if runs is None:
        return t.index_select(dim, idx)
    if len(runs) == 1:  # a copy even when the run is the whole tensor: never a view of `t`
        return t.narrow(dim, runs[0][0], runs[0][1]).clone(memory_format=torch.contiguous_format)
    return torch.cat([t.narrow(dim, v, n) for v, n in runs], dim=dim)


@dataclass(frozen=True)
class TokenIndex:
    """What shard and gather copy for one padded length ``P`` over ``C`` ranks (``L = P / C``).

    Attributes:
        local: LongTensor ``[L]``: global position of each local token.
        local_runs: Runs ``(start, length)`` of ``local``, ``None`` if too fragmented.
        inverse: LongTensor ``[P]``: slot of the rank-major gathered stream holding each global
            position.
        gather_runs: Runs of ``inverse`` split at rank boundaries, ``None`` if too fragmented.
    """

    local: torch.Tensor
    local_runs: Runs | None
    inverse: torch.Tensor
    gather_runs: Runs | None

    @classmethod
    def build(cls, local: torch.Tensor, stream_order: torch.Tensor) -> TokenIndex:
        """From this rank's map ``local`` ``[L]`` and every rank's, rank-major ``[P]``."""
        inverse = inverse_permutation(stream_order)
        local_runs = consecutive_runs(local)
        gather_runs = consecutive_runs(inverse, split_every=max(local.numel(), 1))
        return cls(
            local,
            local_runs if len(local_runs) <= _MAX_RUNS else None,
            inverse,
            gather_runs if len(gather_runs) <= _MAX_RUNS else None,
        )

    def take_local(self, stream: torch.Tensor, dim: int) -> torch.Tensor:
        """This rank's tokens of ``stream`` (``P`` tokens on ``dim``), in local order; a copy."""
        return _take(stream, dim, self.local, self.local_runs)

    def reorder_gathered(self, stacked: torch.Tensor, seq_dim: int) -> torch.Tensor:
        """``[C, *local_shape]`` all-gathered shards -> ``[..., P, ...]`` in global order.

        Args:
            stacked: Every rank's local shard stacked on a new dim 0 (rank-major).
            seq_dim: Sequence dim of one local shard.
        """
        n = stacked.shape[seq_dim + 1]
        if self.gather_runs is not None:
            parts = [stacked[s // n].narrow(seq_dim, s % n, k) for s, k in self.gather_runs]
            return parts[0] if len(parts) == 1 else torch.cat(parts, dim=seq_dim)
        full = stacked.movedim(0, seq_dim).flatten(seq_dim, seq_dim + 1)
        return full.index_select(seq_dim, self.inverse)
