"""``cpshard plan``: the table's numbers come from the plan and the cost model (no ranks)."""

from __future__ import annotations

import pytest

from cpshard.attention.cost import CostModel
from cpshard.cli.main import main
from cpshard.layouts.balanced import plan_balanced
from cpshard.layouts.documents import PackSpec
from cpshard.names import METHOD_NAMES
from cpshard.tools.plan_cost import method_rows


def test_selective_moves_what_it_receives_and_the_all_gather_c_minus_1_blocks() -> None:
    spec = PackSpec.from_seq_lens([[300, 40, 900, 77, 1200, 5]], 2522)
    rows = {r.method: r for r in method_rows(plan_balanced(spec, 4), CostModel(), [450e9, 50e9])}
    assert tuple(rows) == METHOD_NAMES
    sel, ag = rows["selective"], rows["all_gather"]
    assert sel.moved_over_received == 1.0 and sel.moved_bytes == sel.received_bytes
    slot = 2 * 8 * 128 * 2  # assumed K/V slot bytes: 2 x Hkv x D x bf16
    n = plan_balanced(spec, 4).padded_len // 4
    assert ag.moved_bytes == 3 * n * slot  # (C - 1) L slots, whatever the mask needs
    assert ag.moved_bytes > sel.moved_bytes
    assert ag.pairs_max == sel.pairs_max == rows["ring"].pairs_max
    assert rows["ulysses"].pairs_max / rows["ulysses"].pairs_mean == pytest.approx(1.0, abs=1e-6)
    for r in rows.values():
        assert len(r.modelled_seconds) == 2 and r.modelled_seconds[1] >= r.modelled_seconds[0]
        assert r.plan_seconds is not None and r.plan_seconds >= 0


def test_cli_prints_one_row_per_layout_and_method(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "--seq-lens", "100,200,30", "--cp", "2", "--layouts", "balanced,packed",
                 "--bandwidth", "450", "50", "--no-plan-time"]) == 0  # fmt: skip
    out = capsys.readouterr().out
    table = [line for line in out.splitlines() if line.startswith("| explicit")]
    assert len(table) == 2 * len(METHOD_NAMES)
    assert "model ms @ 450 GB/s" in out and "model ms @ 50 GB/s" in out
    # the remote key slots the queries see are what selective receives (whole slots), not the
    # least any exchange needs: the columns say so
    assert "| received MB | moved/received |" in out and "needed" not in out


def test_cli_rejects_unknown_layouts(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as err:
        main(["plan", "--layouts", "zigzag"])
    assert err.value.code == 2
    assert "--layouts takes a comma list" in capsys.readouterr().err
