""":class:`TinyVLM`: a pre-embedding vision-language decoder (the model-owned VLM family).

Image tokens in ``input_ids`` (``cfg.image_token_id``) are placeholders: a small trainable vision
encoder turns ``pixel_values`` ``[N, P, patch_dim]`` into ``N * P`` feature vectors, which are
scattered into the token embeddings at the placeholders in row-major order. That pre-embedding
must see the whole batch (an image's tokens may land on several CP ranks), so the model does it in
its CP hook, before the batch is sharded::

    ctx, local, sharder = cpshard.prepare_cp_forward(vlm, cp_mesh, batch)   # batch has pixel_values
    with ctx():
        logits = vlm(inputs_embeds=local["inputs_embeds"], position_ids=local["position_ids"])

The hook returns ``{"inputs_embeds": ..., "input_ids": None, "pixel_values": None}`` (the raw
inputs are consumed) and no sharder, so the dispatcher picks the layout (round_robin for dense
rows, balanced for packed documents). ``inputs_embeds`` carry the graph of the vision encoder and
the embedding: they are sharded out of place, so their gradients reach both. The hook runs at every
CP size, so the ``cp=1`` reference runs exactly this path.

Import rules: the rows of ``RULES`` in tests/unit/test_architecture.py that cover this module.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from cpshard.models.decoder import TinyDecoder, TinyDecoderConfig

__all__ = ["TinyVLM", "TinyVLMConfig", "TinyVisionEncoder", "with_images"]


def _default_text() -> TinyDecoderConfig:
    return TinyDecoderConfig(vocab_size=260)


@dataclass(frozen=True)
class TinyVLMConfig:
    """Sizes of :class:`TinyVLM`.

    Attributes:
        text: The decoder (its vocabulary includes the image placeholder token).
        image_token_id: Placeholder id of one image feature in ``input_ids``.
        patch_dim: Features per image patch in ``pixel_values`` ``[N, P, patch_dim]``.
        vision_hidden: Width of the vision encoder.
    """

    text: TinyDecoderConfig = field(default_factory=_default_text)
    image_token_id: int = 259
    patch_dim: int = 16
    vision_hidden: int = 32

    def __post_init__(self) -> None:
        if not 0 <= self.image_token_id < self.text.vocab_size:
            raise ValueError(
                f"image_token_id={self.image_token_id} must be a token of the text vocabulary "
                f"[0, {self.text.vocab_size}); raise text.vocab_size or pick another id"
            )
        if self.patch_dim < 1 or self.vision_hidden < 1:
            raise ValueError(
                f"patch_dim and vision_hidden must be >= 1, got patch_dim={self.patch_dim}, "
                f"vision_hidden={self.vision_hidden}"
            )


class TinyVisionEncoder(nn.Module):
    """Patch embedding, one residual MLP with image-level mixing, projection to the text width."""

    def __init__(self, patch_dim: int, hidden: int, out_dim: int) -> None:
        super().__init__()
        self.patch = nn.Linear(patch_dim, hidden)
        self.norm = nn.LayerNorm(hidden)
        self.mlp1 = nn.Linear(hidden, 2 * hidden)
        self.mlp2 = nn.Linear(2 * hidden, hidden)
        self.proj = nn.Linear(hidden, out_dim)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """Features ``[N, P, out_dim]`` of ``pixel_values`` ``[N, P, patch_dim]``."""
        h = self.patch(pixel_values)
        h = h + h.mean(dim=1, keepdim=True)  # every patch sees its image
        h = h + self.mlp2(F.gelu(self.mlp1(self.norm(h))))
        out: torch.Tensor = self.proj(h)
        return out


class TinyVLM(nn.Module):
    """A decoder whose image placeholder tokens take the features of a trainable vision encoder.

    Args:
        cfg: Sizes (default :class:`TinyVLMConfig`).
    """

    def __init__(self, cfg: TinyVLMConfig | None = None) -> None:
        super().__init__()
        self.cfg = cfg or TinyVLMConfig()
        self.vision = TinyVisionEncoder(
            self.cfg.patch_dim, self.cfg.vision_hidden, self.cfg.text.hidden_size
        )
        self.lm = TinyDecoder(self.cfg.text)

    @classmethod
    def from_config(cls, cfg: TinyVLMConfig | None = None, *, seed: int = 0) -> TinyVLM:
        """Build with weights drawn from ``seed`` (the global RNG is left untouched)."""
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            return cls(cfg)

    def embed_inputs(
        self, input_ids: torch.Tensor, pixel_values: torch.Tensor | None
    ) -> torch.Tensor:
        """Token embeddings ``[B, S, H]`` with the image features scattered into the placeholders.

        Args:
            input_ids: ``[B, S]``; ``cfg.image_token_id`` marks one image feature each.
            pixel_values: ``[N, P, patch_dim]`` or ``None``; ``N * P`` must equal the number of
                placeholders (filled in row-major order).

        Raises:
            ValueError: placeholder count and ``pixel_values`` disagree, or a bad shape.
        """
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids must be [B, S], got shape {tuple(input_ids.shape)}")
        x: torch.Tensor = self.lm.embed(input_ids)
        slots = input_ids == self.cfg.image_token_id
        n_slots = int(slots.sum())
        if pixel_values is None:
            if n_slots:
                raise ValueError(
                    f"input_ids hold {n_slots} image tokens (id {self.cfg.image_token_id}) but "
                    "no pixel_values were given; pass pixel_values [N, P, patch_dim]"
                )
            return x
        if pixel_values.dim() != 3 or pixel_values.shape[-1] != self.cfg.patch_dim:
            raise ValueError(
                f"pixel_values must be [N, P, patch_dim={self.cfg.patch_dim}], got shape "
                f"{tuple(pixel_values.shape)}"
            )
        n_feats = pixel_values.shape[0] * pixel_values.shape[1]
        if n_feats != n_slots:
            raise ValueError(
                f"pixel_values {tuple(pixel_values.shape)} give {n_feats} image features but "
                f"input_ids hold {n_slots} image tokens (id {self.cfg.image_token_id}); put one "
                "placeholder per patch in input_ids"
            )
        feats = self.vision(pixel_values.to(x.dtype)).reshape(-1, x.shape[-1])
        out: torch.Tensor = x.masked_scatter(slots.unsqueeze(-1), feats)
        return out

    def prepare_model_inputs_for_cp(
        self, batch: dict[str, Any], *, num_chunks: int = 1
    ) -> dict[str, Any]:
        """The CP hook: fold ``pixel_values`` into trainable ``inputs_embeds``.

        Args:
            batch: The caller's global batch (read only): ``input_ids`` ``[B, S]`` and optional
                ``pixel_values``.
            num_chunks: Part of the hook protocol; this model leaves the layout to the
                dispatcher, so it does not use it.

        Returns:
            ``{"inputs_embeds": [B, S, H], "input_ids": None, "pixel_values": None}``: no
            ``cp_sharder`` (the dispatcher resolves the layout).
        """
        del num_chunks
        ids = batch.get("input_ids")
        if not isinstance(ids, torch.Tensor):
            raise ValueError(
                "TinyVLM's CP hook needs the batch's input_ids [B, S] (with image placeholder "
                f"tokens), got keys {sorted(batch)}; pass input_ids, not inputs_embeds"
            )
        embeds = self.embed_inputs(ids, batch.get("pixel_values"))
        return {"inputs_embeds": embeds, "input_ids": None, "pixel_values": None}

    def forward(
        self,
        input_ids: torch.Tensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        pixel_values: torch.Tensor | None = None,
        *,
        _pre_embed_only: bool = False,
        _cp_batch: dict[str, Any] | None = None,
        num_chunks: int = 1,
    ) -> Any:
        """Logits ``[B, S, V]``; or, with ``_pre_embed_only=True``, the CP hook's result.

        Args:
            input_ids: ``[B, S]`` with image placeholders (then ``pixel_values`` are embedded
                here), or ``None`` when ``inputs_embeds`` are given.
            inputs_embeds: ``[B, S, H]`` from the hook (sharded under CP).
            position_ids: ``[B|1, S]`` (default ``0..S-1``).
            pixel_values: ``[N, P, patch_dim]`` with ``input_ids`` only.
            _pre_embed_only: Run the CP hook on ``_cp_batch`` instead (called through
                ``__call__`` so FSDP2's pre-forward hooks unshard the vision encoder).
            _cp_batch: The batch for the hook.
            num_chunks: Passed to the hook.
        """
        if _pre_embed_only:
            if _cp_batch is None:
                raise ValueError("_pre_embed_only=True needs the batch as _cp_batch")
            return self.prepare_model_inputs_for_cp(_cp_batch, num_chunks=num_chunks)
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("pass exactly one of input_ids or inputs_embeds")
        if inputs_embeds is None:
            assert input_ids is not None
            inputs_embeds = self.embed_inputs(input_ids, pixel_values)
        elif pixel_values is not None:
            raise ValueError(
                "pixel_values were given with inputs_embeds; the CP hook already folded them in "
                "(pass inputs_embeds alone)"
            )
        if position_ids is None:
            position_ids = torch.arange(inputs_embeds.shape[1], device=inputs_embeds.device)[None]
        return self.lm.decode(inputs_embeds, position_ids)


def with_images(
    input_ids: torch.Tensor,
    cfg: TinyVLMConfig | None = None,
    *,
    patches: int = 4,
    start: int = 1,
    seed: int = 0,
) -> dict[str, torch.Tensor]:
    """A VLM batch from text rows: one image of ``patches`` placeholders per row.

    Row ``b``'s tokens ``[start, start + patches)`` become ``cfg.image_token_id``; ``pixel_values``
    are drawn from ``seed``; ``labels`` are the next tokens, with ``-100`` wherever the target is
    an image placeholder (images are inputs, not predictions).

    Args:
        input_ids: ``[B, S]`` text tokens (not modified), ``S >= start + patches + 1``.
        cfg: The model's config (for the placeholder id and ``patch_dim``).
        patches: Placeholders (patches) per image.
        start: Position of the first placeholder in every row.
        seed: Seed of ``pixel_values``.

    Returns:
        ``{"input_ids": [B, S], "pixel_values": [B, patches, patch_dim], "labels": [B, S]}``.
    """
    cfg = cfg or TinyVLMConfig()
    if input_ids.dim() != 2 or input_ids.shape[1] < start + patches + 1 or start < 0:
        raise ValueError(
            f"with_images needs [B, S] rows with S >= start + patches + 1 = "
            f"{start + patches + 1}, got shape {tuple(input_ids.shape)} (start={start})"
        )
    ids = input_ids.clone()
    ids[:, start : start + patches] = cfg.image_token_id
    labels = torch.full_like(ids, -100)
    labels[:, :-1] = ids[:, 1:]
    labels = labels.masked_fill(labels == cfg.image_token_id, -100)
    gen = torch.Generator().manual_seed(seed)
    pixels = torch.randn(ids.shape[0], patches, cfg.patch_dim, generator=gen)
    return {"input_ids": ids, "pixel_values": pixels.to(input_ids.device), "labels": labels}
