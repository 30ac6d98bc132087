"""``bash benchmarks/gpu_check.sh --dry-run`` starts and finishes on the CPU with this python,
pytest-timeout off (as in the GPU image), and leaves every file the GPU run returns."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

pytestmark = pytest.mark.multirank

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "gpu_check.sh"


def _env(out: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "OUT")}
    return {**env, "OUT": str(out), "PYTHON": sys.executable, "OMP_NUM_THREADS": "1"}


def test_dry_run_writes_every_file(tmp_path: Path) -> None:
    # Bounded by the script's own step limits (at most 6 minutes); this only catches a runaway.
    proc = subprocess.run(
        ["bash", str(SCRIPT), "--dry-run"],
        env=_env(tmp_path), capture_output=True, text=True, timeout=900, check=False,
    )  # fmt: skip
    summary = (tmp_path / "gpu_check_summary.txt").read_text()
    assert proc.returncode == 0, summary + proc.stdout[-4000:] + proc.stderr[-2000:]
    assert summary.count(": ok (exit 0)") == 4, summary
    log = (tmp_path / "gpu_check.log").read_text()
    assert "=== step bench: ok" in log and "gpu_check.sh: ok" in log
    for name in ("kernels", "gpu_tests"):  # junit written (collection only: no test ran)
        suite = ET.parse(tmp_path / f"junit_{name}.xml").getroot().find("testsuite")
        assert suite is not None and suite.get("errors") == "0", name
    # both pytest steps collected the GPU tests under the repo's --strict-config, no plugin
    collected = [int(n) for n in re.findall(r"^(\d+) tests? collected", log, re.M)]
    assert len(collected) == 2 and collected[0] >= 40 and collected[1] >= 10, collected
    records = json.loads((tmp_path / "parity_dry_run.json").read_text())
    assert records and all(r["passed"] for r in records)
    table = (tmp_path / "gpu_check_results.md").read_text()
    assert "ranks=2" in table and "| packed |" in table and "error" not in table.lower()


def test_gpu_run_without_cuda_says_so(tmp_path: Path) -> None:
    proc = subprocess.run(
        ["bash", str(SCRIPT)], env=_env(tmp_path), capture_output=True, text=True, timeout=900,
        check=False,
    )  # fmt: skip
    assert proc.returncode == 1
    assert "no CUDA device: run bash benchmarks/gpu_check.sh --dry-run" in proc.stdout


def test_unknown_argument_is_refused(tmp_path: Path) -> None:
    proc = subprocess.run(
        ["bash", str(SCRIPT), "--dryrun"], env=_env(tmp_path), capture_output=True, text=True,
        timeout=600, check=False,
    )  # fmt: skip
    assert proc.returncode == 2 and "usage:" in proc.stderr
