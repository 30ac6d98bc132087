"""Calibrating the cost model of ``attention="auto"``: fit its rates to measured step times.

A :class:`Sample` is one measured grid point: a batch's :class:`~cpshard.attention.cost.PlanFacts`,
the call's :class:`~cpshard.attention.cost.CallShape`, the measured seconds of one layer's
forward + backward per method (a point estimate, e.g. the median of repeats) and, optionally, the
repeats themselves (:attr:`Sample.rounds`: round ``i`` of every method ran in the same pass over
the methods, so load drift hits them alike and rounds pair up).

:func:`fit_rates` finds the :class:`~cpshard.attention.cost.CostModel` rates (compute rate, link
bandwidth, latency, overlap, ...) that make the modelled times closest to the measured ones:
(weighted) least squares of ``log(predicted / measured)`` over every (sample, method), by a
pattern search in log space (the model is piecewise smooth: maxima over ranks and overlaps, so no
gradients). With ``weighted=True`` a (sample, method) counts ``1 / (se**2 + floor**2)``, ``se`` the
relative standard error of its median from the spread of its rounds.

:func:`calibration_table` compares, per sample and method, predicted and measured, and per sample
the method the model picks with the measured best; :func:`cross_validate` does the same with each
sample predicted by rates fitted on the *other* samples only (leave-one-point-out), so its errors
are out-of-sample. A pick that is not the measured best is a *clear* miss only when the rounds show
the picked method slower than the best beyond the noise (a one-sided sign test on the paired
rounds, :func:`slower_beyond_noise`); the summary reports the strict pick rate (the measured best,
whatever the noise) and the within-noise rate side by side. :func:`format_table` prints it
(``benchmarks/bench_auto_calibration.py`` runs the whole thing).

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
    "cross_validate",
    "fit_rates",
    "format_table",
    "paired_estimate",
    "paired_spread",
    "relative_spread",
    "sign_test",
    "slower_beyond_noise",
]

FIT_RATES = (
    "compute_rate",
    "link_bandwidth",
    "latency",
    "overlap",
    "pass_rate",
    "block_rate",
    "gather_bandwidth",
    "all_to_all_bandwidth",
)
"""The :class:`CostModel` fields :func:`fit_rates` may fit (``overlap`` linearly in ``[0, 1]``, the
others in log space)."""

_LATENCY_FLOOR = 1e-9  # seconds: latency is fitted in log space, so never exactly 0
_IQR_TO_SD = 1.349  # interquartile range of a normal distribution, in standard deviations
_MEDIAN_SE = 1.2533  # standard error of a normal sample's median, in sd / sqrt(n)


@dataclass(frozen=True)
class Sample:
    """One measured grid point.

    Attributes:
        label: How the table names it (batch, S, C, heads).
        facts: The batch's plan facts for the call's mask.
        shape: The call.
        measured: Seconds of one layer's forward + backward per method (slowest rank; e.g. the
            median of :attr:`rounds`); the methods measured are the candidates ``auto`` chooses
            among here.
        share: Share of a core each rank gets (1: a core or a GPU each).
        rounds: Optional repeats, seconds per method and round, every method the same number of
            rounds; round ``i`` of every method ran in the same pass over the methods (paired).
    """

    label: str
    facts: PlanFacts
    shape: CallShape
    measured: Mapping[str, float]
    share: float = 1.0
    rounds: Mapping[str, Sequence[float]] | None = None


def _predicted(sample: Sample, model: CostModel) -> dict[str, float]:
    return method_costs(sample.facts, sample.shape, model.scaled(sample.share))


def _check(samples: Sequence[Sample]) -> None:
    if not samples:
        raise ValueError("fit_rates needs at least one sample")
    for s in samples:
        if not s.measured or min(s.measured.values()) <= 0:
            raise ValueError(f"sample {s.label!r}: every measured time must be > 0")
        if s.rounds is not None:
            counts = {m: len(s.rounds.get(m, ())) for m in s.measured}
            if len(set(counts.values())) != 1 or min(counts.values()) < 1:
                raise ValueError(
                    f"sample {s.label!r}: rounds must hold the same number (>= 1) of times for "
                    f"every measured method, got {counts}"
                )


def relative_spread(sample: Sample) -> dict[str, float]:
    """Interquartile range over median of each method's rounds (0 without rounds or with one).

    Args:
        sample: A measured point.

    Returns:
        ``{method: IQR / median}`` for every measured method.
    """
    out: dict[str, float] = {}
    for m in sample.measured:
        times = np.asarray(sample.rounds[m] if sample.rounds is not None else (), dtype=np.float64)
        if times.size < 2:
            out[m] = 0.0
            continue
        q1, med, q3 = np.percentile(times, [25.0, 50.0, 75.0])
        out[m] = float((q3 - q1) / med)
    return out


def paired_estimate(rounds: Mapping[str, Sequence[float]]) -> dict[str, float]:
    """Per method, a point estimate from paired rounds that load drift between rounds cannot bias.

    Two-way model ``log t[m, r] = level[r] + effect[m] + noise``: ``level[r]`` is round ``r``'s
    mean log time over the methods (what the machine's load did to the whole round),
    ``effect[m]`` the median over rounds of method ``m``'s log time minus its round's level. The
    estimate is ``exp(min(level) + effect[m])``: the differences between methods from every
    round, the absolute level from the quietest one (load only adds time).

    Args:
        rounds: Seconds per method and round (every method the same rounds, > 0).

    Returns:
        ``{method: seconds}``.
    """
    names = list(rounds)
    logs = np.log(np.asarray([list(rounds[m]) for m in names], dtype=np.float64))  # [M, R]
    level = logs.mean(axis=0)  # [R]
    effect = np.median(logs - level, axis=1)  # [M]
    return {m: float(np.exp(level.min() + e)) for m, e in zip(names, effect, strict=True)}


def paired_spread(sample: Sample) -> dict[str, float]:
    """Interquartile range of each method's log time relative to its round's mean over the
    methods (about the relative spread once load drift between rounds is taken out; 0 without
    rounds or with one).

    Args:
        sample: A measured point.

    Returns:
        ``{method: IQR of log(t[m, r]) - level[r]}`` for every measured method.
    """
    if sample.rounds is None or len(next(iter(sample.rounds.values()))) < 2:
        return dict.fromkeys(sample.measured, 0.0)
    names = list(sample.measured)
    logs = np.log(np.asarray([list(sample.rounds[m]) for m in names], dtype=np.float64))
    rel = logs - logs.mean(axis=0)
    q1, q3 = np.percentile(rel, [25.0, 75.0], axis=1)
    return {m: float(b - a) for m, a, b in zip(names, q1, q3, strict=True)}


def sign_test(wins: int, n: int) -> float:
    """One-sided sign test: the chance of ``>= wins`` heads in ``n`` fair coin flips.

    Args:
        wins: Rounds in which one method was slower than the other.
        n: Rounds.

    Returns:
        The p-value, in ``(0, 1]``.
    """
    if not 0 <= wins <= n:
        raise ValueError(f"sign_test needs 0 <= wins <= n, got wins={wins}, n={n}")
    return sum(math.comb(n, j) for j in range(wins, n + 1)) / 2.0**n


def slower_beyond_noise(sample: Sample, slow: str, fast: str, alpha: float = 0.05) -> bool | None:
    """Whether ``slow`` took longer than ``fast`` in enough paired rounds that chance is unlikely.

    A one-sided sign test on the rounds (round ``i`` of both ran in the same pass): the share of
    rounds where ``slow`` was slower must have a p-value ``<= alpha`` under "both equally fast"
    (a tie counts against it). With 5 rounds that needs 5 of 5 at ``alpha = 0.05``, with 8 rounds
    7 of 8.

    Args:
        sample: A measured point.
        slow: The method claimed slower.
        fast: The method claimed faster.
        alpha: Significance level.

    Returns:
        ``None`` without rounds, else the verdict.
    """
    if sample.rounds is None:
        return None
    a = np.asarray(sample.rounds[slow], dtype=np.float64)
    b = np.asarray(sample.rounds[fast], dtype=np.float64)
    return sign_test(int((a > b).sum()), int(a.size)) <= alpha


def _encode(model: CostModel, free: Sequence[str]) -> np.ndarray:
    out = []
    for name in free:
        value = float(getattr(model, name))
        if name == "overlap":
            out.append(value)
        elif not math.isfinite(value):
            raise ValueError(f"fit_rates needs a finite start for {name}, got {value!r}")
        else:
            out.append(math.log(max(value, _LATENCY_FLOOR)))
    return np.asarray(out, dtype=np.float64)


def _decode(x: np.ndarray, model: CostModel, free: Sequence[str]) -> CostModel:
    values: dict[str, float] = {}
    for name, v in zip(free, x, strict=True):
        values[name] = min(max(float(v), 0.0), 1.0) if name == "overlap" else math.exp(float(v))
    out: CostModel = dataclasses.replace(model, **values)  # type: ignore[arg-type]
    return out


def _weights(samples: Sequence[Sample], weighted: bool, floor: float) -> list[dict[str, float]]:
    """Per sample and method: ``1 / (se**2 + floor**2)``, ``se`` the relative standard error of
    the median from the rounds' spread (1 everywhere when not ``weighted``)."""
    out = []
    for s in samples:
        if not weighted:
            out.append(dict.fromkeys(s.measured, 1.0))
            continue
        n = len(next(iter(s.rounds.values()))) if s.rounds else 1
        spread = relative_spread(s)
        se = {m: _MEDIAN_SE * spread[m] / _IQR_TO_SD / math.sqrt(n) for m in s.measured}
        out.append({m: 1.0 / (se[m] ** 2 + floor**2) for m in s.measured})
    return out


def _loss(
    samples: Sequence[Sample], weights: Sequence[Mapping[str, float]], model: CostModel
) -> float:
    total = 0.0
    for s, w in zip(samples, weights, strict=True):
        pred = _predicted(s, model)
        for m, t in s.measured.items():
            total += w[m] * math.log(pred[m] / t) ** 2
    return total


def fit_rates(
    samples: Sequence[Sample],
    start: CostModel,
    free: Sequence[str] = FIT_RATES,
    *,
    weighted: bool = False,
    floor: float = 0.02,
    tol: float = 1e-7,
    max_evals: int = 20000,
    first_step: float = 1.0,
) -> CostModel:
    """The rates of ``free`` that fit ``samples`` best (least squares of log ratios).

    Args:
        samples: Measured grid points (every measured time > 0).
        start: Where the search starts; its other fields (heads, ...) are kept.
        free: The fields to fit, a subset of :data:`FIT_RATES`.
        weighted: Weigh each (sample, method) by ``1 / (se**2 + floor**2)``, ``se`` the relative
            standard error of its median from its rounds' spread (no rounds: ``se = 0``).
        floor: Relative error every point has at least (keeps one very steady point from
            outweighing the rest).
        tol: Stop when every step is below this (log units; ``overlap`` absolute).
        max_evals: Stop after this many evaluations of the loss.
        first_step: The search's first step (log units; a quarter of it for ``overlap``): small
            when ``start`` is near, e.g. a fit on nearly the same samples.

    Returns:
        ``start`` with the fitted rates.

    Raises:
        ValueError: no sample, a time <= 0, uneven rounds, or a field not in :data:`FIT_RATES`.
    """
    bad = [f for f in free if f not in FIT_RATES]
    if bad:
        raise ValueError(f"fit_rates can fit {FIT_RATES}, not {bad}")
    _check(samples)
    if weighted and not floor > 0:
        raise ValueError(f"fit_rates(weighted=True) needs floor > 0, got {floor!r}")
    weights = _weights(samples, weighted, floor)
    x = _encode(start, free)
    step = np.asarray([first_step * (0.25 if f == "overlap" else 1.0) for f in free])
    best = _loss(samples, weights, _decode(x, start, free))
    evals = 1
    while step.max() > tol and evals < max_evals:
        moved = False
        for i in range(x.size):
            for sign in (1.0, -1.0):
                y = x.copy()
                y[i] += sign * step[i]
                if free[i] == "overlap":
                    y[i] = min(max(y[i], 0.0), 1.0)
                loss = _loss(samples, weights, _decode(y, start, free))
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
    """One (sample, method) row: modelled and measured seconds, and the rounds' spread
    (:func:`relative_spread`, :func:`paired_spread`)."""

    label: str
    method: str
    predicted: float
    measured: float
    spread: float = 0.0
    paired_spread: float = 0.0

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
        clear: Whether the rounds show ``best`` faster than the runner-up beyond the noise
            (:func:`slower_beyond_noise`); ``None`` without rounds.
        noise_miss: ``chosen`` is not ``best`` but the rounds cannot tell it slower
            (:func:`slower_beyond_noise` says no); ``False`` without rounds.
    """

    label: str
    chosen: str
    best: str
    slowdown: float
    clear: bool | None = None
    noise_miss: bool = False


@dataclass(frozen=True)
class Summary:
    """The table's summary.

    Attributes:
        rows: (sample, method) rows.
        within: Share of the rows whose ratio is within ``1 +- tolerance``.
        points: Samples.
        picked_best: Share of the samples where the chosen method is the measured best (strict:
            whatever the noise).
        picked_near: Share where it is within ``near`` of the measured best (slowdown <= 1 +
            near).
        tolerance: The ratio tolerance.
        near: The slowdown tolerance.
        picked_within_noise: Share where the chosen method is the measured best or the rounds
            cannot tell it slower than the best (equals ``picked_best`` without rounds).
        clear: Share of the samples whose measured best beats the runner-up beyond the noise
            (``nan`` without rounds).
        spread: Median of the rows' :attr:`TableRow.spread` (IQR / median of the rounds).
        paired_spread: Median of the rows' :attr:`TableRow.paired_spread`.
        log_rms: Root mean square of ``log(predicted / measured)`` over the rows.
    """

    rows: int
    within: float
    points: int
    picked_best: float
    picked_near: float
    tolerance: float
    near: float
    picked_within_noise: float = float("nan")
    clear: float = float("nan")
    spread: float = 0.0
    log_rms: float = 0.0
    paired_spread: float = 0.0


def _point(sample: Sample, model: CostModel, alpha: float) -> tuple[list[TableRow], PointRow]:
    s = sample
    pred = _predicted(s, model)
    spread, paired = relative_spread(s), paired_spread(s)
    rows = [TableRow(s.label, m, pred[m], t, spread[m], paired[m]) for m, t in s.measured.items()]
    chosen, _ = choose_method(s.facts, s.shape, model.scaled(s.share), tuple(s.measured))
    order = sorted(s.measured, key=lambda m: (s.measured[m], m != chosen))  # a tie: chosen
    best = order[0]
    clear = slower_beyond_noise(s, order[1], best, alpha) if len(order) > 1 else None
    miss = chosen != best and slower_beyond_noise(s, chosen, best, alpha) is False
    return rows, PointRow(s.label, chosen, best, s.measured[chosen] / s.measured[best], clear, miss)


def _summary(
    rows: Sequence[TableRow], points: Sequence[PointRow], tolerance: float, near: float
) -> Summary:
    n_rows, n_points = max(len(rows), 1), max(len(points), 1)
    judged = [p.clear for p in points if p.clear is not None]
    picked = sum(p.chosen == p.best for p in points)
    logs = [math.log(r.ratio) ** 2 for r in rows]
    return Summary(
        rows=len(rows),
        within=sum(abs(r.ratio - 1.0) <= tolerance for r in rows) / n_rows,
        points=len(points),
        picked_best=picked / n_points,
        picked_near=sum(p.slowdown <= 1.0 + near for p in points) / n_points,
        tolerance=tolerance,
        near=near,
        picked_within_noise=(picked + sum(p.noise_miss for p in points)) / n_points,
        clear=sum(judged) / len(judged) if judged else float("nan"),
        spread=float(np.median([r.spread for r in rows])) if rows else 0.0,
        log_rms=math.sqrt(sum(logs) / len(logs)) if logs else 0.0,
        paired_spread=float(np.median([r.paired_spread for r in rows])) if rows else 0.0,
    )


def calibration_table(
    samples: Sequence[Sample],
    model: CostModel,
    *,
    tolerance: float = 0.15,
    near: float = 0.05,
    alpha: float = 0.05,
) -> tuple[list[TableRow], list[PointRow], Summary]:
    """Predicted vs measured per (sample, method), the choice per sample, and the summary.

    Args:
        samples: Measured grid points.
        model: The rates to predict with (each sample's :attr:`Sample.share` applied).
        tolerance: A prediction counts as within when ``|predicted / measured - 1| <= tolerance``.
        near: A choice counts as near when its measured time is ``<= (1 + near)`` times the best.
        alpha: Significance level of :func:`slower_beyond_noise`.

    Returns:
        ``(rows, points, summary)``.
    """
    rows: list[TableRow] = []
    points: list[PointRow] = []
    for s in samples:
        r, p = _point(s, model, alpha)
        rows.extend(r)
        points.append(p)
    return rows, points, _summary(rows, points, tolerance, near)


def cross_validate(
    samples: Sequence[Sample],
    start: CostModel,
    free: Sequence[str] = FIT_RATES,
    *,
    weighted: bool = False,
    floor: float = 0.02,
    tolerance: float = 0.15,
    near: float = 0.05,
    alpha: float = 0.05,
    tol: float = 1e-4,
    first_step: float = 0.1,
) -> tuple[list[TableRow], list[PointRow], Summary]:
    """Leave-one-point-out :func:`calibration_table`: each sample predicted (and its method
    picked) by rates fitted on every other sample, so the errors are out-of-sample.

    Args:
        samples: Measured grid points (at least 2).
        start: Where each fit starts (e.g. the fit on all samples, to fit fast).
        free: The fields to fit.
        weighted: As :func:`fit_rates`.
        floor: As :func:`fit_rates`.
        tolerance: As :func:`calibration_table`.
        near: As :func:`calibration_table`.
        alpha: As :func:`calibration_table`.
        tol: Per fit, as :func:`fit_rates` (1e-4: rates to 0.01%, far below any timing noise).
        first_step: Per fit, as :func:`fit_rates` (small: each fit starts at ``start``).

    Returns:
        ``(rows, points, summary)`` of the held-out predictions.
    """
    if len(samples) < 2:
        raise ValueError(f"cross_validate needs at least 2 samples, got {len(samples)}")
    rows: list[TableRow] = []
    points: list[PointRow] = []
    for i, s in enumerate(samples):
        rest = [x for j, x in enumerate(samples) if j != i]
        model = fit_rates(
            rest, start, free, weighted=weighted, floor=floor, tol=tol, first_step=first_step
        )
        r, p = _point(s, model, alpha)
        rows.extend(r)
        points.append(p)
    return rows, points, _summary(rows, points, tolerance, near)


def format_table(rows: Sequence[TableRow], points: Sequence[PointRow], summary: Summary) -> str:
    """Markdown: one line per sample (every method's predicted / measured ms, ratio and rounds'
    spread, the chosen and the measured best, whether the best is clear of the runner-up), then
    the summary."""
    by_label: dict[str, list[TableRow]] = {}
    for r in rows:
        by_label.setdefault(r.label, []).append(r)
    lines = [
        "| point | method: predicted / measured ms (ratio, IQR/median) | auto picks "
        "| measured best | picked / best | best clear of runner-up |",
        "|---|---|---|---|---|---|",
    ]
    for p in points:
        cells = "; ".join(
            f"{r.method}: {r.predicted * 1e3:.0f} / {r.measured * 1e3:.0f} "
            f"({r.ratio:.2f}, {r.spread:.0%})"
            for r in by_label.get(p.label, [])
        )
        clear = "-" if p.clear is None else ("yes" if p.clear else "no")
        pick = p.chosen + (" (within noise)" if p.noise_miss else "")
        lines.append(f"| {p.label} | {cells} | {pick} | {p.best} | {p.slowdown:.3f} | {clear} |")
    lines.append("")
    clear = "n/a (no rounds)" if math.isnan(summary.clear) else f"{summary.clear:.0%} of points"
    lines.append(
        f"Predicted within +-{summary.tolerance:.0%} of measured: "
        f"{summary.within:.0%} of {summary.rows} (point, method) rows "
        f"(rms log error {summary.log_rms:.3f}; rounds' median IQR/median {summary.spread:.1%}, "
        f"{summary.paired_spread:.1%} within rounds). "
        f"auto picks the measured best at {summary.picked_best:.0%} of {summary.points} points "
        f"(strict), the best or one the rounds cannot tell slower at "
        f"{summary.picked_within_noise:.0%}, a method within {summary.near:.0%} of it at "
        f"{summary.picked_near:.0%}; the measured best is clear of the runner-up at {clear}."
    )
    return "\n".join(lines)
