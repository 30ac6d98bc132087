"""The rows of a ``cpshard parity`` run: which (model, dtype, batch, layout, method) to check.

Rows come from one table, :data:`cpshard.parity.models.MODELS`: a model with ``layouts``
gets one row per (layout, method) with the batch kind its layout needs (dense rows for
``round_robin`` and ``contiguous``, packed rows for ``balanced`` and ``packed``); a model that
owns its CP layout (``layouts=None``) gets one row per method on each of its batch kinds, or a
single row when its attention is its own (``attention="own"``: no CP attention method applies).
Before the CP rows of a (model, dtype, batch kind), one ``reference`` row checks the cp=1
reference against the model's own attention, when the model has such a check.

Import rules: the rows of ``RULES`` in tests/unit/test_architecture.py that cover this module.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Literal

from cpshard.names import DENSE_LAYOUTS, PACKED_LAYOUTS
from cpshard.parity.runs import HEADS, KV_HEADS, MODELS, ParityCase

__all__ = ["LAYOUT_BATCH", "Row", "plan_rows"]

LAYOUT_BATCH: dict[str, str] = {
    **dict.fromkeys(DENSE_LAYOUTS, "dense"),
    **dict.fromkeys(PACKED_LAYOUTS, "packed"),
}
AUTO_LAYOUT = "auto"  # rows whose layout the model's hook (or else the dispatcher) chooses
OWN_ATTENTION = "own"  # the method column of rows whose model needs no CP attention method


@dataclass(frozen=True)
class Row:
    """One line of the parity table.

    Attributes:
        kind: ``"cp"`` (cp=N against the cp=1 reference) or ``"reference"`` (the cp=1
            reference against the model's own attention, one process).
        case: What to run (for ``"reference"`` rows: the cp=1 case).
        layout: The requested layout name (``"auto"`` for models whose hook or the dispatcher
            chooses, ``"none"`` for reference rows).
        skip: Why the row is not run (e.g. heads not divisible for Ulysses), else ``None``.
    """

    kind: Literal["cp", "reference"]
    case: ParityCase
    layout: str
    skip: str | None = None

    @property
    def ref_key(self) -> ParityCase:
        """The cp=1 case this row is compared with (shared by rows of one model/dtype/batch)."""
        return replace(self.case, layout="auto", method="all_gather")


def _ulysses_skip(method: str, world: int) -> str | None:
    if method == OWN_ATTENTION:
        return None
    if method == "ulysses" and (HEADS % world or KV_HEADS % world):
        return f"skipped: heads {HEADS}/{KV_HEADS} not divisible by {world} ranks"
    return None


def plan_rows(
    base: ParityCase,
    *,
    models: list[str],
    dtypes: list[str],
    layouts: list[str],
    methods: list[str],
    world: int,
    one_row: frozenset[str] = frozenset(),
) -> list[Row]:
    """Every row of a run, in table order (model, dtype, batch kind, layout, method).

    Args:
        base: Sizes, steps, seed, grad sync and device shared by every row.
        models: Keys of :data:`cpshard.parity.models.MODELS`.
        dtypes: ``float32``, ``float64``, ``bfloat16``.
        layouts: cpshard layouts for models that do not own theirs.
        methods: Attention methods.
        world: CP size of the cp=N side.
        one_row: Models that get only their first dtype, batch kind, layout and method (the
            demo's model-owned and pre-embedding rows beside the HF rows).
    """
    rows: list[Row] = []
    for model in models:
        spec = MODELS[model]
        for dtype in dtypes:
            for batch in spec.batches:
                mine = (
                    [AUTO_LAYOUT]
                    if spec.layouts is None
                    else [
                        lay for lay in layouts if lay in spec.layouts and LAYOUT_BATCH[lay] == batch
                    ]
                )
                if not mine:
                    continue
                case = replace(base, model=model, dtype=dtype, batch=batch)
                if spec.native_loss is not None:
                    rows.append(Row("reference", replace(case, layout="auto"), "none"))
                mine_methods = [OWN_ATTENTION] if spec.attention == "own" else methods
                if model in one_row:
                    mine, mine_methods = mine[:1], mine_methods[:1]
                for layout in mine:
                    for method in mine_methods:
                        lay = "auto" if layout == AUTO_LAYOUT else layout
                        rows.append(
                            Row(
                                "cp",
                                replace(case, layout=lay, method=method),  # type: ignore[arg-type]
                                layout,
                                _ulysses_skip(method, world),
                            )
                        )
                if model in one_row:
                    break
            if model in one_row:
                break
    return rows
