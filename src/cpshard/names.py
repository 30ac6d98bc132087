"""The names of the CP layouts and attention methods, defined once.

Owns: :data:`LayoutName` / :data:`LAYOUT_NAMES` (what ``make_cp_batch_and_ctx(layout=...)``
accepts), :data:`DENSE_LAYOUTS` / :data:`PACKED_LAYOUTS` (the concrete layouts per batch kind,
in display order) and :data:`AttentionMethod` / :data:`METHOD_NAMES`. The dispatcher, the
attention entry point and the CLI import them from here.

Must not import anything: it is a leaf every other module may depend on.

Note: ``round_robin`` is the head-tail (zigzag) layout -- rank ``r`` holds chunks ``r`` and
``2 * cp - 1 - r`` -- not a striped one.
"""

from __future__ import annotations

from typing import Literal, get_args

__all__ = [
    "DENSE_LAYOUTS",
    "LAYOUT_NAMES",
    "METHOD_NAMES",
    "PACKED_LAYOUTS",
    "AttentionMethod",
    "LayoutName",
]

LayoutName = Literal["auto", "none", "contiguous", "round_robin", "packed", "balanced"]
LAYOUT_NAMES: tuple[LayoutName, ...] = get_args(LayoutName)
DENSE_LAYOUTS: tuple[LayoutName, ...] = ("round_robin", "contiguous")
PACKED_LAYOUTS: tuple[LayoutName, ...] = ("packed", "balanced")

AttentionMethod = Literal["all_gather", "ring", "ulysses"]
METHOD_NAMES: tuple[AttentionMethod, ...] = get_args(AttentionMethod)
