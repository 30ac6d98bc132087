"""Rank functions for the CP attention tests (top-level, so pool ranks can import them)."""

from __future__ import annotations

import contextlib
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh

import cpshard.attention.selective_plan as selective_plan_mod
from _attention_common import DTYPES, inputs, local_shards, make_case, make_meta
from cpshard import prepare_cp_forward, shift_labels
from cpshard._comm import cp_group
from cpshard.attention import cp_attention_context, cp_sdpa


def cp_attention_case(
    cp_mesh: DeviceMesh,
    method: str,
    layout: str,
    seq_len: int,
    heads: tuple[int, int],
    causal: bool,
    dtype: str,
    meta_batch: int = 1,
    n_docs: int = 3,
    seed: int = 0,
    backend: str = "auto",
    window: int | None = None,
    softcap: float | None = None,
    value_dim: int | None = None,
) -> dict[str, torch.Tensor]:
    """Local output and gradients of ``cp_sdpa`` for one case (inputs sharded from global);
    ``value_dim``: a value head dim other than the query/key one (MLA)."""
    rmap, docs = make_case(layout, cp_mesh.size(), seq_len, 2, n_docs, seed, meta_batch)
    return cp_attention_given(
        cp_mesh, method, rmap, docs, heads, causal, dtype, seed, backend, window, softcap,
        value_dim,
    )  # fmt: skip


def cp_attention_given(
    cp_mesh: DeviceMesh,
    method: str,
    rmap: torch.Tensor,
    docs: torch.Tensor,
    heads: tuple[int, int],
    causal: bool,
    dtype: str,
    seed: int = 0,
    backend: str = "auto",
    window: int | None = None,
    softcap: float | None = None,
    value_dim: int | None = None,
    stream_order: bool | None = None,
) -> dict[str, torch.Tensor]:
    """:func:`cp_attention_case` of a given rank map ``[C, L]`` and global document ids
    ``[1 or B, P]``. ``stream_order``: ``True`` puts selective's received keys in stream order
    wherever they have two runs or more, ``False`` never (``None``: the library's rule)."""
    rank = cp_mesh.get_local_rank()
    batch, dim = 2, 8
    q, k, v, go = inputs(batch, heads[0], heads[1], rmap.numel(), dim, seed)
    if value_dim is not None:
        _, _, v, go = inputs(batch, heads[0], heads[1], rmap.numel(), value_dim, seed + 7)
    idx = rmap[rank]
    ql, kl, vl = local_shards((q, k, v), idx, DTYPES[dtype])
    meta = make_meta(rmap, docs, rank)
    rule = (selective_plan_mod.SHORT_RUNS, selective_plan_mod.FEWER_RUNS)
    if stream_order is not None:  # this rank process only, restored below
        selective_plan_mod.SHORT_RUNS = 1 << 62 if stream_order else 0
        selective_plan_mod.FEWER_RUNS = 1
    try:
        out = cp_sdpa(
            ql, kl, vl, group=cp_group(cp_mesh), meta=meta, method=method, causal=causal,
            backend=backend, window=window, softcap=softcap,  # type: ignore[arg-type]
        )  # fmt: skip
        (out * go.index_select(2, idx).to(out.dtype)).sum().backward()
    finally:
        selective_plan_mod.SHORT_RUNS, selective_plan_mod.FEWER_RUNS = rule
    assert ql.grad is not None
    assert kl.grad is not None
    assert vl.grad is not None
    return {"out": out.detach(), "dq": ql.grad, "dk": kl.grad, "dv": vl.grad, "idx": idx}


def cp_attention_error(
    cp_mesh: DeviceMesh,
    method: str,
    heads: tuple[int, int],
    seq_len: int,
    window: int | None = None,
    softcap: float | None = None,
) -> str:
    """The ValueError message ``cp_sdpa`` raises on this rank (every rank must raise)."""
    rank, world = cp_mesh.get_local_rank(), cp_mesh.size()
    rmap, docs = make_case("round_robin", world, seq_len, 1, 1, 0, 1)
    q, k, v, _ = inputs(1, heads[0], heads[1], rmap.numel(), 8, 0)
    idx = rmap[rank]
    try:
        cp_sdpa(
            q.index_select(2, idx), k.index_select(2, idx), v.index_select(2, idx),
            group=cp_group(cp_mesh), meta=make_meta(rmap, docs, rank), method=method,
            window=window, softcap=softcap,
        )  # fmt: skip
    except ValueError as e:
        return str(e)
    return "no error"


class TinyAttention(torch.nn.Module):
    """A plain module that calls ``F.scaled_dot_product_attention`` twice: self and cross."""

    def __init__(self, dim: int, heads: int, kv_heads: int) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.hd = heads, kv_heads, dim // heads
        self.q = torch.nn.Linear(dim, dim, dtype=torch.float64)
        self.kv = torch.nn.Linear(dim, 2 * kv_heads * self.hd, dtype=torch.float64)

    def forward(self, x: torch.Tensor, memory: torch.Tensor) -> torch.Tensor:
        b, n, _ = x.shape
        q = self.q(x).view(b, n, self.heads, self.hd).transpose(1, 2)
        k, v = self.kv(x).view(b, n, 2, self.kv_heads, self.hd).unbind(2)
        k, v = k.transpose(1, 2), v.transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        # cross-attention to a memory of another length: must pass through untouched
        mk = memory.unsqueeze(1).expand(b, self.heads, -1, self.hd)
        y = y + F.scaled_dot_product_attention(q, mk, mk)
        return y.transpose(1, 2).reshape(b, n, -1)


def tiny_module_case(
    cp_mesh: DeviceMesh | None, method: str, layout: str, seq_len: int, use_context: bool = True
) -> Any:
    """Output and parameter grads of :class:`TinyAttention` under ``cp_attention_context``."""
    rank, world = (0, 1) if cp_mesh is None else (cp_mesh.get_local_rank(), cp_mesh.size())
    rmap, docs = make_case(layout, world, seq_len, 1, 1, 0, 1)
    docs = torch.zeros_like(docs)  # one document, no padding: plain causal attention
    torch.manual_seed(0)
    model = TinyAttention(16, 4, 2)
    x = torch.randn(2, rmap.numel(), 16, dtype=torch.float64)
    memory = torch.randn(2, 5, 4, dtype=torch.float64)
    idx = rmap[rank]
    meta = make_meta(rmap, docs, rank)
    ctx = cp_attention_context(cp_mesh, meta, method) if use_context else contextlib.nullcontext()
    with ctx:
        y = model(x.index_select(1, idx), memory)
    y.pow(2).sum().backward()  # backward outside the context
    grads = {n: p.grad for n, p in model.named_parameters()}
    return y.detach(), idx, grads


def tiny_hf_model(arch: str) -> Any:
    """A tiny random-init causal LM in fp64 (fixed seed, no download).

    ``llama``, ``qwen2``; with sliding windows of 3 tokens: ``mistral`` (every layer),
    ``qwen2_sw`` / ``qwen3_sw`` (``use_sliding_window``; layer 0 full, layer 1 windowed),
    ``gemma2`` (alternating windowed / full layers and score soft-capping).
    """
    import transformers as tf

    small = {
        "vocab_size": 128, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "use_cache": False,
    }  # fmt: skip
    window = {"use_sliding_window": True, "sliding_window": 3, "max_window_layers": 1}
    config_cls, model_cls, extra = {
        "llama": (tf.LlamaConfig, tf.LlamaForCausalLM, {}),
        "qwen2": (tf.Qwen2Config, tf.Qwen2ForCausalLM, {}),
        "mistral": (tf.MistralConfig, tf.MistralForCausalLM, {"sliding_window": 3}),
        "qwen2_sw": (tf.Qwen2Config, tf.Qwen2ForCausalLM, window),
        "qwen3_sw": (tf.Qwen3Config, tf.Qwen3ForCausalLM, {**window, "head_dim": 8}),
        "gemma2": (
            tf.Gemma2Config, tf.Gemma2ForCausalLM,
            {"sliding_window": 3, "attn_logit_softcapping": 2.0, "head_dim": 8,
             "initializer_range": 0.5},  # large weights: scores of a few units, capped
        ),
    }[arch]  # fmt: skip
    cfg = config_cls(**small, **extra)
    torch.manual_seed(0)
    return model_cls(cfg).to(torch.float64)


def hf_tokens(seq_len: int, padded: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(input_ids [1, P], labels [1, P])``: random ids, pre-shifted labels, pads at the end."""
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(1, 128, (1, padded), generator=g)
    ids[:, seq_len:] = 0
    labels = torch.full_like(ids, -100)
    labels[:, : seq_len - 1] = ids[:, 1:seq_len]
    return ids, labels


def _backward_and_reduce(
    model: torch.nn.Module, loss: torch.Tensor, cp_mesh: DeviceMesh
) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """Backward of this rank's partial loss; parameter grads and the loss summed over CP."""
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    group = cp_group(cp_mesh)
    total = loss.detach().clone()
    if group is not None:
        for g in grads.values():
            dist.all_reduce(g, group=group)
        dist.all_reduce(total, group=group)
    return grads, total


def hf_case(
    cp_mesh: DeviceMesh, arch: str, method: str, layout: str, seq_len: int
) -> dict[str, Any]:
    """Logits, loss and all-reduced grads of a tiny HF model under CP attention."""
    from cpshard.attention import use_cp_attention

    rank, world = cp_mesh.get_local_rank(), cp_mesh.size()
    rmap, docs = make_case(layout, world, seq_len, 1, 1, 0, 1)
    ids, labels = hf_tokens(seq_len, rmap.numel())
    model = tiny_hf_model(arch)
    use_cp_attention(model)
    use_cp_attention(model)  # idempotent
    idx = rmap[rank]
    meta = make_meta(rmap, docs, rank)
    n_tokens = int((labels != -100).sum())
    with cp_attention_context(cp_mesh, meta, method):
        logits = model(input_ids=ids[:, idx], position_ids=idx[None]).logits
    loss = F.cross_entropy(logits[0], labels[0, idx], ignore_index=-100, reduction="sum") / n_tokens
    grads, total = _backward_and_reduce(model, loss, cp_mesh)
    return {
        "logits": logits.detach(),
        "idx": idx,
        "loss": float(total),
        "grads": grads if rank == 0 else {},
    }


def hf_padded_batch(padding: str) -> dict[str, torch.Tensor]:
    """A ``[2, 11]`` batch with ``attention_mask`` (``padding``: right, left or mixed rows)."""
    g = torch.Generator().manual_seed(11)
    ids = torch.randint(1, 128, (2, 11), generator=g)
    mask = torch.ones_like(ids)
    if padding in ("left", "mixed"):
        mask[0, :4] = 0
    if padding in ("right", "mixed"):
        mask[1, 7:] = 0
    if padding == "left":
        mask[1, :2] = 0
    if padding == "right":
        mask[0, 9:] = 0
    ids = ids.masked_fill(mask == 0, 0)
    labels = shift_labels(ids, padding_mask=mask == 0)
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def hf_public_reference(arch: str, padding: str) -> dict[str, Any]:
    """One process, the model's own ``sdpa`` attention and the batch's ``attention_mask``."""
    batch = hf_padded_batch(padding)
    model = tiny_hf_model(arch)
    model.set_attn_implementation("sdpa")
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    labels = batch["labels"]
    n = int((labels != -100).sum())
    loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="sum") / n
    loss.backward()
    grads = {k: p.grad for k, p in model.named_parameters() if p.grad is not None}
    return {
        "logits": logits.detach(),
        "loss": float(loss.detach()),
        "grads": grads,
        "mask": batch["attention_mask"],
    }


def hf_public_case(
    cp_mesh: DeviceMesh, arch: str, method: str, padding: str, call: str
) -> dict[str, Any]:
    """The README path: ``prepare_cp_forward`` with an ``attention_mask`` batch, then the model."""
    batch = hf_padded_batch(padding)
    snapshot = {k: v.clone() for k, v in batch.items()}
    model = tiny_hf_model(arch)
    ctx, local, sharder = prepare_cp_forward(model, cp_mesh, batch, attention=method)
    for key, value in snapshot.items():  # the caller's batch is untouched
        assert torch.equal(batch[key], value), key
    with ctx():
        if call == "explicit":
            out = model(
                input_ids=local["input_ids"],
                position_ids=local["position_ids"],
                padding_mask=local.get("padding_mask"),
            )
        else:  # everything the sharded batch holds, except the pre-shifted labels
            out = model(**{k: v for k, v in local.items() if k != "labels"})
    logits = out.logits
    n = int((batch["labels"] != -100).sum())
    loss = F.cross_entropy(logits.flatten(0, 1), local["labels"].flatten(), reduction="sum") / n
    grads, total = _backward_and_reduce(model, loss, cp_mesh)
    full = sharder.gather_token_tensor(logits.detach(), trim=True)
    return {
        "logits": full,
        "loss": float(total),
        "grads": grads if cp_mesh.get_local_rank() == 0 else {},
    }


class SelfAttentionOnly(TinyAttention):
    """:class:`TinyAttention`'s self-attention alone: ``cp_attention`` (default ``"auto"``) with
    a sharder, plain causal SDPA without one (the one-process reference)."""

    def __init__(self, sharder: Any = None) -> None:
        super().__init__(16, 4, 2)
        self.sharder = sharder

    def forward(self, x: torch.Tensor, memory: torch.Tensor) -> torch.Tensor:
        from cpshard.attention import cp_attention

        b, n, _ = x.shape
        q = self.q(x).view(b, n, self.heads, self.hd).transpose(1, 2)
        k, v = self.kv(x).view(b, n, 2, self.kv_heads, self.hd).unbind(2)
        k, v = k.transpose(1, 2), v.transpose(1, 2)
        if self.sharder is None:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        else:
            y = cp_attention(q, k, v, sharder=self.sharder)
        return y.transpose(1, 2).reshape(b, n, -1)


COMPILE_STEPS = 3


def _compile_inputs() -> tuple[torch.Tensor, torch.Tensor]:
    """``x [2, 20, 16]`` (20 tokens: no pad rows under round_robin at cp=2), ``memory``."""
    g = torch.Generator().manual_seed(7)
    x = torch.randn(2, 20, 16, dtype=torch.float64, generator=g)
    return x, torch.randn(2, 5, 4, dtype=torch.float64, generator=g)


def _sgd_steps(
    model: torch.nn.Module, step: Any, group: Any = None
) -> list[tuple[torch.Tensor, dict[str, torch.Tensor]]]:
    """:data:`COMPILE_STEPS` SGD steps; per step ``step()``'s output and the (CP-summed) grads."""
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    out = []
    for _ in range(COMPILE_STEPS):
        opt.zero_grad()
        y, loss = step()
        loss.backward()
        for p in model.parameters():
            assert p.grad is not None
            if group is not None:
                dist.all_reduce(p.grad, group=group)
        out.append((y, {n: p.grad.clone() for n, p in model.named_parameters()}))
        opt.step()
    return out


def compiled_reference(explicit: bool) -> list[tuple[torch.Tensor, dict[str, torch.Tensor]]]:
    """One process, no CP: the steps of :func:`compiled_steps_case` with plain SDPA."""
    torch.manual_seed(0)
    model = SelfAttentionOnly() if explicit else TinyAttention(16, 4, 2)
    x, memory = _compile_inputs()

    def step() -> tuple[torch.Tensor, torch.Tensor]:
        y = model(x, memory)
        return y.detach(), y.pow(2).sum() / y.numel()

    return _sgd_steps(model, step)


def compiled_steps_case(
    cp_mesh: DeviceMesh, method: str, fullgraph: bool, explicit: bool = False
) -> list[tuple[torch.Tensor, dict[str, torch.Tensor]]]:
    """``torch.compile`` of a model under ``ctx()``: its first compiled step and two later ones
    (SGD between them), the gathered output and the CP-summed parameter grads of each step.

    ``explicit``: the model calls ``cp_attention`` (default ``"auto"``) instead of SDPA, first
    met inside the compiled region (nothing planned eagerly before).
    """
    import torch._dynamo

    from cpshard import make_cp_batch_and_ctx

    torch._dynamo.reset()
    torch.manual_seed(0)
    x, memory = _compile_inputs()
    ctx, batch, sharder = make_cp_batch_and_ctx(
        cp_mesh, {"inputs_embeds": x}, attention=method, layout="round_robin"
    )
    model = SelfAttentionOnly(sharder) if explicit else TinyAttention(16, 4, 2)
    fn = torch.compile(model, fullgraph=fullgraph, dynamic=False)
    xl = batch["inputs_embeds"]

    def step() -> tuple[torch.Tensor, torch.Tensor]:
        with ctx():
            y = fn(xl, memory)
        # the mean over the global tokens: each rank's sum over its own, divided by the total
        return sharder.gather_token_tensor(y.detach(), trim=True), y.pow(2).sum() / x.numel()

    return _sgd_steps(model, step, cp_group(cp_mesh))
