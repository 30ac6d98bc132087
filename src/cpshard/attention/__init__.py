"""CP attention: every rank attends to the global sequence from its local shard.

Entry points: :func:`cp_sdpa` (explicit group and token meta), :func:`cp_attention` (reads a
sharder), :func:`cp_attention_context` (routes ``F.scaled_dot_product_attention`` calls of
plain PyTorch models), :func:`use_cp_attention` (HF transformers attention registry),
:func:`suspend` (exempt a region, e.g. a vision tower, from routing),
:func:`checkpoint_context_fn` (activation checkpointing under CP).

Owns CP attention: the per-batch plan (:mod:`.plan`, :mod:`.pieces`: which blocks of which
ranks meet), its execution (:mod:`.kernels`, :mod:`.cuda_kernels`, :mod:`.merge`,
:mod:`.softcap`, :mod:`.blockwise` and the four methods :mod:`.all_gather`, :mod:`.ring`,
:mod:`.ulysses`, :mod:`.selective` (with :mod:`.selective_plan` and the run counts of
:mod:`.visibility`), registered as strategy objects in
:mod:`.methods`), 2-D CP over a ``("cp_outer", "cp_inner")`` mesh (:mod:`.hybrid`: Ulysses
inside ``cp_inner`` x one of those methods across ``cp_outer``; :func:`cp_grid` gives
:func:`cp_sdpa` its ``grid``), the cost model of ``"auto"`` (:mod:`.cost`, :mod:`.auto`) and
the routing of model calls (:mod:`.context`, :mod:`.hf`, :mod:`.hf_options`).

Import rules: the rows of ``RULES`` in tests/unit/test_architecture.py that cover this module.
"""

from cpshard.attention.context import checkpoint_context_fn, cp_attention_context, suspend
from cpshard.attention.core import AttentionMethod, cp_attention, cp_sdpa
from cpshard.attention.hf import use_cp_attention
from cpshard.attention.hybrid import CPGrid, cp_grid

__all__ = [
    "AttentionMethod",
    "CPGrid",
    "checkpoint_context_fn",
    "cp_attention",
    "cp_attention_context",
    "cp_grid",
    "cp_sdpa",
    "suspend",
    "use_cp_attention",
]
