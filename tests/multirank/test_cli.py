"""The ``cpshard`` command end to end (it launches its own local gloo ranks)."""

from __future__ import annotations

import pytest

from cpshard.cli.main import main

pytestmark = pytest.mark.multirank


def test_layouts_demo_round_trips(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["layouts", "--ranks", "3", "--seq-len", "13"]) == 0
    out = capsys.readouterr().out
    assert "all round trips exact" in out
    assert out.count("round trip ok") == 6
    assert "rank 2: owns [6,9) [9,12)" not in out  # runs are merged into maximal ranges
    assert "rank 2: owns [6,12)" in out  # round_robin, C=3, P=18: chunks 2 and 3 are adjacent


def test_help_lists_commands(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["--help"])
    assert "layouts" in capsys.readouterr().out


@pytest.mark.parametrize("model", ["tiny", "llama"])
def test_parity_command_passes(model: str, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["parity", "--model", model, "--ranks", "2", "--steps", "2", "--seq-len", "48"]
    argv += ["--methods", "ring,ulysses", "--layouts", "round_robin,balanced"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert out.count("| yes |") == 6  # 2 native checks + 2 layouts x 2 methods
    assert "PASS" in out


def test_parity_reports_indivisible_heads_for_ulysses(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["parity", "--model", "tiny", "--ranks", "3", "--steps", "1", "--seq-len", "30"]
    argv += ["--methods", "ulysses,all_gather", "--layouts", "contiguous"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "skipped: heads 8/4 not divisible by 3 ranks" in out


def test_parity_rejects_unknown_names() -> None:
    with pytest.raises(SystemExit, match="--methods takes a comma list"):
        main(["parity", "--methods", "flash"])
