"""The ``cpshard`` command end to end: it forks its own local gloo ranks, or runs under torchrun."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from _ranks import CALL_DEADLINE_S
from cpshard.cli.main import main

pytestmark = pytest.mark.multirank

# The JSON schema: every record has at least these keys, with these types.
_SCHEMA: dict[str, type | tuple[type, ...]] = {
    "kind": str,
    "batch": str,
    "layout": str,
    "method": str,
    "world": int,
    "model": str,
    "dtype": str,
    "steps": int,
    "losses": list,
    "ref_losses": list,
    "max_abs_dloss": float,
    "max_rel_dloss": float,
    "grad_err": float,
    "grad_errs": list,
    "passed": bool,
    "seconds": float,
    "peak_mem_mb": list,
    "peak_mem_kind": str,
    "tol_rel_dloss": float,
    "tol_grad_err": float,
}


def _check_schema(records: list[dict[str, object]], steps: int) -> None:
    for rec in records:
        for key, kind in _SCHEMA.items():
            assert isinstance(rec[key], kind), (key, rec[key])
        assert rec["steps"] == steps
        for key in ("losses", "ref_losses", "rel_dloss", "abs_dloss", "grad_errs"):
            assert len(rec[key]) == steps, key  # type: ignore[arg-type]
        mems = rec["peak_mem_mb"]
        assert isinstance(mems, list) and len(mems) == rec["world"]
        assert all(m > 0 for m in mems)


def test_layouts_demo_round_trips(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["layouts", "--ranks", "3", "--seq-len", "13"]) == 0
    out = capsys.readouterr().out
    assert "all round trips exact" in out
    assert out.count("round trip ok") == 12  # 4 layouts x 3 ranks
    assert "rank 2: owns [6,9) [9,12)" not in out  # runs are merged into maximal ranges
    assert "rank 2: owns [6,12)" in out  # round_robin, C=3, P=18: chunks 2 and 3 are adjacent
    # packed, C=3: document 0 (5 tokens) padded to 6, chunks of 1: rank 0 keeps chunks 0 and 5
    packed = out.split("\npacked:")[1].split("\nbalanced:")[0]
    assert "rank 0: owns d0[0,1) d1[0,2) d2[0,1) d3[0,2) +6 pad" in packed
    balanced = out.split("\nbalanced:")[1]
    assert "stream padded to 24" in balanced  # 24 real tokens, no padding needed for C=3
    assert "pad" not in balanced.split("\n", 1)[1].split("all round trips")[0]


def test_parity_passes_with_json_and_plot(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    js, png = tmp_path / "parity.json", tmp_path / "parity.png"
    argv = ["parity", "--model", "llama", "--ranks", "2", "--steps", "2", "--seq-len", "48"]
    argv += ["--methods", "ring,ulysses", "--layouts", "round_robin,balanced"]
    argv += ["--json", str(js), "--plot", str(png), "--no-progress"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert out.index("tolerance float32") < out.index("| model |")  # the plan comes first
    assert out.count("| yes |") == 6  # 2 reference checks + 2 layouts x 2 methods
    assert "PASS" in out
    records = json.loads(js.read_text())
    assert len(records) == 6
    _check_schema(records, steps=2)
    assert [r["kind"] for r in records].count("reference") == 2
    cp = [r for r in records if r["kind"] == "cp"]
    assert {(r["layout"], r["method"], r["world"]) for r in cp} == {
        (lay, m, 2) for lay in ("round_robin", "balanced") for m in ("ring", "ulysses")
    }
    assert all(r["passed"] and r["max_rel_dloss"] <= 1e-5 for r in records)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_parity_fails_on_a_wrong_gradient_sync(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    js = tmp_path / "parity.json"
    argv = ["parity", "--model", "tiny", "--ranks", "2", "--steps", "2", "--seq-len", "32"]
    argv += ["--methods", "all_gather", "--layouts", "round_robin", "--grad-sync", "mean"]
    argv += ["--json", str(js), "--no-progress"]
    assert main(argv) == 1
    out = capsys.readouterr().out
    assert "| NO |" in out and "FAIL (1 rows)" in out
    records = json.loads(js.read_text())
    _check_schema(records, steps=2)
    by_kind = {r["kind"]: r for r in records}
    assert by_kind["reference"]["passed"] is True  # the reference check does not sync grads
    bad = by_kind["cp"]
    assert bad["passed"] is False
    assert bad["grad_errs"][0] == pytest.approx(0.5, rel=1e-3)  # averaged over 2 ranks: g / 2


def test_parity_reports_indivisible_heads_for_ulysses(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["parity", "--model", "tiny", "--ranks", "3", "--steps", "1", "--seq-len", "30"]
    argv += ["--methods", "ulysses,all_gather", "--layouts", "contiguous", "--no-progress"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "skipped: heads 8/4 not divisible by 3 ranks" in out


def test_parity_with_every_cp_row_skipped_fails_and_says_why(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Issue 17: it printed PASS and exited 0 when no cp=N run was compared at all."""
    argv = ["parity", "--model", "tiny", "--ranks", "3", "--steps", "1", "--seq-len", "30"]
    argv += ["--methods", "ulysses", "--layouts", "contiguous", "--no-progress"]
    assert main(argv) == 1
    out = capsys.readouterr().out
    assert "FAIL: every CP row was skipped (skipped: heads 8/4 not divisible by 3 ranks)" in out
    assert "PASS" not in out


def test_parity_under_torchrun_on_two_gloo_ranks(tmp_path: Path) -> None:
    torchrun = shutil.which("torchrun") or str(Path(sys.executable).with_name("torchrun"))
    if not Path(torchrun).exists():
        pytest.skip("torchrun is not installed next to this python")
    js = tmp_path / "parity.json"
    src = str(Path(__file__).resolve().parents[2] / "src")
    env = {**os.environ, "PYTHONPATH": src, "OMP_NUM_THREADS": "1"}
    for key in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    cmd = [torchrun, "--standalone", "--nproc-per-node", "2", "-m", "cpshard", "parity"]
    cmd += ["--ranks", "2", "--model", "tiny", "--steps", "2", "--seq-len", "32"]
    cmd += ["--methods", "ring", "--layouts", "round_robin,packed", "--json", str(js)]
    proc = subprocess.run(
        cmd, env=env, capture_output=True, text=True, timeout=CALL_DEADLINE_S, check=False
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.count("| model |") == 1  # only rank 0 prints the table
    assert "2 gloo ranks (torchrun)" in proc.stdout
    records = json.loads(js.read_text())
    _check_schema(records, steps=2)
    cp = [r for r in records if r["kind"] == "cp"]
    assert len(cp) == 2 and all(r["launcher"] == "torchrun" and r["world"] == 2 for r in cp)
    assert all(r["passed"] for r in records)


def test_parity_rows_for_the_model_owned_models(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    js = tmp_path / "parity.json"
    argv = ["parity", "--models", "vlm,prefix", "--ranks", "2", "--steps", "2", "--seq-len", "32"]
    argv += ["--methods", "ring", "--json", str(js), "--no-progress"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "| prefix | float32 | dense | global_prefix | own | 2 |" in out
    records = json.loads(js.read_text())
    _check_schema(records, steps=2)
    refs = {(r["model"], r["batch"]) for r in records if r["kind"] == "reference"}
    assert refs == {("vlm", "dense"), ("vlm", "packed"), ("prefix", "dense")}
    got = {(r["model"], r["batch"], r["sharder_layout"], r["method"]) for r in records}
    assert got >= {
        ("vlm", "dense", "round_robin", "ring"),  # the dispatcher's choice after the hook
        ("vlm", "packed", "balanced", "ring"),
        ("prefix", "dense", "global_prefix", "own"),  # the model's own sharder
    }
    assert len(records) == 6
    assert all(r["passed"] for r in records)
