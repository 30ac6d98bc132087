"""The README's "Quick start" script, run verbatim as `python quickstart.py` (2 local gloo ranks),
gives the losses of the same script at ``cp_mesh=None``; the local shapes the README states."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from _quickstart_fns import local_shapes
from torch.testing import assert_close

from _ranks import Ranks
from _readme import README, fenced_block

pytestmark = pytest.mark.multirank
SRC = Path(__file__).resolve().parents[2] / "src"


def quickstart() -> str:
    return fenced_block(README.read_text(), "## Quick start")


def test_the_quickstart_script_runs_verbatim_and_matches_no_cp(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    script = tmp_path / "quickstart.py"
    script.write_text(quickstart())
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK")}
    env.update(PYTHONPATH=str(SRC), OMP_NUM_THREADS="1")
    done = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=600,
        cwd=tmp_path,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    cp_losses = ast.literal_eval(done.stdout.strip().splitlines()[-1])
    scope: dict[str, Any] = {"__name__": "readme_quickstart"}
    exec(compile(quickstart(), str(README), "exec"), scope)
    ref = scope["train"](None)  # the same script without CP, in this process
    assert len(cp_losses) == len(ref) == 3
    assert_close(cp_losses, ref, rtol=1e-5, atol=1e-6)
    assert ref[0] != ref[-1]  # it trained


def test_packed_batches_are_one_row_per_rank_as_the_readme_says(ranks: Ranks) -> None:
    text = " ".join(README.read_text().split())
    assert "`[2, 128]` holding 244 real tokens" in text
    assert "becomes `[1, 122]` on each of 2 ranks (`balanced`)" in text
    assert "`[1, 244]` at `cp_mesh=None`" in text
    assert ranks(2, local_shapes) == [((1, 122), "balanced")] * 2
    assert local_shapes(None) == ((1, 244), "balanced")
