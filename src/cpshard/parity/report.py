"""What ``cpshard parity`` reports: a :class:`Record` per row, as Markdown, JSON and a plot.

JSON (``--json PATH``) is a list of records (``Record`` fields, ``dataclasses.asdict``):

* identity: ``kind`` (``"cp"`` or ``"reference"``), ``model``, ``dtype``, ``batch``, ``layout``
  (requested), ``sharder_layout`` (the label the sharder reported), ``method``, ``world`` (ranks of
  the checked side), ``steps``, ``grad_sync``, ``launcher``, ``backend``, ``device``;
* numbers: ``losses`` (checked side, per step), ``ref_losses`` (reference, per step),
  ``abs_dloss`` / ``rel_dloss`` / ``grad_errs`` (per step), ``max_abs_dloss``, ``max_rel_dloss``,
  ``grad_err`` (max over steps), ``tol_rel_dloss``, ``tol_grad_err``, ``local_tokens``;
* verdict: ``passed`` (``true``/``false``; ``null`` for a skipped row), ``skipped`` (reason or
  ``null``), ``error`` (a rank's failure, or ``null``);
* cost: ``seconds`` (wall time of the checked side), ``peak_mem_mb`` (one value per rank),
  ``peak_mem_kind`` (``cuda_max_allocated`` or ``cpu_peak_rss``).

For a ``reference`` row the checked side is the cp=1 reference (``world`` 1) and the reference is
the model's own attention without cpshard (``method`` ``"native"``).

Import rules: the rows of ``RULES`` in tests/unit/test_architecture.py that cover this module.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["PLOT_FLOOR", "Record", "format_row", "table_header", "write_json", "write_plot"]

PLOT_FLOOR = 1e-10  # exact zeros are drawn here on the log axes


@dataclass
class Record:
    """One row of the parity table (see the module docstring for every field)."""

    kind: str
    model: str
    dtype: str
    batch: str
    layout: str
    method: str
    world: int
    steps: int
    grad_sync: str
    launcher: str
    backend: str
    device: str
    tol_rel_dloss: float
    tol_grad_err: float
    sharder_layout: str | None = None
    local_tokens: int | None = None
    losses: list[float] = field(default_factory=list)
    ref_losses: list[float] = field(default_factory=list)
    abs_dloss: list[float] = field(default_factory=list)
    rel_dloss: list[float] = field(default_factory=list)
    grad_errs: list[float] = field(default_factory=list)
    max_abs_dloss: float | None = None
    max_rel_dloss: float | None = None
    grad_err: float | None = None
    passed: bool | None = None
    skipped: str | None = None
    error: str | None = None
    seconds: float = 0.0
    peak_mem_mb: list[float] = field(default_factory=list)
    peak_mem_kind: str = ""


def table_header() -> list[str]:
    """The Markdown header lines of the parity table."""
    return [
        "| model | dtype | batch | layout | attention | ranks | local tokens | losses (checked) "
        "| max rel dloss | max grad err | s | ok |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]


def _losses(xs: list[float]) -> str:
    if len(xs) <= 4:
        return " ".join(f"{x:.4f}" for x in xs)
    return f"{xs[0]:.4f} .. {xs[-1]:.4f}"


def format_row(r: Record) -> str:
    """One Markdown table line for ``r``."""
    if r.kind == "reference":
        layout, method = "cp=1 vs native attention", "-"
    else:
        layout, method = r.sharder_layout or r.layout, r.method
    head = f"| {r.model} | {r.dtype} | {r.batch} | {layout} | {method} | {r.world} |"
    if r.skipped is not None:
        return f"{head} - | - | - | - | - | {r.skipped} |"
    if r.error is not None:
        return f"{head} - | - | - | - | {r.seconds:.1f} | ERROR (see below) |"
    assert r.max_rel_dloss is not None
    assert r.grad_err is not None
    ok = "yes" if r.passed else "NO"
    return (
        f"{head} {r.local_tokens} | {_losses(r.losses)} | {r.max_rel_dloss:.2e} | "
        f"{r.grad_err:.2e} | {r.seconds:.1f} | {ok} |"
    )


def _clean(x: Any) -> Any:
    """JSON has no NaN/inf: write them as null."""
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, list):
        return [_clean(v) for v in x]
    if isinstance(x, dict):
        return {k: _clean(v) for k, v in x.items()}
    return x


def write_json(path: str, records: list[Record]) -> None:
    """Write ``records`` as a JSON list (non-finite numbers become ``null``)."""
    data = [_clean(asdict(r)) for r in records]
    Path(path).write_text(json.dumps(data, indent=1) + "\n")


def _groups(records: list[Record]) -> dict[tuple[str, str, str], list[Record]]:
    out: dict[tuple[str, str, str], list[Record]] = {}
    for r in records:
        if r.kind == "cp" and r.skipped is None and r.error is None:
            out.setdefault((r.model, r.dtype, r.batch), []).append(r)
    return out


def write_plot(path: str, records: list[Record]) -> None:
    """One column per (model, dtype, batch kind): the loss curves of every cp=N row over the
    cp=1 reference, the relative ``|dloss|`` and the gradient error per step (log scale), with
    the tolerances as dashed lines.

    Args:
        path: Output image (``.png``, ``.svg``, ``.pdf``).
        records: The run's records (skipped and failed-to-run rows are left out).
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    groups = _groups(records)
    ncol = max(len(groups), 1)
    fig, axes = plt.subplots(3, ncol, figsize=(4.6 * ncol, 9.5), squeeze=False)
    styles = ["-", "--", ":", "-."]
    for col, ((model, dtype, batch), rows) in enumerate(groups.items()):
        ax_loss, ax_d, ax_g = axes[:, col]
        steps = list(range(1, len(rows[0].ref_losses) + 1))
        ax_loss.plot(steps, rows[0].ref_losses, color="black", linewidth=3, alpha=0.35)
        ax_loss.plot([], [], color="black", linewidth=3, alpha=0.35, label="cp=1 reference")
        layouts = sorted({r.layout for r in rows})
        methods = sorted({r.method for r in rows})
        for r in rows:
            color = f"C{methods.index(r.method) % 10}"
            ls = styles[layouts.index(r.layout) % len(styles)]
            label = f"{r.sharder_layout or r.layout} / {r.method}" + ("" if r.passed else " FAIL")
            marker = "o" if len(steps) <= 10 else None
            ax_loss.plot(
                steps,
                r.losses,
                color=color,
                linestyle=ls,
                linewidth=1,
                marker=marker,
                markersize=3,
                label=label,
            )
            ax_d.plot(steps, [max(v, PLOT_FLOOR) for v in r.rel_dloss], color=color, linestyle=ls)
            ax_g.plot(steps, [max(v, PLOT_FLOOR) for v in r.grad_errs], color=color, linestyle=ls)
        ax_d.axhline(rows[0].tol_rel_dloss, color="red", linestyle="--", linewidth=1)
        ax_g.axhline(rows[0].tol_grad_err, color="red", linestyle="--", linewidth=1)
        world = rows[0].world
        ax_loss.set_title(f"{model} {dtype} {batch}: cp={world} vs cp=1", fontsize=10)
        ax_loss.set_ylabel("loss")
        ax_loss.legend(fontsize=7, loc="upper right")
        ax_d.set_yscale("log")
        ax_d.set_ylabel("|dloss| / loss  (red: tolerance)")
        ax_g.set_yscale("log")
        ax_g.set_ylabel("max|dgrad| / max|grad|")
        ax_g.set_xlabel("step")
        for ax in (ax_loss, ax_d, ax_g):
            ax.grid(True, which="both", alpha=0.3)
            ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    if not groups:
        axes[0, 0].text(0.5, 0.5, "no cp rows ran", ha="center", va="center")
    fig.suptitle(
        f"cpshard parity: every row's cp=N run over the cp=1 reference "
        f"(exact zeros drawn at {PLOT_FLOOR:g})",
        fontsize=11,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
