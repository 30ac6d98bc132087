"""The shipped example runs end to end (its own local gloo ranks, in a subprocess)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from _ranks import CALL_DEADLINE_S

pytestmark = pytest.mark.multirank
ROOT = Path(__file__).resolve().parents[2]


def test_train_example_learns() -> None:
    cmd = [sys.executable, str(ROOT / "examples" / "train_cp.py"), "--ranks", "2"]
    cmd += ["--steps", "4", "--seq-len", "64", "--attention", "all_gather"]
    out = subprocess.run(
        cmd, capture_output=True, text=True, timeout=CALL_DEADLINE_S, check=True
    ).stdout
    losses = [float(line.split("loss ")[1].split()[0]) for line in out.splitlines()]
    assert len(losses) == 4
    assert losses[-1] < losses[0]
