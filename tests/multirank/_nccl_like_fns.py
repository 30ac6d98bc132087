"""Rank functions: cpshard's public surface over a gloo group that refuses CPU tensors like NCCL.

Each function runs existing rank functions (which compare CP with one process themselves) or
public calls inside :func:`_nccl_like.nccl_like`, and returns how many tensors the checking view
let through per ``torch.distributed`` function, so a test also sees that collectives did run
through it.
"""

from __future__ import annotations

import importlib
from dataclasses import replace
from typing import Any

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.testing import assert_close

import cpshard
from _nccl_like import NcclLikeRefusal, nccl_like
from cpshard import _comm
from cpshard.loss import count_tokens, reduce_for_logging, sync_grads
from cpshard.parity.runners import LaunchedRunner
from cpshard.parity.runs import ParityCase, train_steps
from cpshard.tools.corpus import dense_batch


def refuses_cpu_tensor(cp_mesh: DeviceMesh) -> str:
    """The checking view itself: a CPU tensor handed straight to a collective is refused."""
    with nccl_like():
        try:
            _comm.dist.all_reduce(torch.ones(2), group=cp_mesh.get_group())
        except NcclLikeRefusal as e:
            return str(e)
    raise AssertionError("the NCCL-like view took a CPU tensor")


def existing(cp_mesh: DeviceMesh, module: str, name: str, *args: Any) -> dict[str, int]:
    """Run the rank function ``module.name(cp_mesh, *args)`` inside the NCCL-like view."""
    fn = getattr(importlib.import_module(module), name)
    with nccl_like() as seen:
        fn(cp_mesh, *args)
    return seen.checked


def losses_and_counts(cp_mesh: DeviceMesh) -> dict[str, int]:
    """count_tokens over the group, reduce_for_logging and sync_grads (with a parameter whose
    gradient is None on some ranks): equal to the same calls on plain gloo."""
    rank = cp_mesh.get_local_rank()
    labels = torch.tensor([[1, -100, 3, 4]]) if rank == 0 else torch.tensor([[-100, 2, -100, 5]])

    def run() -> tuple[int, torch.Tensor, list[torch.Tensor | None]]:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.Linear(2, 1))
        x = torch.full((4, 3), float(rank + 1))
        # a CP step's context (sync_grads sums only gradients a CP forward made)
        ctx, _, _ = cpshard.make_cp_batch_and_ctx(cp_mesh, {"input_ids": torch.ones(1, 8).long()})
        with ctx():
            out = model[0](x).sum() if rank == 0 else model(x).sum()  # model[1] unused on rank 0
        out.backward()  # type: ignore[no-untyped-call]
        sync_grads(model, cp_mesh)  # first: its flags were the CPU tensor of issue 16
        n = count_tokens(labels, group=cp_mesh)
        logged = reduce_for_logging(torch.tensor(0.25 * (rank + 1)), cp_mesh)
        return n, logged, [p.grad for p in model.parameters()]

    want = run()
    with nccl_like() as seen:
        got = run()
    assert got[0] == want[0] and torch.equal(got[1], want[1])
    for g, w in zip(got[2], want[2], strict=True):
        assert g is not None and w is not None and torch.equal(g, w)
    return seen.checked


def verbs_and_prepare(cp_mesh: DeviceMesh) -> dict[str, int]:
    """prepare_cp_forward of a tiny decoder, its forward and backward in ctx(), the verbs, all
    three attention methods: equal to plain gloo."""
    from cpshard.models import TinyDecoder, TinyDecoderConfig
    from cpshard.tools.corpus import PAD_ID

    def run(method: str) -> list[torch.Tensor]:
        torch.manual_seed(0)
        model = TinyDecoder(TinyDecoderConfig(hidden_size=16, intermediate_size=32)).double()
        batch = dense_batch(2, 19, seed=1)
        ctx, local, sharder = cpshard.prepare_cp_forward(
            model, cp_mesh, batch, padding_token_id=PAD_ID, attention=method
        )
        with ctx():
            logits = model(local["input_ids"], position_ids=local["position_ids"])
        logp = torch.log_softmax(logits, -1).amax(-1)
        full = sharder.gather_token_tensor(logp, trim=True)
        adv = sharder.shard_token_tensor(torch.arange(38.0).view(2, 19).double(), fill=0.0)
        (full.sum() + (logp * adv).sum()).backward()  # type: ignore[no-untyped-call]
        sync_grads(model, cp_mesh)
        return [full.detach(), adv, *(p.grad for p in model.parameters() if p.grad is not None)]

    seen_all: dict[str, int] = {}
    for method in ("all_gather", "ring", "ulysses"):
        want = run(method)
        with nccl_like() as seen:
            got = run(method)
        for g, w in zip(got, want, strict=True):
            assert_close(g, w, rtol=0, atol=0)
        for k, v in seen.checked.items():
            seen_all[k] = seen_all.get(k, 0) + v
    return seen_all


def parity_rows(cp_mesh: DeviceMesh) -> dict[str, int]:
    """The parity tool's CP side: train_steps (the contract's sync and the injected "mean" sync)
    and the torchrun runner's gathers, equal to plain gloo."""
    case = ParityCase(model="llama", steps=1, seq_len=24, batch_size=1, dtype="float64")
    runner = LaunchedRunner.__new__(LaunchedRunner)  # the group exists: no init_launched
    runner.mesh, runner.device = cp_mesh, "cpu"
    runner.rank, runner.world = cp_mesh.get_local_rank(), cp_mesh.size()
    runner.is_main = runner.rank == 0
    want = [train_steps(cp_mesh, replace(case, grad_sync=s)) for s in ("sum", "mean")]
    want_floats = runner._gather_floats(1.5 + runner.rank)
    with nccl_like() as seen:
        got = [train_steps(cp_mesh, replace(case, grad_sync=s)) for s in ("sum", "mean")]
        got_floats = runner._gather_floats(1.5 + runner.rank)
        agreed = runner.agree(True)
        side = runner.cp_side(case)
    assert got == want and got_floats == want_floats and agreed
    assert (side is not None) == runner.is_main
    return seen.checked
