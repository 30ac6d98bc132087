"""The names of the CP layouts and attention methods, defined once.

Owns: :data:`LayoutName` / :data:`LAYOUT_NAMES` (what ``make_cp_batch_and_ctx(layout=...)``
accepts), :data:`DENSE_LAYOUTS` / :data:`PACKED_LAYOUTS` (the concrete layouts per batch kind,
in display order), :data:`AttentionMethod` / :data:`METHOD_NAMES` (the concrete attention methods)
and :data:`AttentionChoice` / :data:`ATTENTION_CHOICES` (those plus ``"auto"``). The dispatcher, the
attention entry point and the CLI import them from here.

Import rules: the rows of ``RULES`` in tests/unit/test_architecture.py that cover this module.

Note: ``round_robin`` is torch's head-tail layout (Megatron's DualChunkSwap, zigzag) -- rank ``r``
holds chunks ``r`` and ``2 * cp - 1 - r`` of ``2 * cp`` -- not the striped layout the name
suggests (token ``t`` on rank ``t % cp``); no striped layout exists here.
"""

from __future__ import annotations

from typing import Literal, get_args

__all__ = [
    "ATTENTION_CHOICES",
    "COMPILED_FROM_2_13",
    "DENSE_LAYOUTS",
    "LAYOUT_NAMES",
    "METHOD_NAMES",
    "PACKED_LAYOUTS",
    "AttentionChoice",
    "AttentionMethod",
    "LayoutName",
]

# "round_robin" is head-tail (chunks r and 2C-1-r), not striped: see the module docstring.
LayoutName = Literal["auto", "none", "contiguous", "round_robin", "packed", "balanced"]
LAYOUT_NAMES: tuple[LayoutName, ...] = get_args(LayoutName)
DENSE_LAYOUTS: tuple[LayoutName, ...] = ("round_robin", "contiguous")
PACKED_LAYOUTS: tuple[LayoutName, ...] = ("packed", "balanced")

AttentionMethod = Literal["all_gather", "ring", "ulysses", "selective"]
METHOD_NAMES: tuple[AttentionMethod, ...] = get_args(AttentionMethod)
"""The concrete CP attention methods (one strategy object each in ``cpshard.attention.methods``)."""

COMPILED_FROM_2_13: tuple[AttentionMethod, ...] = ("all_gather", "ring", "selective")
"""Methods :func:`cpshard.attention.core.cp_sdpa` refuses inside ``torch.compile`` on torch < 2.13.
all_gather and selective (one K/V exchange before their kernels, the K/V gradients in one after)
gave wrong compiled gradients on 2.11; the ring runs traced collectives under compile too (an
uneven all-to-all per hop, ``cpshard._comm.ring_shift_start``), checked exact on 2.13 only."""

AttentionChoice = Literal["auto", "all_gather", "ring", "ulysses", "selective"]
ATTENTION_CHOICES: tuple[AttentionChoice, ...] = get_args(AttentionChoice)
"""What ``attention=`` / ``method=`` accept: ``"auto"`` (the cheapest method by the cost model of
``cpshard.attention.cost``, per batch) or one of :data:`METHOD_NAMES`."""
