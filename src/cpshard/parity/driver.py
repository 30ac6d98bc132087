"""The driver of a parity run: plans the rows, runs them on a runner, prints the table.

:func:`run_parity` is what ``cpshard parity`` calls once its arguments are checked: the rows
come from :mod:`.plan`, run on a runner of :mod:`.runners` (local forked ranks, or the ranks
``torchrun`` launched), the cp=N side of each row is compared with the cp=1 reference
(:func:`~cpshard.parity.runs.compare`) and reported by :mod:`.report`.

Import rules: the rows of ``RULES`` in tests/unit/test_architecture.py that cover this module.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from cpshard.parity.plan import Row, plan_rows
from cpshard.parity.report import Record, format_row, table_header, write_json, write_plot
from cpshard.parity.runners import (
    DEFAULT_TIMEOUT_S,
    CpSide,
    LaunchedRunner,
    LocalRunner,
    launched_world_size,
)
from cpshard.parity.runs import (
    HEADS,
    KV_HEADS,
    MODELS,
    TOLERANCES,
    ParityCase,
    ParityResult,
    Shadow,
    compare,
)
from cpshard.tools.launch import RankFailure

__all__ = ["run_parity"]


def _plan_text(
    base: ParityCase, ranks: int, models: list[str], dtypes: list[str], rows: list[Row]
) -> str:
    todo = [r for r in rows if r.skip is None]
    lines = [
        f"cpshard parity: cp={ranks} vs cp=1 through the same training code; {len(rows)} "
        f"rows ({len(todo)} to run), {base.steps} AdamW steps each",
        f"  models: {', '.join(f'{m} ({MODELS[m].description})' for m in models)}",
        f"  batches: corpus text (CPython docs, byte tokens); dense [{base.batch_size}, "
        f"{base.seq_len}], packed [1, {base.batch_size * base.seq_len}]; seed {base.seed}",
        f"  attention heads {HEADS}, KV heads {KV_HEADS}; gradient sync: {base.grad_sync}",
        "  compared at every step: rel |dloss| = |loss_N - loss_1| / loss_1 of the two runs, and "
        "grad err = max|g_N - g_1| / max|g_1| (all parameters after the CP gradient sync, g_1 "
        "on the same weights)",
    ]
    for dtype in dtypes:
        tol = TOLERANCES[dtype]
        lines.append(
            f"  tolerance {dtype}: rel |dloss| <= {tol.rel_loss:g}, grad err <= {tol.grad:g}"
        )
    return "\n".join(lines)


class _Driver:
    """Runs the rows on a runner and turns each into a :class:`Record`."""

    def __init__(self, runner: Any) -> None:
        self.runner = runner
        self.refs: dict[ParityCase, CpSide] = {}

    def _record(self, row: Row, world: int) -> Record:
        c = row.case
        tol = TOLERANCES[c.dtype]
        return Record(
            kind=row.kind,
            model=c.model,
            dtype=c.dtype,
            batch=c.batch,
            layout=row.layout,
            method="native" if row.kind == "reference" else c.method,
            world=world,
            steps=c.steps,
            grad_sync=c.grad_sync,
            launcher=self.runner.launcher,
            backend=self.runner.backend if world > 1 else "none",
            device=self.runner.device,
            tol_rel_dloss=tol.rel_loss,
            tol_grad_err=tol.grad,
            skipped=row.skip,
        )

    def reference(self, row: Row) -> CpSide:
        """The cp=1 run shared by the rows of one model/dtype/batch kind; its per-step gradient
        errors are against the model's own attention on the same weights (the reference row)."""
        key = row.ref_key
        if key not in self.refs:
            shadow: Shadow = "native" if MODELS[key.model].native_loss is not None else "none"
            self.refs[key] = self.runner.reference(replace(key, grad_sync="sum"), shadow)
        return self.refs[key]

    def _fill(self, rec: Record, got: CpSide, ref: ParityResult) -> None:
        diff = compare(ref, got.result)  # losses of two runs; gradients on the same weights
        rec.sharder_layout = got.result.layout
        rec.local_tokens = got.result.local_tokens
        rec.losses, rec.ref_losses = got.result.losses, ref.losses
        rec.abs_dloss, rec.rel_dloss, rec.grad_errs = diff.abs_dloss, diff.rel_dloss, diff.grad_err
        rec.max_abs_dloss = max(diff.abs_dloss)
        rec.max_rel_dloss = max(diff.rel_dloss)
        rec.grad_err = max(diff.grad_err)
        rec.passed = diff.passed(TOLERANCES[rec.dtype])
        rec.seconds = got.seconds
        rec.peak_mem_mb, rec.peak_mem_kind = got.peak_mem_mb, got.peak_mem_kind

    def run_row(self, row: Row) -> Record | None:
        """Run one row on every rank; the main process gets the record, the others ``None``."""
        if row.kind == "reference":
            if not self.runner.is_main:
                return None
            rec = self._record(row, 1)
            native = self.runner.native(replace(row.ref_key, grad_sync="sum"))
            self._fill(rec, self.reference(row), native.result)
            return rec
        rec = self._record(row, self.runner.world)
        if row.skip is not None:
            return rec if self.runner.is_main else None
        try:
            got = self.runner.cp_side(row.case)
        except RankFailure as err:
            rec.error, rec.passed = str(err), False
            return rec
        if got is None:
            return None
        self._fill(rec, got, self.reference(row).result)
        return rec


def _progress(total: int, enabled: bool) -> Any:
    from tqdm import tqdm

    return tqdm(
        total=total,
        desc="parity rows",
        unit="row",
        file=sys.stderr,
        disable=not enabled,
        dynamic_ncols=True,
        bar_format="{desc}: {n}/{total} |{bar}| [{elapsed} elapsed, ETA {remaining}]",
    )


def run_parity(
    base: ParityCase,
    *,
    models: list[str],
    dtypes: list[str],
    layouts: list[str],
    methods: list[str],
    ranks: int,
    one_row: frozenset[str] = frozenset(),
    timeout_s: float = DEFAULT_TIMEOUT_S,
    progress: bool = True,
    json_path: str | None = None,
    plot_path: str | None = None,
) -> int:
    """Run every parity row of the plan and print the table; the arguments are checked already.

    Args:
        base: The case every row starts from (steps, sequence length, batch size, seed, gradient
            sync); the plan fills in model, dtype, batch kind, layout and method.
        models: Keys of :data:`cpshard.parity.models.MODELS`.
        dtypes: Keys of :data:`cpshard.parity.runs.TOLERANCES`.
        layouts: Layout names (:mod:`cpshard.names`).
        methods: Attention method names (:mod:`cpshard.names`).
        ranks: CP size N of the cp=N side (the launched world size under ``torchrun``).
        one_row: Models that get a single CP row (see :func:`~cpshard.parity.plan.plan_rows`).
        timeout_s: Seconds a rank may wait in one collective before the run fails.
        progress: Show a progress bar with ETA on stderr.
        json_path: Write one record per row there (:func:`~cpshard.parity.report.write_json`).
        plot_path: Draw the loss curves there (:func:`~cpshard.parity.report.write_plot`).

    Returns:
        The exit status: 0 iff every row passed, 1 if any row failed or every CP row was skipped.
    """
    rows = plan_rows(
        base,
        models=models,
        dtypes=dtypes,
        layouts=layouts,
        methods=methods,
        world=ranks,
        one_row=one_row,
    )
    import torch

    torch.set_num_threads(1)  # before any op: the local ranks are forked from this process
    for model in models:  # one-off imports and init paths before the ranks fork
        MODELS[model].build(torch.float32, base.seed)
    runner: Any
    if launched_world_size() is None:
        runner = LocalRunner(ranks, timeout_s=timeout_s)
    else:
        runner = LaunchedRunner(timeout_s=timeout_s)
    emit: Callable[[str], None] = print if runner.is_main else (lambda _line: None)
    emit(_plan_text(base, ranks, models, dtypes, rows))
    emit(f"  cp={ranks} side: {runner.world} {runner.backend} ranks ({runner.launcher})\n")
    t0 = time.perf_counter()
    records: list[Record] = []
    driver = _Driver(runner)
    try:
        runner.start()
        bar = _progress(len(rows), progress and runner.is_main)

        def show(line: str) -> None:
            if runner.is_main:
                bar.write(line, file=sys.stdout)

        for line in table_header():
            show(line)
        for row in rows:
            rec = driver.run_row(row)
            if rec is not None:
                records.append(rec)
                show(format_row(rec))
            bar.update(1)
        bar.close()
        ok = all(r.passed is not False for r in records)
        ok = runner.agree(ok)
    finally:
        runner.close()
    # every CP row skipped: nothing was compared, not a pass (the same verdict on every rank)
    compared = any(r.kind == "cp" and r.skip is None for r in rows)
    if not runner.is_main:
        return 0 if ok and compared else 1
    for r in records:
        if r.error is not None:
            print(f"\n{r.model} {r.dtype} {r.batch} {r.layout} {r.method}: {r.error}")
    refs = "; ".join(
        f"{k.model} {k.dtype} {k.batch}: "
        + " ".join(f"{x:.4f}" for x in v.result.losses[:4])
        + (" .." if len(v.result.losses) > 4 else "")
        for k, v in driver.refs.items()
    )
    print(f"\nreference losses (cp=1): {refs}")
    if json_path is not None:
        write_json(json_path, records)
        print(f"wrote {json_path}")
    if plot_path is not None:
        write_plot(plot_path, records)
        print(f"wrote {plot_path}")
    failed = [r for r in records if r.passed is False]
    if ok and not compared:
        reasons = sorted({r.skipped for r in records if r.kind == "cp" and r.skipped})
        print(
            f"FAIL: every CP row was skipped ({'; '.join(reasons) or 'no CP rows planned'}), so "
            "no cp=N run was compared with cp=1. Choose rows that can run, e.g. other "
            "--methods or --ranks"
        )
        return 1
    verdict = "PASS" if ok else f"FAIL ({len(failed)} rows)"
    print(f"{verdict} in {time.perf_counter() - t0:.1f} s")
    return 0 if ok else 1
