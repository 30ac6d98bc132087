"""``cpshard parity`` without ranks: bad input, help, the row plan, comparison and the reports."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch

import cpshard.cli.parity as parity_cli
import cpshard.parity.driver as parity_driver
from cpshard.cli.main import main
from cpshard.names import DENSE_LAYOUTS, METHOD_NAMES, PACKED_LAYOUTS
from cpshard.parity.plan import plan_rows
from cpshard.parity.report import Record, format_row, write_json, write_plot
from cpshard.parity.runs import (
    TOLERANCES,
    ParityCase,
    ParityResult,
    Tolerance,
    compare,
    grad_error,
)


@pytest.fixture
def no_work(monkeypatch: pytest.MonkeyPatch) -> None:
    """Fail the test if a run gets as far as starting ranks: errors must come first."""

    def refuse(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("work started before the input was checked")

    monkeypatch.setattr(parity_driver, "LocalRunner", refuse)
    monkeypatch.setattr(parity_driver, "LaunchedRunner", refuse)
    monkeypatch.delenv("WORLD_SIZE", raising=False)


@pytest.mark.usefixtures("no_work")
@pytest.mark.parametrize(
    ("argv", "flag", "fix"),
    [
        (["--models", "gpt5"], "--models", "use a comma list of llama"),
        (["--methods", "flash"], "--methods", "all_gather, ring, ulysses"),
        (["--layouts", "zigzag"], "--layouts", "round_robin, contiguous"),
        (["--dtypes", "float16"], "--dtypes", "float32"),
        (["--ranks", "0"], "--ranks", "--ranks 1 or more"),
        (["--ranks", "200"], "--ranks", "use --ranks <= 128"),
        (["--ranks", "9", "--seq-len", "16"], "--ranks", "--seq-len >= 18"),
        (["--steps", "0"], "--steps", "--steps 1 or more"),
        (["--json", "/nonexistent-dir/x.json"], "--json", "create it or choose another path"),
        (["--json", "/"], "--json", "is a directory"),
        (["--plot", "/nonexistent-dir/p.png"], "--plot", "create it or choose another path"),
        (["--plot", "parity.bmp"], "--plot", ".png"),
        (["--timeout", "0"], "--timeout", "e.g. --timeout 120"),
    ],
)
def test_bad_input_is_one_line_naming_flag_and_fix(
    argv: list[str], flag: str, fix: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["parity", *argv]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    assert flag in err
    assert fix in err


@pytest.mark.usefixtures("no_work")
def test_torchrun_world_size_must_match_ranks(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert main(["parity", "--ranks", "4"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert "--ranks 4" in err and "WORLD_SIZE=2" in err
    assert "pass --ranks 2" in err and "--nproc-per-node 4" in err


@pytest.mark.usefixtures("no_work")
@pytest.mark.parametrize("argv", [["--ranks", "four"], ["--grad-sync", "avg"], ["--bogus"]])
def test_argparse_errors_are_one_line_exit_2(
    argv: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["parity", *argv])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert "see `cpshard parity --help`" in err


def test_help_shows_defaults_and_what_is_compared(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["parity", "--help"])
    out = capsys.readouterr().out
    assert "What is compared" in out
    assert "(default: 4)" in out  # --ranks
    assert "(default: 3)" in out  # --steps
    assert "(default: 120.0)" in out  # --timeout
    for dtype, tol in TOLERANCES.items():
        assert f"{dtype}: rel |dloss| <= {tol.rel_loss:g}, grad err <= {tol.grad:g}" in out


def test_help_lists_commands(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["--help"])
    out = capsys.readouterr().out
    assert "parity" in out and "layouts" in out and "balance" in out


def test_default_plan_is_the_demo_rows() -> None:
    """2 cp=1 references + every layout x method (18 rows with the 4 methods)."""
    rows = plan_rows(
        ParityCase(),
        models=["llama"],
        dtypes=["float32"],
        layouts=[*DENSE_LAYOUTS, *PACKED_LAYOUTS],
        methods=list(METHOD_NAMES),
        world=4,
    )
    n_layouts = len(DENSE_LAYOUTS) + len(PACKED_LAYOUTS)
    assert len(rows) == 2 + n_layouts * len(METHOD_NAMES) == 18
    assert [r.kind for r in rows].count("reference") == 2
    assert all(r.skip is None for r in rows)
    assert {r.case.batch for r in rows if r.layout in PACKED_LAYOUTS} == {"packed"}
    # every cp row of one batch kind shares one cp=1 reference
    assert len({r.ref_key for r in rows}) == 2


def test_default_demo_has_a_pre_embedding_and_a_model_owned_row_beside_the_hf_rows() -> None:
    """Issue 17: `cpshard parity` with no arguments (`make demo`) runs the HF rows (every layout x
    method, 16 CP rows with the 4 methods) plus one vlm (pre-embedding) and one prefix
    (model-owned) CP row, as in the seed's table."""
    import argparse

    p = argparse.ArgumentParser()
    parity_cli.add_arguments(p)
    args = p.parse_args([])
    names = parity_cli._validate(args)
    assert names["models"] == ["llama", "vlm", "prefix"]
    rows = plan_rows(
        ParityCase(),
        models=names["models"],
        dtypes=names["dtypes"],
        layouts=names["layouts"],
        methods=names["methods"],
        world=args.ranks,
        one_row=parity_cli._DEMO_ONE_ROW,
    )
    cp = [(r.case.model, r.case.method) for r in rows if r.kind == "cp"]
    assert cp.count(("vlm", "all_gather")) == 1 and cp.count(("prefix", "own")) == 1
    n_llama = (len(DENSE_LAYOUTS) + len(PACKED_LAYOUTS)) * len(METHOD_NAMES)
    assert len([m for m, _ in cp if m == "llama"]) == n_llama == 16 and len(cp) == n_llama + 2
    assert len(rows) == len(cp) + 4 == 22 and all(r.skip is None for r in rows)


def test_plan_skips_ulysses_when_heads_do_not_divide() -> None:
    rows = plan_rows(
        ParityCase(),
        models=["tiny"],
        dtypes=["float32", "bfloat16"],
        layouts=["contiguous"],
        methods=["ulysses", "ring"],
        world=3,
    )
    skipped = [r for r in rows if r.skip]
    assert len(skipped) == 2  # one per dtype
    assert all(
        r.case.method == "ulysses" and "not divisible by 3" in (r.skip or "") for r in skipped
    )


def test_grad_error_is_max_abs_over_max_ref() -> None:
    ref = torch.tensor([1.0, -2.0, 0.5], dtype=torch.float64)
    got = ref + torch.tensor([0.0, 2e-5, -1e-5], dtype=torch.float64)
    assert grad_error(got, ref) == pytest.approx(1e-5)  # 2e-5 / max|g| = 2
    assert grad_error(ref / 2, ref) == pytest.approx(0.5)  # a gradient averaged over 2 ranks
    with pytest.raises(ValueError, match="gradient sizes differ"):
        grad_error(ref[:2], ref)


def _result(losses: list[float], grad_errs: list[float]) -> ParityResult:
    return ParityResult("x", losses, grad_errs, 4)


def test_compare_is_per_step_and_relative() -> None:
    ref = _result([2.0, 4.0], [])
    got = _result([2.0, 4.0 + 4e-5], [1e-5, 0.0])
    diff = compare(ref, got)
    assert diff.abs_dloss == pytest.approx([0.0, 4e-5])
    assert diff.rel_dloss == pytest.approx([0.0, 1e-5])
    assert diff.grad_err == [1e-5, 0.0]
    assert not diff.passed(Tolerance(rel_loss=1e-5, grad=0.9e-5))
    assert diff.passed(Tolerance(rel_loss=1.1e-5, grad=1.1e-5))
    with pytest.raises(ValueError, match="differ in length"):
        compare(ref, _result([2.0, 4.0], [0.0]))


def test_compare_catches_a_late_step_and_nan() -> None:
    ref = _result([1.0, 1.0, 1.0], [])
    late = _result([1.0, 1.0, 1.0], [0.0, 0.0, 0.5])  # only step 3 is wrong
    assert not compare(ref, late).passed(TOLERANCES["float32"])
    nan = _result([1.0, float("nan"), 1.0], [0.0, 0.0, 0.0])
    assert not compare(ref, nan).passed(TOLERANCES["float32"])
    nan_grad = _result([1.0, 1.0, 1.0], [0.0, float("nan"), 0.0])
    assert not compare(ref, nan_grad).passed(TOLERANCES["float32"])


def _record(**kw: Any) -> Record:
    base: dict[str, Any] = {
        "kind": "cp",
        "model": "llama",
        "dtype": "float32",
        "batch": "dense",
        "layout": "round_robin",
        "method": "ring",
        "world": 2,
        "steps": 3,
        "grad_sync": "sum",
        "launcher": "local",
        "backend": "gloo",
        "device": "cpu",
        "tol_rel_dloss": 1e-5,
        "tol_grad_err": 1e-5,
        "sharder_layout": "round_robin",
        "local_tokens": 16,
        "losses": [5.0, 4.9, 4.8],
        "ref_losses": [5.0, 4.9, 4.8],
        "abs_dloss": [0.0, 1e-7, float("nan")],
        "rel_dloss": [0.0, 2e-8, float("nan")],
        "grad_errs": [1e-7, 2e-7, 3e-7],
        "max_abs_dloss": float("nan"),
        "max_rel_dloss": float("nan"),
        "grad_err": 3e-7,
        "passed": False,
        "seconds": 1.5,
        "peak_mem_mb": [300.0, 310.0],
        "peak_mem_kind": "cpu_peak_rss",
    }
    base.update(kw)
    return Record(**base)


def test_json_has_no_nan_and_plot_is_written(tmp_path: Path) -> None:
    records = [_record(), _record(method="all_gather", passed=True), _record(skipped="skipped: x")]
    write_json(str(tmp_path / "r.json"), records)
    data = json.loads((tmp_path / "r.json").read_text())
    assert data[0]["rel_dloss"][2] is None and data[0]["max_rel_dloss"] is None
    write_plot(str(tmp_path / "p.png"), records)
    assert (tmp_path / "p.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_table_row_says_no_for_a_failed_row() -> None:
    line = format_row(_record(max_rel_dloss=2e-5, passed=False))
    assert line.endswith("| NO |") and "2.00e-05" in line
    assert "skipped: x" in format_row(_record(skipped="skipped: x"))
    assert math.isnan(_record().max_abs_dloss or 0.0)


def test_all_models_plan_has_model_owned_rows_next_to_hf_rows() -> None:
    rows = plan_rows(
        ParityCase(),
        models=["llama", "vlm", "prefix"],
        dtypes=["float32"],
        layouts=[*DENSE_LAYOUTS, *PACKED_LAYOUTS],
        methods=list(METHOD_NAMES),
        world=4,
    )
    vlm = [r for r in rows if r.case.model == "vlm" and r.kind == "cp"]
    assert {(r.case.batch, r.layout) for r in vlm} == {("dense", "auto"), ("packed", "auto")}
    assert len(vlm) == 2 * len(METHOD_NAMES)  # 2 batch kinds x every method
    prefix = [r for r in rows if r.case.model == "prefix"]
    assert [(r.kind, r.case.method) for r in prefix] == [("reference", "all_gather"), ("cp", "own")]


def test_layouts_rejects_too_many_ranks_before_starting_any(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["layouts", "--ranks", "8", "--seq-len", "10"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--ranks 8" in err and "use --ranks <= 5" in err


def test_local_runner_bounds_collectives_not_rows(monkeypatch: pytest.MonkeyPatch) -> None:
    """--timeout is the ranks' process-group timeout; a row itself has no deadline (a long row
    of a thorough run must not be killed by a limit nobody set)."""
    import cpshard.parity.runners as parity_run

    seen: dict[str, Any] = {}

    class Pool:
        def __init__(self, world: int, **kwargs: Any) -> None:
            seen["init"] = (world, kwargs)

        def alive(self) -> bool:
            return True

        def run(self, fn: Any, *args: Any, **kwargs: Any) -> list[Any]:
            seen["run"] = kwargs
            return [(object(), 1.0, 2.0, "cpu_peak_rss")]

        def close(self) -> None:
            seen["closed"] = True

    monkeypatch.setattr(parity_run, "LocalRanks", Pool)
    runner = parity_run.LocalRunner(1, timeout_s=7.0)
    runner.cp_side(ParityCase())
    runner.close()
    assert seen["init"] == (1, {"pg_timeout_s": 7.0})
    assert seen["run"].get("timeout_s") == math.inf
    assert seen["closed"]
