"""Faults end runs, never hang them: one rank fails, every other rank exits with an error within
the process-group timeout (a pool of its own per case, short timeout)."""

from __future__ import annotations

from pathlib import Path

import pytest
from _fault_fns import FAULT_RANK, fault_rank, read_events

from cpshard.tools.launch import LocalRanks, RankFailure

pytestmark = pytest.mark.multirank

TIMEOUT_S = 10.0  # the process-group timeout of the ranks (a correct step is far below it)
SLACK_S = 60.0  # error delivery and process exit on a loaded 2-core machine
WAIT_S = 300.0  # how long every rank may take to end on its own (the launcher kills none earlier)


@pytest.mark.parametrize(
    ("fault", "attention"),
    [
        ("forward", "all_gather"),
        ("forward", "ring"),
        ("backward", "ring"),
        ("exit", "all_gather"),
        ("caught", "all_gather"),
        ("stall", "ring"),
    ],
)
def test_one_rank_fails_every_other_rank_errors(fault: str, attention: str, tmp_path: Path) -> None:
    world = 2
    # grace_s = WAIT_S: after the fault the launcher waits for every rank's own end, so a rank
    # that would hang shows up as "no answer" instead of being killed early
    with (
        LocalRanks(world, pg_timeout_s=TIMEOUT_S, grace_s=WAIT_S) as pool,
        pytest.raises(RankFailure) as err,
    ):
        pool.run(fault_rank, fault, attention, str(tmp_path), timeout_s=WAIT_S)
    outcomes = err.value.outcomes
    events = {r: read_events(str(tmp_path), r) for r in range(world)}
    hung = [o.rank for o in outcomes if o.status == "no answer"]
    assert not hung, f"ranks {hung} still running {WAIT_S} s after start: {events}"
    faults = [when for kind, when, _ in events[FAULT_RANK] if kind == "fault"]
    assert faults, f"the fault was never injected: {events}"
    for r in range(world):
        if r == FAULT_RANK:
            continue
        kinds = [kind for kind, _, _ in events[r]]
        assert "ok" not in kinds, f"rank {r} finished as if nothing happened: {events[r]}"
        # an error reported in Python, or a process killed by gloo (e.g. SIGABRT): not a hang
        assert "error" in kinds or outcomes[r].status == "died", (events[r], outcomes[r])
        for kind, when, _ in events[r]:
            if kind == "error":
                assert when - faults[0] <= TIMEOUT_S + SLACK_S, (when - faults[0], events[r])
    assert outcomes[FAULT_RANK].status in ("raised", "died"), outcomes[FAULT_RANK]
    if fault == "exit":
        assert outcomes[FAULT_RANK].detail == "exit code 3", outcomes[FAULT_RANK]
    if fault == "caught":  # the out-of-step rank stops itself before pairing wrong collectives
        texts = [text for kind, _, text in events[FAULT_RANK] if kind == "error"]
        assert any("out of step" in t for t in texts), events[FAULT_RANK]
