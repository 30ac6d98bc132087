"""Fault injection on isolated gloo ranks: one rank fails mid-step, the others must not hang.

Each rank is its own forked process (not the shared pool of ``tests/_ranks.py``) with a short
process-group timeout, so a broken group can never poison other tests.
"""

from __future__ import annotations

import os
import time
import traceback
from datetime import timedelta
from typing import Any

import torch

FAULT_RANK = 1
FAULT_STEP = 1
STALL_S = 12.0  # a stalled rank stays alive this long without joining the collective


class InjectedFault(RuntimeError):
    """The failure a test injects."""


def _fail(fault: str, out: Any) -> None:
    out.put((FAULT_RANK, "fault", time.time(), fault))
    if fault == "stall":  # alive but absent: only the process-group timeout can end the wait
        time.sleep(STALL_S)
    if fault == "exit":
        out.close()
        out.join_thread()
        os._exit(3)
    raise InjectedFault(f"injected {fault} on rank {FAULT_RANK}")


def _step(model: Any, cp_mesh: Any, step: int, attention: str, fault: str, out: Any) -> None:
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


def fault_rank(
    rank: int, world: int, port: int, fault: str, attention: str, timeout_s: float, out: Any
) -> None:
    """One rank of a short training loop; ``fault`` is injected on rank ``FAULT_RANK``."""
    import faulthandler

    faulthandler.disable()  # a gloo abort is an expected outcome here, not a crash report
    torch.set_num_threads(1)
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from cpshard.models import TinyDecoder, TinyDecoderConfig
    from cpshard.tools.corpus import VOCAB_SIZE

    status = 0
    try:
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=world,
            timeout=timedelta(seconds=timeout_s),
        )
        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("cp",))
        torch.manual_seed(0)
        model = TinyDecoder(TinyDecoderConfig(vocab_size=VOCAB_SIZE))
        for step in range(4):
            try:
                _step(model, mesh, step, attention, fault, out)
            except InjectedFault:
                if fault != "caught":
                    raise
                model.zero_grad(set_to_none=True)  # a skip-bad-batch loop: carry on
        out.put((rank, "ok", time.time(), ""))
    except BaseException as e:
        status = 1
        out.put((rank, "error", time.time(), f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))
    out.close()
    out.join_thread()
    os._exit(status)  # no destroy_process_group: the group is broken
