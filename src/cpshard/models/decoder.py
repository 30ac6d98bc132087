""":class:`TinyDecoder`: the plain-PyTorch example decoder (no downloads).

:class:`TinyDecoder` is a Llama-style decoder (RMSNorm, RoPE, GQA attention, SwiGLU) whose
attention is a plain ``F.scaled_dot_product_attention(q, k, v, is_causal=True)``: it knows nothing
about CP. Inside a cpshard context the call sees the global sequence; RoPE uses the global
``position_ids`` that the sharder hands back with the batch.

Import rules: the rows of ``RULES`` in tests/unit/test_architecture.py that cover this module.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["TinyDecoder", "TinyDecoderConfig", "masked_attention"]


@dataclass(frozen=True)
class TinyDecoderConfig:
    """Sizes of :class:`TinyDecoder`."""

    vocab_size: int = 260
    hidden_size: int = 64
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    intermediate_size: int = 128
    rope_theta: float = 10000.0

    def __post_init__(self) -> None:
        if self.hidden_size % self.num_heads:
            raise ValueError(
                f"hidden_size={self.hidden_size} must be divisible by num_heads={self.num_heads}"
            )
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads={self.num_heads} must be divisible by num_kv_heads={self.num_kv_heads}"
            )


def _rope(x: torch.Tensor, position_ids: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotary embedding of ``x`` ``[B, H, S, D]`` at ``position_ids`` ``[B|1, S]``."""
    d = x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, d, 2, device=x.device, dtype=torch.float32) / d)
    ang = position_ids.float()[:, None, :, None] * inv  # [B, 1, S, D/2]
    cos, sin = ang.cos(), ang.sin()
    x1, x2 = x.float()[..., 0::2], x.float()[..., 1::2]
    out = torch.stack([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1).flatten(-2)
    return out.to(x.dtype)


def masked_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor
) -> torch.Tensor:
    """Softmax attention with an explicit bool mask (fp32 softmax), GQA by head repetition.

    Written out rather than ``F.scaled_dot_product_attention``, so a model with its own local
    attention pattern is never routed to CP attention by an active cpshard context.

    Args:
        q: ``[B, Hq, S, D]``.
        k: ``[B, Hkv, S, D]``.
        v: ``[B, Hkv, S, D]``.
        mask: Bool ``[B|1, 1, S, S]``, ``True`` = attend; every row needs one ``True``.

    Returns:
        ``[B, Hq, S, D]``.
    """
    rep = q.shape[1] // k.shape[1]
    if rep > 1:
        k = k.repeat_interleave(rep, dim=1)
        v = v.repeat_interleave(rep, dim=1)
    scores = (q.float() @ k.float().transpose(-1, -2)) * q.shape[-1] ** -0.5
    probs = scores.masked_fill(~mask, float("-inf")).softmax(dim=-1)
    out: torch.Tensor = (probs @ v.float()).to(q.dtype)
    return out


class _Block(nn.Module):
    def __init__(self, cfg: TinyDecoderConfig) -> None:
        super().__init__()
        self.cfg = cfg
        hd = cfg.hidden_size // cfg.num_heads
        self.norm1 = nn.RMSNorm(cfg.hidden_size)
        self.q = nn.Linear(cfg.hidden_size, cfg.num_heads * hd, bias=False)
        self.kv = nn.Linear(cfg.hidden_size, 2 * cfg.num_kv_heads * hd, bias=False)
        self.o = nn.Linear(cfg.num_heads * hd, cfg.hidden_size, bias=False)
        self.norm2 = nn.RMSNorm(cfg.hidden_size)
        self.up = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.down = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(
        self,
        x: torch.Tensor,
        position_ids: torch.Tensor,
        attn_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """One block on ``x`` ``[B, S, H]``; causal, or ``attn_mask`` ``[B|1, 1, S, S]`` (bool)."""
        b, s, _ = x.shape
        cfg = self.cfg
        hd = cfg.hidden_size // cfg.num_heads
        h = self.norm1(x)
        q = self.q(h).view(b, s, cfg.num_heads, hd).transpose(1, 2)
        k, v = self.kv(h).view(b, s, 2, cfg.num_kv_heads, hd).permute(2, 0, 3, 1, 4)
        q = _rope(q, position_ids, cfg.rope_theta)
        k = _rope(k, position_ids, cfg.rope_theta)
        if (
            attn_mask is None
        ):  # plain causal SDPA: inside cpshard's ctx() it sees the global sequence
            attn = F.scaled_dot_product_attention(
                q, k, v, is_causal=True, enable_gqa=cfg.num_kv_heads != cfg.num_heads
            )
        else:  # a model-defined mask over the local tokens: explicit math, never routed to CP
            attn = masked_attention(q, k, v, attn_mask)
        x = x + self.o(attn.transpose(1, 2).reshape(b, s, -1))
        gate, up = self.up(self.norm2(x)).chunk(2, dim=-1)
        out: torch.Tensor = x + self.down(F.silu(gate) * up)
        return out


class TinyDecoder(nn.Module):
    """A Llama-style causal LM in plain PyTorch (its attention is ``F.sdpa(is_causal=True)``).

    Args:
        cfg: Sizes.
    """

    def __init__(self, cfg: TinyDecoderConfig | None = None) -> None:
        super().__init__()
        self.cfg = cfg or TinyDecoderConfig()
        self.embed = nn.Embedding(self.cfg.vocab_size, self.cfg.hidden_size)
        self.blocks = nn.ModuleList(_Block(self.cfg) for _ in range(self.cfg.num_layers))
        self.norm = nn.RMSNorm(self.cfg.hidden_size)
        self.head = nn.Linear(self.cfg.hidden_size, self.cfg.vocab_size, bias=False)

    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Logits ``[B, S, V]`` of ``input_ids`` ``[B, S]`` at ``position_ids`` ``[B|1, S]``."""
        if position_ids is None:
            position_ids = torch.arange(input_ids.shape[1], device=input_ids.device)[None]
        return self.decode(self.embed(input_ids), position_ids)

    def decode(
        self,
        x: torch.Tensor,
        position_ids: torch.Tensor,
        attn_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Logits ``[B, S, V]`` of embeddings ``x`` ``[B, S, H]`` (the layers after the embedding).

        Args:
            x: Token embeddings ``[B, S, H]``.
            position_ids: ``[B|1, S]`` positions for RoPE.
            attn_mask: ``None`` (causal) or a bool ``[B|1, 1, S, S]`` mask (``True`` = attend).
        """
        for block in self.blocks:
            x = block(x, position_ids, attn_mask)
        logits: torch.Tensor = self.head(self.norm(x))
        return logits

    @classmethod
    def from_config(cls, cfg: TinyDecoderConfig | None = None, *, seed: int = 0) -> TinyDecoder:
        """Build with weights drawn from ``seed`` (the global RNG is left untouched)."""
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            return cls(cfg)
