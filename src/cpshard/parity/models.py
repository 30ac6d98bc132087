"""The models a parity run can use: one table, :data:`MODELS`, one :class:`ModelSpec` per model.

A spec says how to build the model (fixed init, no downloads), which batches it trains on, which
cpshard layouts apply (``None``: the model owns its CP layout through its hook), whether the CP
attention method applies (``"own"``: the model's attention is its own masked math), how to call
it on the local batch inside ``ctx()``, and how to compute the loss with the model's own
attention without cpshard (the independent check of the cp=1 reference).

* ``llama``, ``qwen2``: HF transformers decoders built from a config (2 layers, 8/4 heads).
* ``tiny``: :class:`cpshard.models.TinyDecoder`, plain PyTorch calling ``F.sdpa``.
* ``vlm``: :class:`cpshard.models.TinyVLM`, pre-embedding: its hook runs the vision encoder on
  ``pixel_values`` and hands trainable ``inputs_embeds`` to the dispatcher, which picks the layout.
* ``prefix``: :class:`cpshard.models.GlobalPrefixDecoder`, model-owned: its hook returns its own
  sharder, which repositions tokens (a copy of the global prefix on every rank, whole blocks).

Import rules: the rows of ``RULES`` in tests/unit/test_architecture.py that cover this module.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import nn

from cpshard.layouts.documents import PackSpec
from cpshard.loss import count_tokens, cp_cross_entropy
from cpshard.models import (
    GlobalPrefixConfig,
    GlobalPrefixDecoder,
    TinyDecoder,
    TinyDecoderConfig,
    TinyVLM,
    TinyVLMConfig,
)
from cpshard.names import DENSE_LAYOUTS, PACKED_LAYOUTS
from cpshard.sharding.labels import shift_labels_packed
from cpshard.tools.corpus import PAD_ID, VOCAB_SIZE, dense_batch, packed_batch

__all__ = ["HEADS", "KV_HEADS", "MODELS", "BatchSpec", "ModelSpec"]

HEADS, KV_HEADS = 8, 4  # Ulysses needs both divisible by the CP size
IMAGE_ID = VOCAB_SIZE  # the VLM's placeholder token: one past the corpus vocabulary
PATCHES, PATCH_DIM = 4, 16  # patches (placeholder tokens) per image, features per patch


@dataclass(frozen=True)
class BatchSpec:
    """What a batch builder needs: sizes, the batch kind and the step's seed."""

    batch: str
    batch_size: int
    seq_len: int
    seed: int


def _text_cfg(vocab: int = VOCAB_SIZE) -> TinyDecoderConfig:
    return TinyDecoderConfig(
        vocab_size=vocab, hidden_size=64, num_heads=HEADS, num_kv_heads=KV_HEADS
    )


def _logits(out: Any) -> torch.Tensor:
    logits: torch.Tensor = out if isinstance(out, torch.Tensor) else out.logits
    return logits


def _seeded(make: Callable[[], nn.Module], dtype: torch.dtype, seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return make().to(dtype)


# --- batches -----------------------------------------------------------------------------------


def corpus_batch(spec: BatchSpec) -> dict[str, Any]:
    """Corpus text: ``dense`` rows of one document each (right-padded, with ``attention_mask``)
    or one ``packed`` row of whole documents (``seq_lens``); labels pre-shifted."""
    if spec.batch == "dense":
        return dense_batch(spec.batch_size, spec.seq_len, seed=spec.seed)
    total = spec.batch_size * spec.seq_len
    ids, lens = packed_batch(total, max_doc_len=max(spec.seq_len // 2, 2), seed=spec.seed)
    pack = PackSpec.from_seq_lens([lens], total)
    return {"input_ids": ids, "labels": shift_labels_packed(ids, pack), "seq_lens": [lens]}


def vlm_batch(spec: BatchSpec) -> dict[str, Any]:
    """:func:`corpus_batch` with one image of :data:`PATCHES` placeholders at token 1 of every
    dense row / of every packed document long enough; ``pixel_values`` ``[N, PATCHES, 16]``;
    labels never target a placeholder (images are inputs, not predictions)."""
    batch = corpus_batch(spec)
    ids = batch["input_ids"].clone()
    if spec.batch == "dense":
        starts = [(b, 1) for b in range(ids.shape[0])]
        mask = batch["attention_mask"].bool()
    else:
        offsets = torch.tensor([0, *batch["seq_lens"][0]]).cumsum(0).tolist()
        starts = [(0, s + 1) for s, e in itertools.pairwise(offsets) if e - s >= PATCHES + 2]
    for b, s in starts:
        ids[b, s : s + PATCHES] = IMAGE_ID
    if spec.batch == "dense":
        labels = torch.full_like(ids, -100)
        labels[:, :-1] = torch.where(mask[:, 1:], ids[:, 1:], -100)
    else:
        total = ids.shape[1]
        labels = shift_labels_packed(ids, PackSpec.from_seq_lens(batch["seq_lens"], total))
    batch["input_ids"] = ids
    batch["labels"] = labels.masked_fill(labels == IMAGE_ID, -100)
    if starts:
        gen = torch.Generator().manual_seed(spec.seed + 7919)
        batch["pixel_values"] = torch.randn(len(starts), PATCHES, PATCH_DIM, generator=gen)
    return batch


# --- forwards (inside ctx()) and native losses (no cpshard) -----------------------------------


def _decoder_forward(model: nn.Module, local: dict[str, Any]) -> torch.Tensor:
    return _logits(model(input_ids=local["input_ids"], position_ids=local["position_ids"]))


def _vlm_forward(model: nn.Module, local: dict[str, Any]) -> torch.Tensor:
    return _logits(model(inputs_embeds=local["inputs_embeds"], position_ids=local["position_ids"]))


def _per_document(
    decode: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    x: torch.Tensor,
    labels: torch.Tensor,
    seq_lens: list[int],
) -> torch.Tensor:
    """Sum of every document's loss share, each decoded on its own (``x`` ``[1, T, ...]``)."""
    n = count_tokens(labels)
    total = torch.zeros((), dtype=torch.float32, device=labels.device)
    start = 0
    for length in seq_lens:
        pos = torch.arange(length, device=labels.device)[None]
        logits = decode(x[:, start : start + length], pos)
        total = total + cp_cross_entropy(logits, labels[:, start : start + length], num_tokens=n)
        start += length
    return total


def _decoder_native(model: nn.Module, batch: dict[str, Any]) -> torch.Tensor:
    """Dense rows with the model's own causal attention (right padding: real tokens never see a
    pad; HF models also get the attention mask); packed rows one document at a time."""
    labels, ids = batch["labels"], batch["input_ids"]
    if "seq_lens" in batch:
        if isinstance(model, TinyDecoder):
            return _per_document(lambda x, p: model(x, p), ids, labels, batch["seq_lens"][0])
        return _per_document(
            lambda x, p: _logits(model(input_ids=x, position_ids=p)),
            ids,
            labels,
            batch["seq_lens"][0],
        )
    if isinstance(model, TinyDecoder):
        out: Any = model(ids)
    else:
        out = model(input_ids=ids, attention_mask=batch["attention_mask"])
    return cp_cross_entropy(_logits(out), labels, num_tokens=count_tokens(labels))


def _vlm_native(model: nn.Module, batch: dict[str, Any]) -> torch.Tensor:
    """The VLM's own embedding of the images, then causal decoding (per document if packed)."""
    assert isinstance(model, TinyVLM)
    labels = batch["labels"]
    x = model.embed_inputs(batch["input_ids"], batch.get("pixel_values"))
    if "seq_lens" in batch:
        return _per_document(model.lm.decode, x, labels, batch["seq_lens"][0])
    pos = torch.arange(x.shape[1], device=x.device)[None]
    return cp_cross_entropy(model.lm.decode(x, pos), labels, num_tokens=count_tokens(labels))


def _prefix_native(model: nn.Module, batch: dict[str, Any]) -> torch.Tensor:
    """The plain ``[B, S]`` call: the model's prefix + block mask from positions 0..S-1."""
    labels = batch["labels"]
    return cp_cross_entropy(model(batch["input_ids"]), labels, num_tokens=count_tokens(labels))


# --- the table ---------------------------------------------------------------------------------


def _hf(kind: str) -> Callable[[torch.dtype, int], nn.Module]:
    def build(dtype: torch.dtype, seed: int) -> nn.Module:
        import transformers

        common: dict[str, Any] = {
            "vocab_size": VOCAB_SIZE,
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_hidden_layers": 2,
            "num_attention_heads": HEADS,
            "num_key_value_heads": KV_HEADS,
            "max_position_embeddings": 4096,
            "use_cache": False,
            "pad_token_id": PAD_ID,
        }
        if kind == "llama":
            return _seeded(
                lambda: transformers.LlamaForCausalLM(transformers.LlamaConfig(**common)),
                dtype,
                seed,
            )
        return _seeded(
            lambda: transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**common)), dtype, seed
        )

    return build


def _tiny(dtype: torch.dtype, seed: int) -> nn.Module:
    return _seeded(lambda: TinyDecoder(_text_cfg()), dtype, seed)


def _vlm(dtype: torch.dtype, seed: int) -> nn.Module:
    cfg = TinyVLMConfig(
        text=_text_cfg(VOCAB_SIZE + 1), image_token_id=IMAGE_ID, patch_dim=PATCH_DIM
    )
    return _seeded(lambda: TinyVLM(cfg), dtype, seed)


def _prefix(dtype: torch.dtype, seed: int) -> nn.Module:
    cfg = GlobalPrefixConfig(text=_text_cfg(), num_global_tokens=4, block_size=8)
    return _seeded(lambda: GlobalPrefixDecoder(cfg), dtype, seed)


@dataclass(frozen=True)
class ModelSpec:
    """One row of :data:`MODELS` (see the module docstring).

    Attributes:
        description: One line for the plan and ``--help``.
        build: ``(dtype, seed) -> model``, the same fixed init on every rank.
        batches: Batch kinds it trains on: ``"dense"`` and/or ``"packed"``.
        layouts: cpshard layouts it runs under, or ``None``: the layout is the one its hook
            returns, else the dispatcher's choice (``auto`` rows).
        attention: ``"cpshard"``: one row per CP attention method; ``"own"``: the model's
            attention needs no CP attention (one row, method ``own``).
        make_batch: ``BatchSpec -> global batch`` with pre-shifted ``labels``.
        forward: ``(model, local batch) -> logits [B, L, V]``, called inside ``ctx()``.
        native_loss: ``(model, global batch) -> global mean loss`` with the model's own
            attention, no cpshard; ``None`` if there is no such check.
    """

    description: str
    build: Callable[[torch.dtype, int], nn.Module]
    batches: tuple[str, ...] = ("dense", "packed")
    layouts: tuple[str, ...] | None = (*DENSE_LAYOUTS, *PACKED_LAYOUTS)
    attention: Literal["cpshard", "own"] = "cpshard"
    make_batch: Callable[[BatchSpec], dict[str, Any]] = corpus_batch
    forward: Callable[[nn.Module, dict[str, Any]], torch.Tensor] = _decoder_forward
    native_loss: Callable[[nn.Module, dict[str, Any]], torch.Tensor] | None = _decoder_native


MODELS: dict[str, ModelSpec] = {
    "llama": ModelSpec("HF LlamaForCausalLM, 2 layers, 8/4 heads, from a config", _hf("llama")),
    "qwen2": ModelSpec("HF Qwen2ForCausalLM, 2 layers, 8/4 heads, from a config", _hf("qwen2")),
    "tiny": ModelSpec("cpshard.models.TinyDecoder, plain PyTorch F.sdpa", _tiny),
    "vlm": ModelSpec(
        "cpshard.models.TinyVLM, pre-embedding: its hook folds pixel_values into inputs_embeds",
        _vlm,
        layouts=None,
        make_batch=vlm_batch,
        forward=_vlm_forward,
        native_loss=_vlm_native,
    ),
    "prefix": ModelSpec(
        "cpshard.models.GlobalPrefixDecoder, model-owned: its sharder repositions tokens",
        _prefix,
        batches=("dense",),
        layouts=None,
        attention="own",
        native_loss=_prefix_native,
    ),
}
