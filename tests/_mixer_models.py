"""Tiny fp64 hybrid causal LMs of the installed transformers (random init, no download).

Each builder returns a model whose token mixers outside attention (Mamba / Mamba2 mixers, Gated
DeltaNet, short convolutions, RG-LRU) run their pure-torch path on CPU. Sizes are the smallest each
config's validation accepts; ``use_cache=False`` so a plain forward keeps no state.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["HYBRIDS", "native_served", "tiny_hybrid"]

_SMALL = {
    "vocab_size": 64, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "use_cache": False,
}  # fmt: skip
_MAMBA2_HEADS = {
    "mamba_d_state": 4, "mamba_n_heads": 8, "mamba_d_head": 8, "mamba_n_groups": 1,
    "mamba_chunk_size": 4, "mamba_d_conv": 4, "mamba_expand": 2,
}  # fmt: skip

# name -> (config class name, model class name, config kwargs)
_SPECS: dict[str, tuple[str, str, dict[str, Any]]] = {
    "mamba": ("MambaConfig", "MambaForCausalLM", {
        "vocab_size": 64, "hidden_size": 16, "state_size": 4, "num_hidden_layers": 2,
        "expand": 2, "conv_kernel": 4, "time_step_rank": 4, "use_cache": False}),
    "mamba2": ("Mamba2Config", "Mamba2ForCausalLM", {
        "vocab_size": 64, "hidden_size": 16, "state_size": 4, "num_hidden_layers": 2,
        "expand": 2, "num_heads": 4, "head_dim": 8, "n_groups": 2, "chunk_size": 4,
        "conv_kernel": 4, "use_cache": False}),
    "qwen3_next": ("Qwen3NextConfig", "Qwen3NextForCausalLM", {
        **_SMALL, "head_dim": 8, "linear_num_key_heads": 2, "linear_num_value_heads": 4,
        "linear_key_head_dim": 8, "linear_value_head_dim": 8, "num_experts": 4,
        "num_experts_per_tok": 2, "moe_intermediate_size": 16,
        "shared_expert_intermediate_size": 16,
        "layer_types": ["linear_attention", "full_attention"]}),
    "qwen3_5": ("Qwen3_5TextConfig", "Qwen3_5ForCausalLM", {
        **_SMALL, "head_dim": 8, "linear_num_key_heads": 2, "linear_num_value_heads": 4,
        "linear_key_head_dim": 8, "linear_value_head_dim": 8,
        "layer_types": ["linear_attention", "full_attention"]}),
    "jamba": ("JambaConfig", "JambaForCausalLM", {
        **_SMALL, "mamba_d_state": 4, "mamba_d_conv": 4, "mamba_expand": 2, "mamba_dt_rank": 4,
        "attn_layer_period": 2, "attn_layer_offset": 1, "num_experts": 2,
        "expert_layer_period": 2, "expert_layer_offset": 1}),
    "falcon_h1": ("FalconH1Config", "FalconH1ForCausalLM", {
        **_SMALL, **_MAMBA2_HEADS, "head_dim": 8, "mamba_d_ssm": None}),
    "lfm2": ("Lfm2Config", "Lfm2ForCausalLM", {
        **_SMALL, "layer_types": ["conv", "full_attention"]}),
    "granitemoehybrid": ("GraniteMoeHybridConfig", "GraniteMoeHybridForCausalLM", {
        **_SMALL, **_MAMBA2_HEADS, "num_local_experts": 2, "num_experts_per_tok": 1,
        "layer_types": ["mamba", "attention"]}),
    "nemotron_h": ("NemotronHConfig", "NemotronHForCausalLM", {
        **_SMALL, "head_dim": 8, "ssm_state_size": 4, "mamba_num_heads": 4, "mamba_head_dim": 8,
        "n_groups": 1, "chunk_size": 4, "conv_kernel": 4, "expand": 2,
        "hybrid_override_pattern": "M*"}),
    # RG-LRU: reads position_ids (resets its state at position 0)
    "recurrent_gemma": ("RecurrentGemmaConfig", "RecurrentGemmaForCausalLM", {
        **_SMALL, "block_types": ["recurrent", "attention"]}),
    # a hybrid layer's Mamba layer also takes the shared transformer's output per token
    "zamba": ("ZambaConfig", "ZambaForCausalLM", {
        **_SMALL, "num_hidden_layers": 3, "n_mamba_heads": 2, "mamba_d_state": 4,
        "mamba_d_conv": 4, "mamba_expand": 2, "mamba_dt_rank": 4, "use_mamba_kernels": False,
        "layers_block_type": ["linear_attention", "hybrid", "hybrid"]}),
}  # fmt: skip

HYBRIDS = tuple(_SPECS)
# Gated DeltaNet models whose decay is made slow (per-token exp(g) ~ 0.97-0.997), so that the
# state handed across CP ranks changes the outputs visibly
_SLOW_DECAY = ("qwen3_next", "qwen3_5")


def tiny_hybrid(name: str) -> Any:
    """A tiny random-init hybrid causal LM in fp64 (fixed seed), eval mode (no dropout).

    Raises:
        pytest.skip.Exception: the installed transformers lacks the architecture.
    """
    import pytest
    import transformers as tf

    config_name, model_name, kwargs = _SPECS[name]
    if not hasattr(tf, config_name) or not hasattr(tf, model_name):
        pytest.skip(f"transformers {tf.__version__} has no {model_name}")
    cfg = getattr(tf, config_name)(**kwargs, experts_implementation="eager")
    torch.manual_seed(0)
    model: Any = getattr(tf, model_name)(cfg).to(torch.float64).eval()
    if name in _SLOW_DECAY:  # the default init forgets within a few tokens: keep a long memory
        with torch.no_grad():
            for module in model.modules():
                if isinstance(getattr(module, "A_log", None), torch.nn.Parameter):
                    heads = module.A_log.shape[0]
                    module.A_log.copy_(torch.linspace(0.01, 0.1, heads).log())
                    module.dt_bias.fill_(-1.0)
    return model


def native_served(arch: str) -> bool:
    """Whether cpshard's native CP path serves every token mixer of ``arch`` here.

    The product's own verdict (:func:`cpshard.mixers.check_token_mixers` at cp=2 on dense rows):
    the native Mamba2 / Gated DeltaNet paths serve only the transformers sources they were
    verified against (another transformers version takes the generic exact path, with a
    :class:`~cpshard.mixers.CPMixerWarning`, and ``strict=True`` refuses it).
    """
    import warnings

    from cpshard.mixers import CPMixerWarning, check_token_mixers

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", CPMixerWarning)
        plan = check_token_mixers(tiny_hybrid(arch), 2, strict=False, packed=False)
    return bool(plan.sites) and plan.native == plan.sites
