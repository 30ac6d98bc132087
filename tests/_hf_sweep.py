"""The HF architecture sweep: every causal LM of the installed transformers, CP vs one process.

The architectures come from ``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES`` (so a transformers update adds
its new ones); each is built from its config class with hidden sizes, layers, heads, experts and
vocabulary shrunk generically (random init, fixed seed, fp64, no download; a causal LM that
declares the text part of a composite config is built from that part; per-layer type lists keep
one layer of every kind, so a hybrid keeps a mixer and an attention layer). One training step
(logits and every parameter gradient of ``sum(logits * R)``, ``R`` fixed) runs under CP and is
compared with one process running the model's own (eager) attention over the whole sequence; a
packed batch is compared with each document run alone.

Outcomes of one case: ``exact`` (logits and gradients within :data:`REL_TOL` of the reference),
``refused`` (CP raised a clear ``ValueError`` before the step), ``wrong`` (numbers differ),
``crash`` (any other exception under CP, or a ``ValueError`` raised in the middle of the
forward, which leaves the ranks out of step and the mesh unusable), ``skip`` (the model
cannot be built tiny, or its own reference step fails: nothing to compare).

Used by ``tests/multirank/test_hf_sweep.py`` and ``benchmarks/hf_sweep.py``.
"""

from __future__ import annotations

import copy
import traceback
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.device_mesh import DeviceMesh

import cpshard
from cpshard.guards.step import step_state

__all__ = [
    "CASES",
    "DEFAULT_ARCHS",
    "MIXER_ARCHS",
    "REL_TOL",
    "Outcome",
    "causal_lm_archs",
    "has_non_attention_mixer",
    "sweep_case",
    "tiny_model",
]

REL_TOL = 1e-5
"""Max |cp - ref| / max(1, max |ref|): fp64 runs differ by <= ~1e-7 (HF's float32 casts in
softmax, RMSNorm and routers round both sides), real errors are >= 1e-4."""

SEQ = 13
PACK = [[5, 8]]
VOCAB = 96

# (name, world, method, layout)
CASES = (
    ("ring2", 2, "ring", "round_robin"),
    ("allgather3", 3, "all_gather", "round_robin"),
    ("balanced2", 2, "all_gather", "balanced"),
)

DEFAULT_ARCHS = (
    "llama", "qwen3", "qwen3_moe", "mistral", "gemma2", "phi3", "gpt_oss", "llama4_text",
    "bloom", "jamba",
)  # fmt: skip
"""The representative subset of the default suite (dense, MoE, windows, soft-cap, fused qkv,
sinks, chunks + NoPE, one refused off-interface architecture, one hybrid)."""

MIXER_ARCHS: tuple[str, ...] = ()  # filled lazily by has_non_attention_mixer


@dataclass(frozen=True)
class Outcome:
    """One case's verdict.

    Attributes:
        kind: ``exact``, ``refused``, ``wrong``, ``crash`` or ``skip``.
        detail: Error text or the measured relative errors.
    """

    kind: str
    detail: str = ""


def causal_lm_archs() -> list[str]:
    """Every model type of transformers' causal-LM auto mapping, sorted."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


_SIZES = {
    # width-like
    "hidden_size": 32, "d_model": 32, "n_embd": 32, "n_embed": 32, "embed_dim": 32,
    "dim": 32, "hidden_dim": 32, "word_embed_proj_dim": 32,
    # ffn-like
    "intermediate_size": 48, "ffn_dim": 48, "n_inner": 48, "d_ff": 48, "ffn_hidden_size": 48,
    "moe_intermediate_size": 24, "shared_expert_intermediate_size": 24,
    "decoder_ffn_dim": 48, "encoder_ffn_dim": 48, "expert_intermediate_size": 24,
    # depth
    "num_hidden_layers": 2, "n_layer": 2, "num_layers": 2, "n_layers": 2, "decoder_layers": 2,
    "encoder_layers": 2,
    # heads
    "num_attention_heads": 4, "n_head": 4, "n_heads": 4, "num_heads": 4,
    "decoder_attention_heads": 4, "encoder_attention_heads": 4,
    "num_key_value_heads": 2, "head_dim": 8, "kv_channels": 8, "qk_nope_head_dim": 8,
    "qk_rope_head_dim": 8, "v_head_dim": 8, "q_lora_rank": 16, "kv_lora_rank": 16,
    # experts
    "num_experts": 4, "num_local_experts": 4, "n_routed_experts": 4, "moe_num_experts": 4,
    "num_experts_per_tok": 2, "num_experts_per_token": 2, "moe_topk": 2, "moe_k": 2,
    "rotary_dim": 8, "top_k": 2,
    "n_group": 1, "num_expert_group": 1, "topk_group": 1,
    "n_shared_experts": 1, "num_shared_experts": 1,
    # vocab / positions
    "vocab_size": VOCAB, "max_position_embeddings": 64, "n_positions": 64, "n_ctx": 64,
    # sequence mixers
    "state_size": 8, "mamba_d_state": 8, "ssm_state_size": 8, "mamba_n_heads": 8,
    "mamba_d_head": 8, "mamba_head_dim": 8, "linear_num_key_heads": 2, "linear_num_value_heads": 4,
    "linear_key_head_dim": 8, "linear_value_head_dim": 8, "linear_num_heads": 4,
    "linear_head_dim": 8, "chunk_size": 4,
    # sparse-attention indexers (DSA): a top-k below the sequence length, so it selects
    "index_head_dim": 16, "index_n_heads": 2, "index_topk": 4,
}  # fmt: skip

_DROPOUT_HINT = ("dropout", "drop_rate", "pdrop")


def _shrink(defaults: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in defaults.items():
        if isinstance(value, bool):
            continue
        if key in _SIZES and isinstance(value, int) and value > 0:
            out[key] = min(value, _SIZES[key]) if key != "head_dim" else _SIZES[key]
        elif any(h in key for h in _DROPOUT_HINT) and isinstance(value, float):
            out[key] = 0.0
        elif "vocab_size" in key and isinstance(value, int) and value > VOCAB:
            out[key] = VOCAB  # e.g. per-layer input vocabularies (Gemma 4): memory
        elif key.endswith("_token_id") and isinstance(value, int) and value >= VOCAB:
            out[key] = VOCAB - 1
    _fit_mamba_heads(defaults, out)
    if "kv_lora_rank" in defaults:  # multi-head latent attention: one kv head per head
        out["num_key_value_heads"] = out.get("num_attention_heads", 4)
        if "qk_head_dim" in defaults:
            out["qk_head_dim"] = out["qk_nope_head_dim"] + out["qk_rope_head_dim"]
        if "head_dim" in defaults:
            out["head_dim"] = out["qk_rope_head_dim"]
    out["use_cache"] = False
    return out


def _fit_mamba_heads(defaults: dict[str, Any], out: dict[str, Any]) -> None:
    """Mamba-2 mixers: heads x head width must equal the (shrunk) inner width, as validators ask.

    The head count follows from the shrunk widths (``expand * hidden`` or an explicit inner
    width), so the tiny mixer keeps several heads and its groups divide them.
    """
    hidden = out.get("hidden_size")
    if not isinstance(hidden, int):
        return
    if all(k in defaults for k in ("expand", "num_heads", "head_dim")):  # Mamba2Config
        expand = defaults["expand"]
        if isinstance(expand, int) and (hidden * expand) % out["head_dim"] == 0:
            out["num_heads"] = hidden * expand // out["head_dim"]
            groups = defaults.get("n_groups")
            if isinstance(groups, int) and out["num_heads"] % groups:
                out["n_groups"] = 2 if out["num_heads"] % 2 == 0 else 1
    if isinstance(defaults.get("mamba_d_ssm"), int) and "mamba_d_head" in out:  # Falcon-H1
        out["mamba_d_ssm"] = out["mamba_n_heads"] * out["mamba_d_head"]


_LAYER_LISTS = ("layer_types", "layers_block_type", "block_types", "mlp_layer_types")


def _cover_layer_types(config_cls: type, defaults: dict[str, Any], out: dict[str, Any]) -> None:
    """Per-layer type lists cut to the tiny depth, keeping one layer of every type.

    A plain prefix of a hybrid's list is often all one kind (Qwen3.5: three linear layers
    before the first full one), which would leave the attention layer (or the mixer) out of
    the sweep. The first layer of each kind is kept, in order, then the earliest others.
    """
    n = out.get("num_hidden_layers")
    for key in _LAYER_LISTS:
        types = defaults.get(key)
        if not isinstance(n, int) or not isinstance(types, list | tuple) or len(types) <= n:
            continue
        if isinstance(getattr(config_cls, key, None), property):
            continue  # derived from other fields
        firsts = [types.index(t) for t in dict.fromkeys(types)]
        keep = sorted(firsts[:n])
        keep += [i for i in range(len(types)) if i not in keep][: n - len(keep)]
        out[key] = [types[i] for i in sorted(keep)]


def _text_config(config: Any) -> Any:
    get = getattr(config, "get_text_config", None)
    return get() if callable(get) else config


def tiny_model(arch: str) -> Any:
    """The tiny fp64 causal LM of ``arch`` in eval-free training mode (seeded; raises if not)."""
    import transformers as tf
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    config_cls = CONFIG_MAPPING[arch]
    model_cls = getattr(tf, MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[arch])
    base = config_cls()
    text = _text_config(base)
    declared = getattr(model_cls, "config_class", None)
    if text is not base and isinstance(declared, type) and isinstance(text, declared):
        # the causal LM takes the text config of a composite one (Qwen3.5): build just that
        config_cls, base = type(text), text
    kwargs = _shrink(text.to_dict())
    _cover_layer_types(type(text), text.to_dict(), kwargs)
    extra = _SPECIAL.get(arch, {})
    if text is base:
        config = config_cls(**{**kwargs, **extra, **_IMPLS})
    else:  # a composite config: shrink its text part
        key = next(k for k in base.sub_configs if getattr(base, k) is text)
        sub = type(text)(**{**kwargs, **extra})
        config = config_cls(**{key: sub, **_IMPLS})
    _fix_layer_types(_text_config(config))
    with torch.device("meta"):  # sized first: a config the shrinking missed would swap or OOM
        size = sum(p.numel() for p in model_cls(config).parameters())
    if size > MAX_PARAMS:
        raise RuntimeError(
            f"{arch} is still {size / 1e6:.0f}M parameters after shrinking (towers or tables the "
            f"builder does not shrink); the sweep skips models over {MAX_PARAMS / 1e6:.0f}M"
        )
    torch.manual_seed(0)
    model = model_cls(config).to(torch.float64)
    # Stochastic training-mode layers draw other random numbers per rank under CP (other shapes,
    # other order): their statistics match one process, their values cannot. Compared in eval.
    model.train(arch not in _SAMPLED_IN_TRAINING)
    return model


MAX_PARAMS = 120_000_000

# PhiMoE samples its experts (Gumbel, sparsemixer) in training mode.
_SAMPLED_IN_TRAINING = frozenset({"phimoe"})


_IMPLS = {"attn_implementation": "eager", "experts_implementation": "eager"}


def _fix_layer_types(config: Any) -> None:
    n = getattr(config, "num_hidden_layers", None)
    for key in ("layer_types", "layers_block_type", "no_rope_layers"):
        types = getattr(config, key, None)
        if isinstance(n, int) and isinstance(types, list) and len(types) > n:
            setattr(config, key, types[:n])


_QSA = {
    "indexer_n_heads": 2, "indexer_kv_heads": 1, "indexer_head_dim": 8, "indexer_budget": 4,
    "indexer_compress_ratio": 2,
}  # fmt: skip

# Per-architecture fields so the tiny model exercises the feature CP must honour.
_SPECIAL: dict[str, dict[str, Any]] = {
    "mistral": {"sliding_window": 3},
    "gemma2": {"sliding_window": 3, "attn_logit_softcapping": 2.0, "initializer_range": 0.5},
    "gpt_oss": {"sliding_window": 3, "initializer_range": 0.5},
    "llama4_text": {
        "attention_chunk_size": 4, "no_rope_layers": [1, 0], "floor_scale": 3,
        "attn_temperature_tuning": True, "interleave_moe_layer_step": 1,
    },
    "llama4": {
        "attention_chunk_size": 4, "no_rope_layers": [1, 0], "floor_scale": 3,
        "attn_temperature_tuning": True, "interleave_moe_layer_step": 1,
    },
    # Qwen4-Exp's indexed-attention layer (kept beside the linear one) needs its QSA indexer
    "qwen4_exp": _QSA,
    "qwen4_exp_text": _QSA,
    # Zamba ties its shared transformer from the first hybrid layer to the others: two of them
    "zamba": {
        "num_hidden_layers": 3, "layers_block_type": ["linear_attention", "hybrid", "hybrid"],
    },
    # LFM2-MoE has no default layer list (the model indexes it): one conv, one attention layer;
    # one dense layer first, so the second one is MoE
    "lfm2_moe": {"layer_types": ["conv", "full_attention"], "num_dense_layers": 1},
}  # fmt: skip


def has_non_attention_mixer(model: Any) -> bool:
    """Whether the model mixes tokens outside attention (SSM, linear attention, convolution...).

    Config facts (``layer_types`` / ``layers_block_type`` entries that are not attention) and
    module structure (a ``Conv1d`` over the sequence or a scan module). Such architectures
    depend on ``cpshard.mixers`` to be exact (or refused clearly).
    """
    config = _text_config(model.config)
    for key in ("layer_types", "layers_block_type"):
        for t in getattr(config, key, None) or ():
            if (isinstance(t, str) and "attention" not in t) or t in ("linear_attention",):
                return True
    for m in model.modules():
        name = type(m).__name__
        if isinstance(m, torch.nn.Conv1d) or any(
            w in name for w in ("Mamba", "Mixer", "DeltaNet", "ShortConv", "Rwkv", "RWKV",
                                "Recurrent", "LSTM", "Lightning", "Linear" + "Attention")
        ):  # fmt: skip
            return True
    return False


def _batch(packed: bool) -> dict[str, Any]:
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(1, VOCAB, (1, SEQ), generator=g)
    batch: dict[str, Any] = {"input_ids": ids}
    if packed:
        batch["seq_lens"] = PACK
    return batch


def _weights() -> torch.Tensor:
    g = torch.Generator().manual_seed(11)
    return torch.randn(1, SEQ, VOCAB, generator=g, dtype=torch.float64)


def _logits(out: Any) -> torch.Tensor:
    t = out.logits if hasattr(out, "logits") else out[0]
    return t[..., :VOCAB]


def _reference(model: Any, packed: bool) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    ids = _batch(packed)["input_ids"]
    r = _weights()
    model.zero_grad(set_to_none=True)
    if packed:
        parts, start = [], 0
        for n in PACK[0]:
            parts.append(_logits(model(input_ids=ids[:, start : start + n], use_cache=False)))
            start += n
        logits = torch.cat(parts, dim=1)
    else:
        logits = _logits(model(input_ids=ids, use_cache=False))
    (logits * r).sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return logits.detach(), grads


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    scale = max(1.0, float(b.abs().max())) if b.numel() else 1.0
    return float((a - b).abs().max()) / scale if b.numel() else 0.0


def _fresh_mesh(cp_mesh: DeviceMesh | None) -> DeviceMesh | None:
    """A new mesh object over the same group: a refusal raised inside a model's forward after
    its first CP attention call leaves that mesh object unusable by design (this rank cannot tell
    whether its peers wait in the next collective; ``cpshard.guards.step``). Every rank of a
    sweep case raises at the same point, so the group itself is in step for the next case.
    ``None`` (cp=1, one process: no group, no step record) stays ``None``."""
    if cp_mesh is None:
        return None
    group = cp_mesh.get_group()
    return DeviceMesh.from_group(group, cp_mesh.device_type, mesh_dim_names=cp_mesh.mesh_dim_names)


def sweep_case(cp_mesh: DeviceMesh | None, arch: str, method: str, layout: str) -> Outcome:
    """One architecture, one CP case, on every rank (the same verdict on every rank)."""
    cp_mesh = _fresh_mesh(cp_mesh)
    try:
        model = tiny_model(arch)
        ref_model = copy.deepcopy(model)
        want_logits, want_grads = _reference(ref_model, layout == "balanced")
    except Exception as e:
        return Outcome("skip", f"{type(e).__name__}: {e}"[:300])
    packed = layout == "balanced"
    batch = _batch(packed)
    try:
        ctx, local, sharder = cpshard.prepare_cp_forward(
            model, cp_mesh, batch, layout=layout, attention=method, padding_token_id=0
        )
        r_local = sharder.shard_token_tensor(_weights(), fill=0.0)
        with ctx():
            out = model(
                input_ids=local["input_ids"], position_ids=local["position_ids"], use_cache=False
            )
        logits = _logits(out)
        (logits * r_local).sum().backward()
        cpshard.loss.sync_grads(model, cp_mesh)
        got_logits = sharder.gather_token_tensor(logits.detach().contiguous(), trim=True, fill=0.0)
    except ValueError as e:
        state = step_state(cp_mesh)
        if state is not None and state.broken is not None:  # raised after collectives ran
            what = "ValueError in the middle of the CP forward (ranks out of step)"
            return Outcome("crash", f"{what}: {e}"[:800])
        return Outcome("refused", str(e)[:400])
    except Exception as e:
        tb = traceback.format_exc(limit=-3)
        return Outcome("crash", f"{type(e).__name__}: {e}\n{tb}"[:800])
    errs = {"logits": _rel(got_logits, want_logits)}
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    if set(grads) != set(want_grads):
        return Outcome("wrong", f"gradient sets differ: {sorted(set(grads) ^ set(want_grads))}")
    errs["grads"] = max((_rel(grads[n], want_grads[n]) for n in grads), default=0.0)
    detail = f"logits {errs['logits']:.1e}, grads {errs['grads']:.1e}"
    if max(errs.values()) > REL_TOL:
        return Outcome("wrong", detail)
    return Outcome("exact", detail)
