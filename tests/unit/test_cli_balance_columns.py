"""``cpshard balance`` defines every column of its table, in the output and in ``--help``."""

from __future__ import annotations

import pytest

from cpshard.cli.main import main
from cpshard.tools.balance import COLUMNS


def test_every_column_is_defined_in_output(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["balance", "--seq-lens", "100,200,3000", "--cp", "3", "--no-torch"]) == 0
    out = capsys.readouterr().out
    header = out.splitlines()[0]
    assert header == "| " + " | ".join(COLUMNS) + " |"
    legend = out.split("columns:", 1)[1]
    for name in ("imbalance", "padding", "remote K/V max", "remote K/V mean", "plan ms"):
        assert f"  {name}: " in legend
    assert "max / mean causal attention work per rank" in " ".join(legend.split())


def test_every_column_is_defined_in_help(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["balance", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    for name, text in COLUMNS.items():
        assert f"{name}: {' '.join(text.split())}" in out
    assert "(default: 32768)" in out  # defaults are shown
