"""Fault injection on isolated gloo ranks: one rank fails mid-step, the others must not hang.

The ranks are a pool of their own (:class:`cpshard.tools.launch.LocalRanks`, not the shared pool
of ``tests/_ranks.py``) with a short process-group timeout, so a broken group can never poison
other tests. Each rank appends its events (``fault``, ``error``, ``ok``, with ``time.time()``) as
JSON lines to ``<events_dir>/rank<r>.jsonl``: a rank may die before it can answer the launcher.
"""

from __future__ import annotations

import json
import os
import time
import traceback
from pathlib import Path
from typing import Any

import torch
from torch.distributed.device_mesh import DeviceMesh

FAULT_RANK = 1
FAULT_STEP = 1
STALL_S = 25.0  # a stalled rank stays absent this long, past the tests' 10 s pg timeout


class InjectedFault(RuntimeError):
    """The failure a test injects."""


def log_event(events_dir: str, rank: int, kind: str, text: str = "") -> None:
    """Append one event of ``rank`` to its file (written through at once)."""
    with open(Path(events_dir) / f"rank{rank}.jsonl", "a") as f:
        f.write(json.dumps([kind, time.time(), text]) + "\n")


def read_events(events_dir: str, rank: int) -> list[tuple[str, float, str]]:
    """The events ``rank`` logged, in order."""
    path = Path(events_dir) / f"rank{rank}.jsonl"
    if not path.exists():
        return []
    return [(k, t, x) for k, t, x in map(json.loads, path.read_text().splitlines())]


def _fail(fault: str, out: str) -> None:
    log_event(out, FAULT_RANK, "fault", fault)
    if fault == "stall":  # alive but absent: only the process-group timeout can end the wait
        time.sleep(STALL_S)
    if fault == "exit":
        os._exit(3)
    raise InjectedFault(f"injected {fault} on rank {FAULT_RANK}")


def _step(model: Any, cp_mesh: Any, step: int, attention: str, fault: str, out: str) -> None:
    import cpshard
    from cpshard.loss import count_tokens, cp_cross_entropy
    from cpshard.tools.corpus import PAD_ID, dense_batch

    rank = cp_mesh.get_local_rank()
    inject = rank == FAULT_RANK and step == FAULT_STEP
    batch = dense_batch(2, 64, seed=step)
    ctx, local, _ = cpshard.prepare_cp_forward(
        model, cp_mesh, batch, padding_token_id=PAD_ID, attention=attention
    )
    handle = None
    if inject and fault in ("forward", "exit", "caught", "stall"):
        # fails after the first layer's attention collective, inside the forward
        handle = model.blocks[1].register_forward_pre_hook(lambda *a: _fail(fault, out))
    try:
        with ctx():
            logits = model(local["input_ids"], local["position_ids"])
    finally:
        if handle is not None:
            handle.remove()
    if inject and fault == "backward":
        logits.register_hook(lambda g: _fail(fault, out))
    loss = cp_cross_entropy(logits, local["labels"], num_tokens=count_tokens(batch["labels"]))
    loss.backward()


def fault_rank(cp_mesh: DeviceMesh, fault: str, attention: str, events_dir: str) -> None:
    """One rank of a short training loop; ``fault`` is injected on rank ``FAULT_RANK``."""
    import faulthandler

    faulthandler.disable()  # a gloo abort is an expected outcome here, not a crash report
    from cpshard.models import TinyDecoder, TinyDecoderConfig
    from cpshard.tools.corpus import VOCAB_SIZE

    rank = cp_mesh.get_local_rank()
    try:
        torch.manual_seed(0)
        model = TinyDecoder(TinyDecoderConfig(vocab_size=VOCAB_SIZE))
        for step in range(4):
            try:
                _step(model, cp_mesh, step, attention, fault, events_dir)
            except InjectedFault:
                if fault != "caught":
                    raise
                model.zero_grad(set_to_none=True)  # a skip-bad-batch loop: carry on
        log_event(events_dir, rank, "ok")
    except BaseException as e:
        log_event(events_dir, rank, "error", f"{type(e).__name__}: {e}\n{traceback.format_exc()}")
        raise
