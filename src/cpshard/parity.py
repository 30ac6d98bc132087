"""Loss and gradient parity: the same training steps at cp=1 and cp=N must agree.

One function, :func:`train_steps`, runs a few AdamW steps of a tiny decoder on real text (the
shipped corpus) through the public contract: ``prepare_cp_forward`` -> ``with ctx(): model(...)``
-> :func:`cpshard.loss.cp_cross_entropy` -> gradient all-reduce over the CP group. It has no
branch on the CP size, so running it on one rank gives the reference and running it on N ranks
gives the CP result; :func:`compare` says how far apart they are.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from cpshard import _comm
from cpshard.corpus import PAD_ID, VOCAB_SIZE, dense_batch, packed_batch
from cpshard.dispatch import LayoutName, prepare_cp_forward
from cpshard.loss import count_tokens, cp_cross_entropy, reduce_for_logging
from cpshard.models import TinyDecoder, TinyDecoderConfig
from cpshard.packing import PackSpec, shift_labels_packed

__all__ = [
    "ModelKind",
    "ParityCase",
    "ParityResult",
    "build_model",
    "compare",
    "native_steps",
    "train_steps",
]

ModelKind = Literal["llama", "qwen2", "tiny"]
_DTYPES = {"float32": torch.float32, "float64": torch.float64}
HEADS, KV_HEADS = 8, 4  # Ulysses needs both divisible by the CP size


@dataclass(frozen=True)
class ParityCase:
    """One parity run: model, batch kind, layout, attention method and sizes."""

    model: ModelKind = "llama"
    batch: Literal["dense", "packed"] = "dense"
    layout: LayoutName = "auto"
    method: str = "all_gather"
    steps: int = 3
    seq_len: int = 256
    batch_size: int = 2
    dtype: str = "float32"
    seed: int = 0


@dataclass(frozen=True)
class ParityResult:
    """What :func:`train_steps` reports (rank 0's view; gradients are CP-reduced)."""

    layout: str
    losses: list[float]
    first_grads: torch.Tensor  # all parameters' gradients of step 0, flattened
    local_tokens: int


def build_model(kind: ModelKind, dtype: torch.dtype, seed: int = 0) -> nn.Module:
    """A tiny decoder with a fixed random init (the same on every rank); no downloads."""
    torch.manual_seed(seed)
    if kind == "tiny":
        cfg = TinyDecoderConfig(
            vocab_size=VOCAB_SIZE, hidden_size=64, num_heads=HEADS, num_kv_heads=KV_HEADS
        )
        return TinyDecoder(cfg).to(dtype)
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
        config: Any = transformers.LlamaConfig(**common)
        model: nn.Module = transformers.LlamaForCausalLM(config)
    elif kind == "qwen2":
        config = transformers.Qwen2Config(**common)
        model = transformers.Qwen2ForCausalLM(config)
    else:
        raise ValueError(f"model must be 'llama', 'qwen2' or 'tiny', got model={kind!r}")
    return model.to(dtype)


def _batch(case: ParityCase, step: int) -> dict[str, Any]:
    seed = case.seed * 1000 + step
    if case.batch == "dense":
        return dense_batch(case.batch_size, case.seq_len, seed=seed)
    total = case.batch_size * case.seq_len
    ids, lens = packed_batch(total, max_doc_len=max(case.seq_len // 2, 2), seed=seed)
    spec = PackSpec.from_seq_lens([lens], total)
    return {"input_ids": ids, "labels": shift_labels_packed(ids, spec), "seq_lens": [lens]}


def train_steps(cp_mesh: DeviceMesh | None, case: ParityCase) -> ParityResult:
    """Run ``case.steps`` AdamW steps through the CP contract and report losses and gradients.

    Args:
        cp_mesh: The CP mesh (size 1 or ``None`` gives the single-process reference).
        case: What to run.

    Returns:
        The global loss of every step, the CP-reduced step-0 gradients and the local length.
    """
    dtype = _DTYPES[case.dtype]
    model = build_model(case.model, dtype, case.seed)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    group = _comm.cp_group(cp_mesh)
    losses: list[float] = []
    first: torch.Tensor | None = None
    layout, local_tokens = "", 0
    for step in range(case.steps):
        batch = _batch(case, step)
        ctx, local, sharder = prepare_cp_forward(
            model,
            cp_mesh,
            batch,
            padding_token_id=PAD_ID,
            layout=case.layout,
            attention=case.method,
        )
        with ctx():
            out = model(input_ids=local["input_ids"], position_ids=local["position_ids"])
        logits = out if isinstance(out, torch.Tensor) else out.logits
        loss = cp_cross_entropy(logits, local["labels"], num_tokens=count_tokens(batch["labels"]))
        loss.backward()  # type: ignore[no-untyped-call]
        for p in model.parameters():
            if p.grad is not None:
                _comm.all_reduce_sum_(p.grad, group)
        if first is None:
            first = torch.cat(
                [p.grad.reshape(-1) for p in model.parameters() if p.grad is not None]
            )
        losses.append(float(reduce_for_logging(loss, cp_mesh)))
        opt.step()
        opt.zero_grad(set_to_none=True)
        layout, local_tokens = sharder.layout, int(local["input_ids"].shape[1])
    assert first is not None
    return ParityResult(layout, losses, first.detach().double(), local_tokens)


def _native_loss(model: nn.Module, batch: dict[str, Any], packed: bool) -> torch.Tensor:
    """Global mean loss with the model's own attention, no cpshard involved."""
    labels = batch["labels"]
    if not packed:
        ids = batch["input_ids"]
        if isinstance(model, TinyDecoder):  # causal + right padding: real tokens never see pads
            out: Any = model(ids)
        else:
            out = model(input_ids=ids, attention_mask=batch["attention_mask"])
        logits = out if isinstance(out, torch.Tensor) else out.logits
        return cp_cross_entropy(logits, labels, num_tokens=count_tokens(labels))
    # packed: every document on its own, so no token can see another document
    total = torch.zeros((), dtype=torch.float32)
    start = 0
    for n in batch["seq_lens"][0]:
        doc = batch["input_ids"][:, start : start + n]
        out = model(doc) if isinstance(model, TinyDecoder) else model(input_ids=doc)
        logits = out if isinstance(out, torch.Tensor) else out.logits
        total = total + cp_cross_entropy(
            logits, labels[:, start : start + n], num_tokens=count_tokens(labels)
        )
        start += n
    return total


def native_steps(case: ParityCase) -> ParityResult:
    """The same steps as :func:`train_steps` without cpshard: the model's own attention (dense
    rows with their attention mask; packed rows one document at a time). An independent check
    of the cp=1 reference."""
    model = build_model(case.model, _DTYPES[case.dtype], case.seed)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses: list[float] = []
    first: torch.Tensor | None = None
    for step in range(case.steps):
        batch = _batch(case, step)
        loss = _native_loss(model, batch, case.batch == "packed")
        loss.backward()  # type: ignore[no-untyped-call]
        if first is None:
            first = torch.cat(
                [p.grad.reshape(-1) for p in model.parameters() if p.grad is not None]
            )
        losses.append(float(loss.detach()))
        opt.step()
        opt.zero_grad(set_to_none=True)
    assert first is not None
    return ParityResult("native", losses, first.detach().double(), case.batch_size * case.seq_len)


def compare(ref: ParityResult, got: ParityResult) -> tuple[float, float]:
    """``(max |loss difference| over steps, max |grad difference| / max |reference grad|)``."""
    dloss = max(abs(a - b) for a, b in zip(ref.losses, got.losses, strict=True))
    scale = float(ref.first_grads.abs().max()) or 1.0
    dgrad = float((ref.first_grads - got.first_grads).abs().max()) / scale
    return dloss, dgrad
