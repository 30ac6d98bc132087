"""Faults end runs, never hang them: one rank fails, every other rank exits with an error within
the process-group timeout (isolated processes, short timeout)."""

from __future__ import annotations

import multiprocessing as mp
import queue
import socket
import time

import pytest
from _fault_fns import FAULT_RANK, fault_rank

pytestmark = pytest.mark.multirank

TIMEOUT_S = 4.0  # the process-group timeout of the ranks
SLACK_S = 6.0  # error delivery and process exit on a loaded 2-core machine


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


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
def test_one_rank_fails_every_other_rank_errors(fault: str, attention: str) -> None:
    world = 2
    ctx = mp.get_context("fork")
    out = ctx.Queue()
    port = _free_port()
    procs = [
        ctx.Process(target=fault_rank, args=(r, world, port, fault, attention, TIMEOUT_S, out))
        for r in range(world)
    ]
    for p in procs:
        p.start()
    deadline = time.time() + 60.0
    events: dict[int, list[tuple[str, float, str]]] = {r: [] for r in range(world)}
    try:
        for p in procs:
            p.join(timeout=max(0.1, deadline - time.time()))
        while True:
            try:
                rank, kind, when, text = out.get(timeout=0.5)
            except queue.Empty:
                break
            events[rank].append((kind, when, text))
        hung = [r for r, p in enumerate(procs) if p.is_alive()]
        assert not hung, f"ranks {hung} still running 60 s after start: {events}"
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
    faults = [when for kind, when, _ in events[FAULT_RANK] if kind == "fault"]
    assert faults, f"the fault was never injected: {events}"
    for r in range(world):
        if r == FAULT_RANK:
            continue
        kinds = [kind for kind, _, _ in events[r]]
        assert "ok" not in kinds, f"rank {r} finished as if nothing happened: {events[r]}"
        # an error reported in Python, or a process killed by gloo (e.g. SIGABRT): not a hang
        assert "error" in kinds or procs[r].exitcode != 0, events[r]
        for kind, when, _ in events[r]:
            if kind == "error":
                assert when - faults[0] <= TIMEOUT_S + SLACK_S, (when - faults[0], events[r])
    assert procs[FAULT_RANK].exitcode != 0
    if fault == "caught":  # the out-of-step rank stops itself before pairing wrong collectives
        texts = [text for kind, _, text in events[FAULT_RANK] if kind == "error"]
        assert any("out of step" in t for t in texts), events[FAULT_RANK]
