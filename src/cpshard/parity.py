"""Loss and gradient parity: the same training steps at cp=1 and cp=N must agree.

:func:`train_steps` runs AdamW steps of a tiny model on real text (the shipped corpus) through the
public contract: ``prepare_cp_forward`` -> ``with ctx(): model(...)`` ->
:func:`cpshard.loss.cp_cross_entropy` -> gradient all-reduce over the CP group. It has no branch
on the CP size, so one rank gives the reference and N ranks give the CP result;
:func:`compare` measures, at every step, how far apart the losses and the gradients are, and
:data:`TOLERANCES` says how far is too far.

The models a parity run can use are one table, :data:`MODELS`: how to build each, which batches
it trains on, which layouts apply (``None``: the model owns its CP layout) and how to check the
cp=1 reference against the model's own attention.
"""

from __future__ import annotations

from collections.abc import Callable
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
    "DTYPES",
    "GRAD_SYNCS",
    "HEADS",
    "KV_HEADS",
    "MODELS",
    "TOLERANCES",
    "ModelSpec",
    "ParityCase",
    "ParityResult",
    "StepDiff",
    "Tolerance",
    "build_model",
    "compare",
    "native_steps",
    "train_steps",
]

DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16}
HEADS, KV_HEADS = 8, 4  # Ulysses needs both divisible by the CP size
GradSync = Literal["sum", "mean", "none"]
# "sum" is right; "mean" (averaging over the CP group without cp_loss_scale) and "none" (no
# all-reduce) are the two classic mistakes, there to show that the check catches them.
GRAD_SYNCS: tuple[GradSync, ...] = ("sum", "mean", "none")


@dataclass(frozen=True)
class Tolerance:
    """Pass thresholds of one dtype, applied at every step.

    Attributes:
        rel_loss: Max ``|loss_cp - loss_ref| / |loss_ref|``.
        grad: Max ``max|g_cp - g_ref| / max|g_ref|`` over all parameters.
    """

    rel_loss: float
    grad: float


# fp32: the measured differences are ~1e-7 (summation order only), so 1e-5 leaves 100x margin
# while a real bug (a missing mask, a wrong gradient sync) is >= 1e-3. bf16 rounds every matmul
# and every weight update to 8 mantissa bits (eps 7.8e-3): cp=1 and cp=N sum in a different
# order, round differently and drift apart step by step (AdamW amplifies sign flips of tiny
# gradients): measured over 50 steps at cp=2, rel |dloss| <= 4.3e-4 and grad err <= 0.10 (the
# cp=1 reference against the model's own attention differs by as much: 1.5e-3 and 0.03), so bf16
# gets loose bounds, 1 % of the loss and 25 % of the largest gradient. They still catch a wrong
# gradient sync (error >= 1 - 1/C = 0.5); the fp32 rows are the correctness check.
TOLERANCES = {
    "float64": Tolerance(rel_loss=1e-12, grad=1e-10),
    "float32": Tolerance(rel_loss=1e-5, grad=1e-5),
    "bfloat16": Tolerance(rel_loss=1e-2, grad=0.25),
}


@dataclass(frozen=True)
class ParityCase:
    """One parity run: model, batch kind, layout, attention method, sizes and the grad sync."""

    model: str = "llama"
    batch: str = "dense"
    layout: LayoutName = "auto"
    method: str = "all_gather"
    steps: int = 3
    seq_len: int = 256
    batch_size: int = 2
    dtype: str = "float32"
    seed: int = 0
    grad_sync: GradSync = "sum"
    device: str = "cpu"


@dataclass(frozen=True)
class ParityResult:
    """What :func:`train_steps` reports (rank 0's view; gradients are CP-reduced).

    Attributes:
        layout: The sharder's layout label.
        losses: Global loss of every step.
        grads: Per step, every parameter's gradient flattened into one CPU tensor ``[n_params]``.
        local_tokens: Length of this rank's shard (tokens per row).
    """

    layout: str
    losses: list[float]
    grads: list[torch.Tensor]
    local_tokens: int


@dataclass(frozen=True)
class StepDiff:
    """Per-step differences of a CP run against its reference (see :func:`compare`)."""

    abs_dloss: list[float]
    rel_dloss: list[float]
    grad_err: list[float]

    def passed(self, tol: Tolerance) -> bool:
        """Every step within ``tol`` (NaN never passes)."""
        return all(d <= tol.rel_loss for d in self.rel_dloss) and all(
            g <= tol.grad for g in self.grad_err
        )


# --- the model table --------------------------------------------------------------------------


def _hf_model(kind: str) -> Callable[[torch.dtype, int], nn.Module]:
    def build(dtype: torch.dtype, seed: int) -> nn.Module:
        import transformers

        torch.manual_seed(seed)
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
        model: nn.Module
        if kind == "llama":
            model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**common))
        else:
            model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**common))
        return nn.Module.to(model, dtype)

    return build


def _tiny_model(dtype: torch.dtype, seed: int) -> nn.Module:
    torch.manual_seed(seed)
    cfg = TinyDecoderConfig(
        vocab_size=VOCAB_SIZE, hidden_size=64, num_heads=HEADS, num_kv_heads=KV_HEADS
    )
    return TinyDecoder(cfg).to(dtype)


def _logits(out: Any) -> torch.Tensor:
    logits: torch.Tensor = out if isinstance(out, torch.Tensor) else out.logits
    return logits


def _decoder_forward(model: nn.Module, local: dict[str, Any]) -> torch.Tensor:
    return _logits(model(input_ids=local["input_ids"], position_ids=local["position_ids"]))


def _decoder_native(model: nn.Module, batch: dict[str, Any], packed: bool) -> torch.Tensor:
    """Global mean loss with the model's own attention, no cpshard involved."""
    labels = batch["labels"]
    n = count_tokens(labels)
    if not packed:
        ids = batch["input_ids"]
        if isinstance(model, TinyDecoder):  # causal + right padding: real tokens never see pads
            return cp_cross_entropy(_logits(model(ids)), labels, num_tokens=n)
        out = model(input_ids=ids, attention_mask=batch["attention_mask"])
        return cp_cross_entropy(_logits(out), labels, num_tokens=n)
    # packed: every document on its own, so no token can see another document
    total = torch.zeros((), dtype=torch.float32, device=labels.device)
    start = 0
    for length in batch["seq_lens"][0]:
        doc = batch["input_ids"][:, start : start + length]
        out = model(doc) if isinstance(model, TinyDecoder) else model(input_ids=doc)
        total = total + cp_cross_entropy(
            _logits(out), labels[:, start : start + length], num_tokens=n
        )
        start += length
    return total


def _corpus_batch(case: ParityCase, step: int) -> dict[str, Any]:
    seed = case.seed * 1000 + step
    if case.batch == "dense":
        return dense_batch(case.batch_size, case.seq_len, seed=seed)
    total = case.batch_size * case.seq_len
    ids, lens = packed_batch(total, max_doc_len=max(case.seq_len // 2, 2), seed=seed)
    spec = PackSpec.from_seq_lens([lens], total)
    return {"input_ids": ids, "labels": shift_labels_packed(ids, spec), "seq_lens": [lens]}


@dataclass(frozen=True)
class ModelSpec:
    """One row of :data:`MODELS`: everything parity needs to know about a model.

    Attributes:
        description: One line for the plan and ``--help``.
        build: ``(dtype, seed) -> model``, the same fixed init on every rank.
        batches: Batch kinds it trains on (``"dense"``: one document per row, right-padded;
            ``"packed"``: whole documents packed into one row).
        layouts: cpshard layouts it runs under, or ``None`` when the model owns its CP layout
            (its ``prepare_model_inputs_for_cp`` returns the sharder): then one row per method.
        make_batch: ``(case, step) -> global batch`` (with pre-shifted ``labels``).
        forward: ``(model, local batch) -> logits [B, L, V]``, called inside ``ctx()``.
        native_loss: ``(model, batch, packed) -> global mean loss`` with the model's own
            attention (an independent check of the cp=1 reference), or ``None``.
    """

    description: str
    build: Callable[[torch.dtype, int], nn.Module]
    batches: tuple[str, ...] = ("dense", "packed")
    layouts: tuple[str, ...] | None = ("round_robin", "contiguous", "balanced", "packed")
    make_batch: Callable[[ParityCase, int], dict[str, Any]] = _corpus_batch
    forward: Callable[[nn.Module, dict[str, Any]], torch.Tensor] = _decoder_forward
    native_loss: Callable[[nn.Module, dict[str, Any], bool], torch.Tensor] | None = _decoder_native


MODELS: dict[str, ModelSpec] = {
    "llama": ModelSpec(
        "HF LlamaForCausalLM, 2 layers, 8/4 heads (config only)", _hf_model("llama")
    ),
    "qwen2": ModelSpec(
        "HF Qwen2ForCausalLM, 2 layers, 8/4 heads (config only)", _hf_model("qwen2")
    ),
    "tiny": ModelSpec("cpshard.models.TinyDecoder: plain PyTorch, F.sdpa", _tiny_model),
}


def build_model(kind: str, dtype: torch.dtype, seed: int = 0) -> nn.Module:
    """The model ``kind`` of :data:`MODELS` with a fixed random init; no downloads."""
    if kind not in MODELS:
        raise ValueError(f"model must be one of {sorted(MODELS)}, got model={kind!r}")
    return MODELS[kind].build(dtype, seed)


# --- running and comparing ---------------------------------------------------------------------


def _to_device(batch: dict[str, Any], device: torch.device) -> dict[str, Any]:
    return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}


def _flat_grads(model: nn.Module) -> torch.Tensor:
    keep = torch.float64 if next(model.parameters()).dtype == torch.float64 else torch.float32
    return torch.cat(
        [
            p.grad.detach().reshape(-1).to("cpu", keep)
            for p in model.parameters()
            if p.grad is not None
        ]
    )


def train_steps(cp_mesh: DeviceMesh | None, case: ParityCase) -> ParityResult:
    """Run ``case.steps`` AdamW steps through the CP contract; report losses and gradients.

    Args:
        cp_mesh: The CP mesh (size 1 or ``None`` gives the single-process reference).
        case: What to run.

    Returns:
        The global loss and the CP-reduced gradients of every step, and the local length.
    """
    spec = MODELS[case.model]
    device = torch.device(case.device)
    model = build_model(case.model, DTYPES[case.dtype], case.seed).to(device)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    group = _comm.cp_group(cp_mesh)
    _, cp_size = _comm.cp_rank_and_size(cp_mesh)
    losses: list[float] = []
    grads: list[torch.Tensor] = []
    layout, local_tokens = "", 0
    for step in range(case.steps):
        batch = _to_device(spec.make_batch(case, step), device)
        ctx, local, sharder = prepare_cp_forward(
            model,
            cp_mesh,
            batch,
            padding_token_id=PAD_ID,
            layout=case.layout,
            attention=case.method,
        )
        with ctx():
            logits = spec.forward(model, local)
        loss = cp_cross_entropy(logits, local["labels"], num_tokens=count_tokens(batch["labels"]))
        loss.backward()  # type: ignore[no-untyped-call]
        for p in model.parameters():
            if p.grad is not None and case.grad_sync != "none":
                _comm.all_reduce_sum_(p.grad, group)
                if case.grad_sync == "mean":
                    p.grad.div_(cp_size)
        grads.append(_flat_grads(model))
        losses.append(float(reduce_for_logging(loss, cp_mesh)))
        opt.step()
        opt.zero_grad(set_to_none=True)
        layout, local_tokens = sharder.layout, int(local["labels"].shape[-1])
    return ParityResult(layout, losses, grads, local_tokens)


def native_steps(case: ParityCase) -> ParityResult:
    """The same steps as :func:`train_steps` without cpshard: the model's own attention (dense
    rows with their attention mask; packed rows one document at a time). An independent check
    of the cp=1 reference.

    Raises:
        ValueError: the model has no native check (``native_loss`` is ``None``).
    """
    spec = MODELS[case.model]
    if spec.native_loss is None:
        raise ValueError(f"model {case.model!r} has no native-attention check")
    device = torch.device(case.device)
    model = build_model(case.model, DTYPES[case.dtype], case.seed).to(device)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses: list[float] = []
    grads: list[torch.Tensor] = []
    for step in range(case.steps):
        batch = _to_device(spec.make_batch(case, step), device)
        loss = spec.native_loss(model, batch, case.batch == "packed")
        loss.backward()  # type: ignore[no-untyped-call]
        grads.append(_flat_grads(model))
        losses.append(float(loss.detach()))
        opt.step()
        opt.zero_grad(set_to_none=True)
    return ParityResult("native", losses, grads, int(batch["labels"].shape[-1]))


def compare(ref: ParityResult, got: ParityResult) -> StepDiff:
    """Per step: ``|dloss|``, ``|dloss| / |ref loss|`` and ``max|dg| / max|g_ref|``.

    Args:
        ref: The reference run (cp=1).
        got: The run to check, same number of steps.

    Returns:
        The per-step differences (NaN where a loss or gradient is not finite).
    """
    if len(ref.losses) != len(got.losses) or len(ref.grads) != len(got.grads):
        raise ValueError(
            f"runs differ in length: {len(ref.losses)} vs {len(got.losses)} steps; compare runs "
            "of the same case"
        )
    abs_d, rel_d, gerr = [], [], []
    for a, b in zip(ref.losses, got.losses, strict=True):
        d = abs(a - b)
        abs_d.append(d)
        rel_d.append(d / abs(a) if a != 0 else d)
    for g_ref, g_got in zip(ref.grads, got.grads, strict=True):
        if g_ref.shape != g_got.shape:
            raise ValueError(f"gradient sizes differ: {g_ref.numel()} vs {g_got.numel()}")
        g_ref, g_got = g_ref.double(), g_got.double()
        scale = float(g_ref.abs().max()) if g_ref.numel() else 0.0
        err = float((g_ref - g_got).abs().max()) if g_ref.numel() else 0.0
        gerr.append(err / scale if scale > 0 else err)
    return StepDiff(abs_d, rel_d, gerr)
