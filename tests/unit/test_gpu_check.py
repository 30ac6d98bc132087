"""benchmarks/gpu_check.sh fits a short GPU run: its steps' limits add up to at most 6 minutes,
only its step runner sets a limit, and no wait inside the GPU tests is longer than 60 s."""

from __future__ import annotations

import ast
import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "gpu_check.sh"
GPU_TESTS = ROOT / "tests" / "gpu"
BUDGET_S = 6 * 60
INNER_MAX_S = 60.0
_TIMEOUT_KWARGS = {"timeout", "timeout_s", "pg_timeout_s"}


def _budget() -> tuple[dict[str, tuple[int, int]], int]:
    out = subprocess.run(
        ["bash", str(SCRIPT), "--budget"], capture_output=True, text=True, check=True, timeout=600
    ).stdout
    steps = {
        m[1]: (int(m[2]), int(m[3])) for m in re.finditer(r"^step (\w+) (\d+) (\d+)$", out, re.M)
    }
    total = re.search(r"^total (\d+) budget (\d+)$", out, re.M)
    assert total is not None, out
    return steps, int(total[1])


def test_steps_add_up_to_six_minutes() -> None:
    steps, total = _budget()
    assert list(steps) == ["probe", "kernels", "gpu_tests", "bench"]
    assert total == sum(limit + grace for limit, grace in steps.values())
    assert total <= BUDGET_S, f"{total}s of steps for a {BUDGET_S}s run"
    text = SCRIPT.read_text()
    fault = int(re.search(r"^FAULT_S=(\d+)", text, re.M)[1])  # type: ignore[index]
    bench = int(re.search(r"^BENCH_BUDGET_S=(\d+)", text, re.M)[1])  # type: ignore[index]
    assert fault < min(limit for name, (limit, _) in steps.items() if name != "probe")
    assert bench < steps["bench"][0]


def test_only_the_step_runner_sets_a_limit() -> None:
    calls = [ln for ln in SCRIPT.read_text().splitlines() if re.search(r"(^|\s)timeout\s", ln)]
    assert len(calls) == 1, calls
    assert 'timeout -s INT -k "$grace" "$limit"' in calls[0]  # SIGINT first: pytest reports


def _literal_timeouts(path: Path) -> list[tuple[int, str, float]]:
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if (
            isinstance(node, ast.keyword)
            and node.arg in _TIMEOUT_KWARGS
            and isinstance(node.value, ast.Constant)
            and isinstance(node.value.value, int | float)
        ):
            found.append((node.lineno, node.arg, float(node.value.value)))
    return found


@pytest.mark.parametrize("path", sorted(GPU_TESTS.glob("*.py")), ids=lambda p: p.name)
def test_gpu_tests_wait_at_most_a_minute(path: Path) -> None:
    too_long = [t for t in _literal_timeouts(path) if t[2] > INNER_MAX_S]
    assert not too_long, f"{path.name}: waits over {INNER_MAX_S}s: {too_long}"
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):  # every pool and every call of one names its bound
        if isinstance(node, ast.Call) and getattr(node.func, "id", "") == "LocalRanks":
            assert any(k.arg == "pg_timeout_s" for k in node.keywords), ast.unparse(node)
        if isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "run":
            names = {k.arg for k in node.keywords}
            assert names & {"timeout_s", "timeout"}, f"{path.name}: {ast.unparse(node)}"


def test_gpu_bounds_are_at_most_a_minute() -> None:
    import sys

    sys.path.insert(0, str(GPU_TESTS))
    try:
        import _gpu_fns
    finally:
        sys.path.remove(str(GPU_TESTS))
    bounds = (_gpu_fns.PG_TIMEOUT_S, _gpu_fns.CALL_TIMEOUT_S, _gpu_fns.PARITY_TIMEOUT_S)
    assert all(0 < b <= INNER_MAX_S for b in bounds), bounds
    parity = (GPU_TESTS / "test_gpu_parity_cli.py").read_text()
    inner = re.search(r'"--timeout", "(\d+)"', parity)
    assert inner is not None and float(inner[1]) < _gpu_fns.PARITY_TIMEOUT_S
