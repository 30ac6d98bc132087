""":class:`GlobalPrefixDecoder`: a decoder that owns its CP (its sharder repositions tokens).

Attention is *block-local with a global prefix*: token ``t`` attends causally to the first
``G = cfg.num_global_tokens`` tokens of its row and to the tokens of its own block of
``cfg.block_size`` (blocks tile positions ``G, G+1, ...``). Such a model needs no attention
communication under CP if every rank holds a copy of the prefix and whole blocks, which is what the
sharder returned by its hook does. Rank ``r`` of ``C`` holds, for every row ``b``::

    [prefix of row b (G tokens)] [body chunk r of row b (Lb tokens, whole blocks)]

with the body padded to ``C * Lb`` (``Lb`` a multiple of ``block_size * num_chunks``). The local
batch is one ``[1, B * (G + Lb)]`` stream; the padded global stream is the rank-major concatenation
of the local ones (``rank_map = arange(P).view(C, L)``), and
``sharder.input_token_stream_positions`` ``[B, S]`` gives the stream slot of each caller token
(prefix tokens: rank 0's copy). The prefix copies on ranks ``r > 0`` are duplicates: their
``labels`` are ``-100``, ``loss_mask`` ``0`` and ``padding_mask`` ``True``, so every loss and
token count sees each real token once; the token verbs fill them with ``fill``. CP pads get the
pad table's values. The model builds its mask from ``position_ids`` alone (rows restart at 0), so
the same forward serves the plain ``[B, S]`` call, the ``cp=1`` stream and every ``cp=N`` shard.
Its attention is explicit masked math (never routed to CP attention); its ``shard_batch`` brings
no context of its own, so the dispatcher's ``ctx()`` is the cpshard attention context over the
token meta, as for every built-in layout: "this shard runs under CP" holds for it too.

Written with the public toolkit of a custom sharder only (:mod:`cpshard.sharding.toolkit`:
``normalize_batch``, ``pad_tokens`` / ``pad_value``, a ``Placement``, ``facts_from_placement``).

Import rules: the rows of ``RULES`` in tests/unit/test_architecture.py that cover this module.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from cpshard.models.decoder import TinyDecoder, TinyDecoderConfig
from cpshard.sharding import (
    CallerCoordinates,
    CPContext,
    CPSharder,
    Placement,
    cp_rank_and_size,
    facts_from_placement,
    normalize_batch,
    pad_document_ids,
    pad_tokens,
    pad_value,
)

__all__ = [
    "GlobalPrefixConfig",
    "GlobalPrefixDecoder",
    "global_prefix_mask",
    "global_prefix_sharder",
]

# Keys whose prefix copies on ranks > 0 are pads (each real token counts once).
_COUNTED = ("labels", "loss_mask", "padding_mask")


@dataclass(frozen=True)
class GlobalPrefixConfig:
    """Sizes of :class:`GlobalPrefixDecoder`.

    Attributes:
        text: The decoder.
        num_global_tokens: ``G``: every token attends to the first ``G`` tokens of its row.
        block_size: Width of the local attention blocks after the prefix.
    """

    text: TinyDecoderConfig = field(default_factory=TinyDecoderConfig)
    num_global_tokens: int = 4
    block_size: int = 8

    def __post_init__(self) -> None:
        if self.num_global_tokens < 1 or self.block_size < 1:
            raise ValueError(
                f"num_global_tokens and block_size must be >= 1, got num_global_tokens="
                f"{self.num_global_tokens}, block_size={self.block_size}"
            )


def global_prefix_mask(position_ids: torch.Tensor, num_global: int, block: int) -> torch.Tensor:
    """Bool attention mask ``[B, 1, S, S]`` (``True`` = attend) from positions alone.

    A row (segment) starts wherever ``position_ids == 0``; query ``q`` attends key ``k`` of the
    same segment iff ``pos[k] <= pos[q]`` and (``pos[k] < G`` or both are in the same block).

    Args:
        position_ids: ``[B, S]`` positions; segments restart at 0.
        num_global: ``G``.
        block: Block width.
    """
    pos = position_ids
    seg = torch.cumsum((pos == 0).long(), dim=-1)
    blk = torch.where(pos >= num_global, (pos - num_global) // block, -1)
    same = seg[..., :, None] == seg[..., None, :]
    causal = pos[..., None, :] <= pos[..., :, None]
    visible = (pos[..., None, :] < num_global) | (blk[..., None, :] == blk[..., :, None])
    return (same & causal & visible).unsqueeze(1)


def _shard_global_prefix(
    cp_mesh: DeviceMesh | None,
    tp_mesh: DeviceMesh | None,
    batch: dict[str, Any],
    *,
    loss_mask: torch.Tensor | None = None,
    padding_token_id: int = 0,
    num_global: int,
    block: int,
) -> tuple[CPContext, dict[str, Any]]:
    """``shard_batch`` of :func:`global_prefix_sharder` (see the module docstring)."""
    del tp_mesh
    packed = [k for k in ("seq_lens", "cu_seqlens") if batch.get(k) is not None]
    if packed:
        raise ValueError(
            f"GlobalPrefixDecoder shards rows that each start with their global prefix; the batch "
            f"describes packed documents ({packed}); pass one document per row"
        )
    if batch.get("input_ids") is None:
        raise ValueError(
            f"GlobalPrefixDecoder's sharder needs input_ids [B, S], got keys {sorted(batch)}"
        )
    given_pos = batch.get("position_ids")
    out, dims, _ = normalize_batch(batch, loss_mask=loss_mask)
    ids = out["input_ids"]
    bsz, seq_len = ids.shape
    arange = torch.arange(seq_len, device=ids.device).expand(bsz, seq_len)
    if given_pos is not None and not torch.equal(torch.as_tensor(given_pos).expand_as(ids), arange):
        raise ValueError(
            "GlobalPrefixDecoder's prefix and blocks are defined by the token index in the row, "
            "so position_ids must be 0..S-1 in every row; drop position_ids from the batch"
        )
    if seq_len <= num_global:
        raise ValueError(
            f"rows of seq_len={seq_len} hold no tokens after the num_global_tokens={num_global} "
            "global prefix; use longer rows"
        )
    padding = out.get("padding_mask")
    padding = torch.zeros_like(ids, dtype=torch.bool) if padding is None else padding.bool()
    if bool((padding[:, :-1] & ~padding[:, 1:]).any()):
        raise ValueError(
            "GlobalPrefixDecoder takes right-padded rows only (its prefix and blocks are defined "
            "by the token index in the row), but the padding mask has a pad before a real token; "
            "pad rows at the end"
        )
    rank, world = cp_rank_and_size(cp_mesh)
    body = seq_len - num_global
    chunk = -(-body // (world * block)) * block  # Lb: whole blocks per rank
    n_pad = world * chunk - body
    seg = num_global + chunk
    local_len = bsz * seg
    padded = world * local_len
    out["padding_mask"] = padding
    dims["padding_mask"] = 1
    start = num_global + rank * chunk
    for key in dims:
        t = out[key]
        t = t.expand(bsz, *t.shape[1:]) if t.shape[0] != bsz else t
        fill = pad_value(key, padding_token_id)
        t = pad_tokens(t, 1, n_pad, fill)
        prefix = t[:, :num_global]
        if rank > 0 and key in _COUNTED and fill is not None:
            prefix = torch.full_like(prefix, fill)  # duplicates count nowhere
        local = torch.cat([prefix, t[:, start : start + chunk]], dim=1)
        out[key] = local.reshape(1, local_len, *local.shape[2:]).contiguous()
    col = torch.arange(seq_len, device=ids.device)
    k = (col - num_global).clamp(min=0)
    slot = torch.where(col < num_global, col, (k // chunk) * local_len + num_global + k % chunk)
    rows = torch.arange(bsz, device=ids.device)[:, None] * seg
    stream = torch.arange(padded, device=ids.device)
    placement = Placement(
        rank_map=stream.view(world, local_len),  # the stream is the local rows, rank-major
        document_ids=_stream_document_ids(pad_tokens(padding, 1, n_pad, True), num_global, chunk),
        coordinates=CallerCoordinates(
            original_seq_len=None, padded_seq_len=padded, input_token_stream_positions=rows + slot
        ),
    )
    # The model's attention needs no communication (explicit masked math, never routed to CP
    # attention), but its forward still runs inside the dispatcher's cpshard context, the region
    # that says "this shard, under CP": a plain SDPA elsewhere in the model sees the global stream.
    return CPContext(None, facts_from_placement(placement, cp_mesh)), out


def _stream_document_ids(padding: torch.Tensor, num_global: int, chunk: int) -> torch.Tensor:
    """Document ids of the whole stream (every rank's slots, no collective).

    Args:
        padding: Bool ``[B, G + C * Lb]``: the caller's rows with the body padded, ``True`` = pad.
        num_global: ``G``.
        chunk: ``Lb``, body tokens per rank.

    Returns:
        LongTensor ``[1, P]``: document id = row, except pads and prefix copies (ranks ``> 0``),
        which get their own negative ids.
    """
    bsz = padding.shape[0]
    world = (padding.shape[1] - num_global) // chunk
    rows = torch.arange(bsz, device=padding.device)[:, None]
    pads, docs = [], []
    for r in range(world):
        prefix = padding[:, :num_global] | (r > 0)
        body = padding[:, num_global + r * chunk : num_global + (r + 1) * chunk]
        pads.append(torch.cat([prefix, body], dim=1).reshape(-1))
        docs.append(rows.expand(bsz, num_global + chunk).reshape(-1))
    return pad_document_ids(torch.cat(docs)[None], torch.cat(pads)[None])


def global_prefix_sharder(num_global: int, block: int, *, num_chunks: int = 1) -> CPSharder:
    """The model-owned sharder of :class:`GlobalPrefixDecoder` (no shard yet; the dispatcher shards
    on the CP mesh and adds CP attention).

    Args:
        num_global: ``G``, global prefix tokens every rank keeps.
        block: Attention block width; each rank gets whole blocks.
        num_chunks: Each rank's body is a multiple of ``block * num_chunks`` tokens.
    """
    if num_chunks < 1:
        raise ValueError(f"num_chunks must be >= 1, got num_chunks={num_chunks}")
    shard = functools.partial(_shard_global_prefix, num_global=num_global, block=block * num_chunks)
    return CPSharder(shard_batch=shard, local_token_global_indices=None, layout="global_prefix")


class GlobalPrefixDecoder(nn.Module):
    """A decoder with block-local attention plus a global prefix, owning its CP.

    Args:
        cfg: Sizes (default :class:`GlobalPrefixConfig`).
    """

    def __init__(self, cfg: GlobalPrefixConfig | None = None) -> None:
        super().__init__()
        self.cfg = cfg or GlobalPrefixConfig()
        self.lm = TinyDecoder(self.cfg.text)

    @classmethod
    def from_config(
        cls, cfg: GlobalPrefixConfig | None = None, *, seed: int = 0
    ) -> GlobalPrefixDecoder:
        """Build with weights drawn from ``seed`` (the global RNG is left untouched)."""
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            return cls(cfg)

    def prepare_model_inputs_for_cp(
        self, batch: dict[str, Any], *, num_chunks: int = 1
    ) -> dict[str, Any]:
        """The CP hook: this model owns its layout (``{"cp_sharder": ...}``, no batch updates).

        Args:
            batch: The caller's batch (not read: the layout depends on the config only).
            num_chunks: Each rank's body is a multiple of ``block_size * num_chunks`` tokens.
        """
        del batch
        return {
            "cp_sharder": global_prefix_sharder(
                self.cfg.num_global_tokens, self.cfg.block_size, num_chunks=num_chunks
            )
        }

    def forward(
        self, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Logits ``[B, S, V]`` of ``input_ids`` ``[B, S]``.

        Args:
            input_ids: ``[B, S]`` rows, or the sharder's local ``[1, L]`` stream.
            position_ids: ``[B, S]``; rows (segments) restart at 0. Default ``0..S-1``.
        """
        if position_ids is None:
            position_ids = torch.arange(input_ids.shape[1], device=input_ids.device)[None]
        position_ids = position_ids.expand(input_ids.shape[0], -1)
        mask = global_prefix_mask(position_ids, self.cfg.num_global_tokens, self.cfg.block_size)
        return self.lm.decode(self.lm.embed(input_ids), position_ids, mask)
