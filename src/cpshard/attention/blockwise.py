"""Tiled attention of a query set against a key set, skipping what the mask rules out.

Both sides are described by a :class:`Span`: the global position and document id of every token
plus a split into *tiles*, maximal runs of consecutive positions (capped in number). For every
(query tile, key tile) pair the tile statistics decide, without building a mask, whether the pair
is

* ``EMPTY``: no query sees any key (disjoint documents, or all keys after all queries) -> skipped;
* ``FULL``: one shared document and every key at or before every query -> kernel without a mask;
* ``DIAG``: the same run of positions in one document -> kernel with ``is_causal=True``;
* ``MASKED``: anything else -> kernel with the explicit mask ``same doc & k_pos <= q_pos``.

For the round-robin layout this makes every CP rank run only the causal triangles and full
squares it needs, with the same kernels a single process would use.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum

import torch

from cpshard.attention.kernels import KernelBackend, block_attention, block_attention_backward
from cpshard.attention.merge import accumulation_dtype, merge_into

__all__ = [
    "MAX_TILES",
    "PairKind",
    "Span",
    "attend",
    "attend_backward",
    "attend_backward_into",
    "make_span",
    "plan",
]

MAX_TILES = 8
"""Above this many runs a span is tiled per segment instead (mask-only, no fast paths)."""


class PairKind(IntEnum):
    """How a (query tile, key tile) pair is computed."""

    EMPTY = 0
    FULL = 1
    DIAG = 2
    MASKED = 3


@dataclass(frozen=True)
class Span:
    """Positions, document ids and tiles of a set of tokens.

    Attributes:
        positions: LongTensor ``[B or 1, N]``.
        document_ids: LongTensor ``[B or 1, N]``.
        tiles: ``(start, end)`` ranges covering ``[0, N)`` in order.
        runs: Whether every tile is a run of consecutive positions (enables ``DIAG``).
        stats: LongTensor ``[T, 4, B or 1]``: per tile min/max position, min/max document.
    """

    positions: torch.Tensor
    document_ids: torch.Tensor
    tiles: tuple[tuple[int, int], ...]
    runs: bool
    stats: torch.Tensor


def make_span(positions: torch.Tensor, document_ids: torch.Tensor, segment_len: int) -> Span:
    """Tile a token set into runs of consecutive positions that do not cross segments.

    Args:
        positions: LongTensor ``[B or 1, N]``; ``N`` a multiple of ``segment_len``.
        document_ids: LongTensor ``[B or 1, N]``.
        segment_len: Tiles never cross a multiple of this (the per-rank length ``L``).

    Returns:
        The :class:`Span`. With more than :data:`MAX_TILES` runs, one tile per segment.
    """
    n = positions.shape[-1]
    breaks = torch.zeros(n, dtype=torch.bool, device=positions.device)
    if n > 1:
        jump = (positions[:, 1:] != positions[:, :-1] + 1).any(dim=0)
        breaks[1:] = jump
    breaks[::segment_len] = True
    starts = breaks.nonzero().flatten().tolist()
    runs = len(starts) <= MAX_TILES
    if not runs:
        starts = list(range(0, n, segment_len))
    ends = [*starts[1:], n]
    tiles = tuple(zip(starts, ends, strict=True))
    stats = torch.stack(
        [
            torch.stack(
                [
                    positions[:, s:e].amin(-1),
                    positions[:, s:e].amax(-1),
                    document_ids[:, s:e].amin(-1),
                    document_ids[:, s:e].amax(-1),
                ]
            )
            for s, e in tiles
        ]
    )
    return Span(positions, document_ids, tiles, runs, stats)


def plan(qs: Span, ks: Span, causal: bool) -> list[tuple[int, int, PairKind]]:
    """Classify every (query tile, key tile) pair; return the non-empty ones.

    Args:
        qs: Query span.
        ks: Key span.
        causal: Causal masking.

    Returns:
        ``[(query_tile, key_tile, kind)]`` for every pair that is not ``EMPTY``.
    """
    q = qs.stats[:, None]  # [Tq, 1, 4, B]
    k = ks.stats[None, :]  # [1, Tk, 4, B]
    qpmin, qpmax, qdmin, qdmax = q.unbind(2)
    kpmin, kpmax, kdmin, kdmax = k.unbind(2)
    empty = (kdmax < qdmin) | (kdmin > qdmax)
    one_doc = (qdmin == qdmax) & (kdmin == kdmax) & (qdmin == kdmin)
    if causal:
        empty = empty | (kpmin > qpmax)
        full = one_doc & (kpmax <= qpmin)
        diag = one_doc & (qpmin == kpmin) & (qpmax == kpmax)
    else:
        full = one_doc
        diag = torch.zeros_like(full)
    empty_all = empty.all(-1).tolist()
    full_all = full.all(-1).tolist()
    diag_all = diag.all(-1).tolist()
    pairs = []
    for i, (qa, qb) in enumerate(qs.tiles):
        for j, (ka, kb) in enumerate(ks.tiles):
            if empty_all[i][j]:
                continue
            if full_all[i][j]:
                kind = PairKind.FULL
            elif diag_all[i][j] and qs.runs and ks.runs and qb - qa == kb - ka:
                kind = PairKind.DIAG
            else:
                kind = PairKind.MASKED
            pairs.append((i, j, kind))
    return pairs


def _mask(
    qs: Span, ks: Span, qt: tuple[int, int], kt: tuple[int, int], causal: bool
) -> torch.Tensor:
    qp, qd = qs.positions[:, qt[0] : qt[1]], qs.document_ids[:, qt[0] : qt[1]]
    kp, kd = ks.positions[:, kt[0] : kt[1]], ks.document_ids[:, kt[0] : kt[1]]
    vis = qd.unsqueeze(-1) == kd.unsqueeze(-2)
    if causal:
        vis = vis & (kp.unsqueeze(-2) <= qp.unsqueeze(-1))
    return vis


def attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    qs: Span,
    ks: Span,
    *,
    causal: bool,
    scale: float,
    backend: KernelBackend = "auto",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Masked attention of ``q`` against ``k``/``v`` by tiles, merged in fp32.

    Args:
        q: ``[B, Hq, Nq, D]`` queries described by ``qs``.
        k: ``[B, Hkv, Nk, D]`` keys described by ``ks``.
        v: ``[B, Hkv, Nk, D]`` values.
        qs: Query span.
        ks: Key span.
        causal: Causal masking by global position.
        scale: Score scale.
        backend: Kernel backend.

    Returns:
        ``(out [B, Hq, Nq, D], lse [B, Hq, Nq])`` in the accumulation dtype; queries that see
        no key have ``out = 0`` and ``lse = -inf``.
    """
    acc = accumulation_dtype(q.dtype)
    b, h, n, d = q.shape
    out = torch.zeros((b, h, n, d), dtype=acc, device=q.device)
    lse = torch.full((b, h, n), float("-inf"), dtype=acc, device=q.device)
    written: set[int] = set()
    for i, j, kind in plan(qs, ks, causal):
        qa, qb = qs.tiles[i]
        ka, kb = ks.tiles[j]
        mask = _mask(qs, ks, qs.tiles[i], ks.tiles[j], causal) if kind == PairKind.MASKED else None
        if mask is not None and not bool(mask.any()):
            continue
        o, l_ = block_attention(
            q[:, :, qa:qb],
            k[:, :, ka:kb],
            v[:, :, ka:kb],
            mask=mask,
            is_causal=kind == PairKind.DIAG,
            scale=scale,
            backend=backend,
        )
        if i in written:
            merge_into(out[:, :, qa:qb], lse[:, :, qa:qb], o, l_)
        else:
            out[:, :, qa:qb] = o
            lse[:, :, qa:qb] = l_
            written.add(i)
    return out, lse


def attend_backward_into(
    grad_out: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    qs: Span,
    ks: Span,
    dq: torch.Tensor,
    dk: torch.Tensor,
    dv: torch.Tensor,
    *,
    causal: bool,
    scale: float,
    backend: KernelBackend = "auto",
) -> bool:
    """Add the gradients of :func:`attend` for one key set into caller-owned accumulators.

    Only tile-sized temporaries are allocated: each (query tile, key tile) result is added into
    the accumulators at once, so no full-size per-block ``dq``/``dk``/``dv`` exists.

    Args:
        grad_out: ``[B, Hq, Nq, D]`` upstream gradient.
        q: ``[B, Hq, Nq, D]`` queries.
        k: ``[B, Hkv, Nk, D]`` keys.
        v: ``[B, Hkv, Nk, D]`` values.
        out: ``[B, Hq, Nq, D]`` global output (merged over every key set).
        lse: ``[B, Hq, Nq]`` global LSE.
        qs: Query span.
        ks: Key span.
        dq: ``[B, Hq, Nq, D]`` accumulator (accumulation dtype, any strides), added to in place.
        dk: ``[B, Hkv, Nk, D]`` accumulator, added to in place.
        dv: ``[B, Hkv, Nk, D]`` accumulator, added to in place.
        causal: Causal masking.
        scale: Score scale.
        backend: Kernel backend.

    Returns:
        Whether anything was added (``False`` when no query sees any key).
    """
    added = False
    out_q = out.to(q.dtype)
    for i, j, kind in plan(qs, ks, causal):
        qa, qb = qs.tiles[i]
        ka, kb = ks.tiles[j]
        mask = _mask(qs, ks, qs.tiles[i], ks.tiles[j], causal) if kind == PairKind.MASKED else None
        if mask is not None and not bool(mask.any()):
            continue
        gq, gk, gv = block_attention_backward(
            grad_out[:, :, qa:qb],
            q[:, :, qa:qb],
            k[:, :, ka:kb],
            v[:, :, ka:kb],
            out_q[:, :, qa:qb],
            lse[:, :, qa:qb],
            mask=mask,
            is_causal=kind == PairKind.DIAG,
            scale=scale,
            backend=backend,
        )
        dq[:, :, qa:qb] += gq
        dk[:, :, ka:kb] += gk
        dv[:, :, ka:kb] += gv
        added = True
    return added


def attend_backward(
    grad_out: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    qs: Span,
    ks: Span,
    *,
    causal: bool,
    scale: float,
    backend: KernelBackend = "auto",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """Gradients of :func:`attend` for one key set, given the global ``out``/``lse``.

    Args:
        grad_out: ``[B, Hq, Nq, D]`` upstream gradient.
        q: ``[B, Hq, Nq, D]`` queries.
        k: ``[B, Hkv, Nk, D]`` keys.
        v: ``[B, Hkv, Nk, D]`` values.
        out: ``[B, Hq, Nq, D]`` global output (merged over every key set).
        lse: ``[B, Hq, Nq]`` global LSE.
        qs: Query span.
        ks: Key span.
        causal: Causal masking.
        scale: Score scale.
        backend: Kernel backend.

    Returns:
        ``(dq, dk, dv)`` in the accumulation dtype, shaped like ``q``, ``k``, ``v``; ``None``
        when no query sees any key (all gradients zero).
    """
    acc = accumulation_dtype(q.dtype)
    if not plan(qs, ks, causal):
        return None
    dq = torch.zeros(q.shape, dtype=acc, device=q.device)
    dk = torch.zeros(k.shape, dtype=acc, device=k.device)
    dv = torch.zeros(v.shape, dtype=acc, device=v.device)
    added = attend_backward_into(
        grad_out, q, k, v, out, lse, qs, ks, dq, dk, dv, causal=causal, scale=scale,
        backend=backend,
    )  # fmt: skip
    return (dq, dk, dv) if added else None
