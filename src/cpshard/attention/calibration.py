"""Calibrating the cost model of ``attention="auto"``: fit its rates to measured step times.

A :class:`Sample` is one measured grid point: a batch's :class:`~cpshard.attention.cost.PlanFacts`,
the call's :class:`~cpshard.attention.cost.CallShape` and the measured seconds of one layer's
forward + backward per method. :func:`fit_rates` finds the :class:`~cpshard.attention.cost.
CostModel` rates (compute rate, link bandwidth, latency, overlap) that make the modelled times
closest to the measured ones: least squares of ``log(predicted / measured)`` over every
(sample, method), by a pattern search in log space (the model is piecewise smooth: maxima over
ranks and overlaps, so no gradients). :func:`calibration_table` then compares, per sample and
method, predicted and measured, and per sample the method the model picks with the measured best;
:func:`format_table` prints it (``benchmarks/bench_auto_calibration.py`` runs the whole thing).

Oversubscribed machines: a sample's :attr:`Sample.share` (the share of a core each rank gets, e.g.
``cores / ranks`` when 4 ranks share 2 cores) scales the compute rate and the link bandwidth of the
model it is predicted with (:meth:`~cpshard.attention.cost.CostModel.scaled`: gloo moves bytes
with the same cores), so one set of rates serves every CP size of the grid.

Host only, numpy: never a collective.

Import rules: the rows of ``RULES`` in tests/unit/test_architecture.py that cover this module.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from cpshard.attention.cost import CallShape, CostModel, PlanFacts, choose_method, method_costs

__all__ = [
    "FIT_RATES",
    "PointRow",
    "Sample",
    "Summary",
    "TableRow",
    "calibration_table",
    "fit_rates",
    "format_table",
]

FIT_RATES = ("compute_rate", "link_bandwidth", "latency", "overlap")
"""The :class:`CostModel` fields :func:`fit_rates` may fit (``overlap`` linearly in ``[0, 1]``, the
others in log space)."""

_LATENCY_FLOOR = 1e-9  # seconds: latency is fitted in log space, so never exactly 0


@dataclass(frozen=True)
class Sample:
    """One measured grid point.

    Attributes:
        label: How the table names it (batch, S, C, heads).
        facts: The batch's plan facts for the call's mask.
        shape: The call.
        measured: Seconds of one layer's forward + backward per method (slowest rank); the
            methods measured are the candidates ``auto`` chooses among here.
        share: Share of a core each rank gets (1: a core or a GPU each).
    """

    label: str
    facts: PlanFacts
    shape: CallShape
    measured: Mapping[str, float]
    share: float = 1.0


def _predicted(sample: Sample, model: CostModel) -> dict[str, float]:
    return method_costs(sample.facts, sample.shape, model.scaled(sample.share))


def _encode(model: CostModel, free: Sequence[str]) -> np.ndarray:
    out = []
    for name in free:
        value = float(getattr(model, name))
        if name == "overlap":
            out.append(value)
        else:
            out.append(math.log(max(value, _LATENCY_FLOOR)))
    return np.asarray(out, dtype=np.float64)


def _decode(x: np.ndarray, model: CostModel, free: Sequence[str]) -> CostModel:
    values: dict[str, float] = {}
    for name, v in zip(free, x, strict=True):
        values[name] = min(max(float(v), 0.0), 1.0) if name == "overlap" else math.exp(float(v))
    out: CostModel = dataclasses.replace(model, **values)  # type: ignore[arg-type]
    return out


def _loss(samples: Sequence[Sample], model: CostModel) -> float:
    total = 0.0
    for s in samples:
        pred = _predicted(s, model)
        for m, t in s.measured.items():
            total += math.log(pred[m] / t) ** 2
    return total


def fit_rates(
    samples: Sequence[Sample],
    start: CostModel,
    free: Sequence[str] = FIT_RATES,
    *,
    tol: float = 1e-7,
    max_evals: int = 20000,
) -> CostModel:
    """The rates of ``free`` that fit ``samples`` best (least squares of log ratios).

    Args:
        samples: Measured grid points (every measured time > 0).
        start: Where the search starts; its other fields (heads, ...) are kept.
        free: The fields to fit, a subset of :data:`FIT_RATES`.
        tol: Stop when every step is below this (log units; ``overlap`` absolute).
        max_evals: Stop after this many evaluations of the loss.

    Returns:
        ``start`` with the fitted rates.

    Raises:
        ValueError: no sample, a time <= 0, or a field not in :data:`FIT_RATES`.
    """
    bad = [f for f in free if f not in FIT_RATES]
    if bad:
        raise ValueError(f"fit_rates can fit {FIT_RATES}, not {bad}")
    if not samples:
        raise ValueError("fit_rates needs at least one sample")
    for s in samples:
        if not s.measured or min(s.measured.values()) <= 0:
            raise ValueError(f"sample {s.label!r}: every measured time must be > 0")
    x = _encode(start, free)
    step = np.asarray([0.25 if f == "overlap" else 1.0 for f in free])
    best = _loss(samples, _decode(x, start, free))
    evals = 1
    while step.max() > tol and evals < max_evals:
        moved = False
        for i in range(x.size):
            for sign in (1.0, -1.0):
                y = x.copy()
                y[i] += sign * step[i]
                if free[i] == "overlap":
                    y[i] = min(max(y[i], 0.0), 1.0)
                loss = _loss(samples, _decode(y, start, free))
                evals += 1
                if loss < best:
                    x, best, moved = y, loss, True
                    step[i] *= 2.0  # a good direction: stride out along it
                    break
        if not moved:
            step /= 2.0
    return _decode(x, start, free)


@dataclass(frozen=True)
class TableRow:
    """One (sample, method) row: modelled and measured seconds."""

    label: str
    method: str
    predicted: float
    measured: float

    @property
    def ratio(self) -> float:
        """Predicted over measured."""
        return self.predicted / self.measured


@dataclass(frozen=True)
class PointRow:
    """One sample's decision: the method the model picks and the measured best.

    Attributes:
        label: The sample's label.
        chosen: The method :func:`~cpshard.attention.cost.choose_method` picks among the measured.
        best: The measured fastest (``chosen`` where it ties with it).
        slowdown: Measured time of ``chosen`` over that of ``best`` (1.0: the best was picked).
    """

    label: str
    chosen: str
    best: str
    slowdown: float


@dataclass(frozen=True)
class Summary:
    """The table's summary.

    Attributes:
        rows: (sample, method) rows.
        within: Share of the rows whose ratio is within ``1 +- tolerance``.
        points: Samples.
        picked_best: Share of the samples where the chosen method is the measured best.
        picked_near: Share where it is within ``near`` of the measured best (slowdown <= 1 +
            near).
        tolerance: The ratio tolerance.
        near: The slowdown tolerance.
    """

    rows: int
    within: float
    points: int
    picked_best: float
    picked_near: float
    tolerance: float
    near: float


def calibration_table(
    samples: Sequence[Sample],
    model: CostModel,
    *,
    tolerance: float = 0.15,
    near: float = 0.05,
) -> tuple[list[TableRow], list[PointRow], Summary]:
    """Predicted vs measured per (sample, method), the choice per sample, and the summary.

    Args:
        samples: Measured grid points.
        model: The rates to predict with (each sample's :attr:`Sample.share` applied).
        tolerance: A prediction counts as within when ``|predicted / measured - 1| <= tolerance``.
        near: A choice counts as near when its measured time is ``<= (1 + near)`` times the best.

    Returns:
        ``(rows, points, summary)``.
    """
    rows: list[TableRow] = []
    points: list[PointRow] = []
    for s in samples:
        pred = _predicted(s, model)
        for m, t in s.measured.items():
            rows.append(TableRow(s.label, m, pred[m], t))
        chosen, _ = choose_method(s.facts, s.shape, model.scaled(s.share), tuple(s.measured))
        best = min(s.measured, key=lambda m: (s.measured[m], m != chosen))  # a tie: chosen
        points.append(PointRow(s.label, chosen, best, s.measured[chosen] / s.measured[best]))
    n_rows, n_points = max(len(rows), 1), max(len(points), 1)
    summary = Summary(
        rows=len(rows),
        within=sum(abs(r.ratio - 1.0) <= tolerance for r in rows) / n_rows,
        points=len(points),
        picked_best=sum(p.chosen == p.best for p in points) / n_points,
        picked_near=sum(p.slowdown <= 1.0 + near for p in points) / n_points,
        tolerance=tolerance,
        near=near,
    )
    return rows, points, summary


def format_table(rows: Sequence[TableRow], points: Sequence[PointRow], summary: Summary) -> str:
    """Markdown: one line per sample (every method's predicted / measured ms and ratio, the chosen
    and the measured best), then the summary."""
    by_label: dict[str, list[TableRow]] = {}
    for r in rows:
        by_label.setdefault(r.label, []).append(r)
    lines = [
        "| point | method: predicted / measured ms (ratio) | auto picks | measured best "
        "| picked / best |",
        "|---|---|---|---|---|",
    ]
    for p in points:
        cells = "; ".join(
            f"{r.method}: {r.predicted * 1e3:.0f} / {r.measured * 1e3:.0f} ({r.ratio:.2f})"
            for r in by_label.get(p.label, [])
        )
        lines.append(f"| {p.label} | {cells} | {p.chosen} | {p.best} | {p.slowdown:.3f} |")
    lines.append("")
    lines.append(
        f"Predicted within +-{summary.tolerance:.0%} of measured: "
        f"{summary.within:.0%} of {summary.rows} (point, method) rows. "
        f"auto picks the measured best at {summary.picked_best:.0%} of {summary.points} points, "
        f"a method within {summary.near:.0%} of it at {summary.picked_near:.0%}."
    )
    return "\n".join(lines)
