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
