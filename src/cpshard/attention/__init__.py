"""CP attention: every rank attends to the global sequence from its local shard.

Entry points: :func:`cp_sdpa` (explicit group and token meta), :func:`cp_attention` (reads a
sharder), :func:`cp_attention_context` (routes ``F.scaled_dot_product_attention`` calls of
plain PyTorch models), :func:`use_cp_attention` (HF transformers attention registry),
:func:`suspend` (exempt a region, e.g. a vision tower, from routing),
:func:`checkpoint_context_fn` (activation checkpointing under CP).
"""

from cpshard.attention.context import checkpoint_context_fn, cp_attention_context, suspend
from cpshard.attention.core import AttentionMethod, cp_attention, cp_sdpa
from cpshard.attention.hf import use_cp_attention

__all__ = [
    "AttentionMethod",
    "checkpoint_context_fn",
    "cp_attention",
    "cp_attention_context",
    "cp_sdpa",
    "suspend",
    "use_cp_attention",
]
