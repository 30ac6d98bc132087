"""Rank functions that run the README's "Training loops" code (examples/training_loops.py)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import torch
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from torch.testing import assert_close

from cpshard.loss import count_tokens, cp_cross_entropy
from cpshard.tools.corpus import dense_batch

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
if str(EXAMPLES) not in sys.path:
    sys.path.insert(0, str(EXAMPLES))

import training_loops as tl  # noqa: E402

_TOL: dict[str, Any] = {"rtol": 1e-5, "atol": 1e-6}


def _params(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {
        k: (p.full_tensor() if isinstance(p, DTensor) else p).detach()
        for k, p in model.named_parameters()
    }


STEPS = 3


def readme_train_step(world_mesh: DeviceMesh, fsdp_over: str, cp: int) -> None:
    """STEPS calls of train_step on a (world / cp) x cp mesh equal STEPS SGD steps of one process
    on the global batches: the losses and the final weights. train_step writes mesh["cp"] inline
    (a new mesh object on every call: the step record is the CP group's, not the object's)."""
    world = world_mesh.size()
    dp = world // cp
    mesh = init_device_mesh("cpu", (dp, cp), mesh_dim_names=("dp", "cp"))
    globs = [dense_batch(2 * dp, 21, seed=3 + step) for step in range(STEPS)]
    ref = tl.tiny_model().double()
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.5)
    ref_losses = []
    for glob in globs:
        n = count_tokens(glob["labels"])
        ref_loss = cp_cross_entropy(ref(glob["input_ids"]), glob["labels"], num_tokens=n)
        ref_loss.backward()
        ref_opt.step()
        ref_opt.zero_grad(set_to_none=True)
        ref_losses.append(ref_loss.detach())

    model = tl.tiny_model().double()
    fully_shard(model, mesh=mesh["dp"] if fsdp_over == "dp" else world_mesh)  # dp x cp, flat
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    row = mesh["dp"].get_local_rank()
    for glob, ref_loss in zip(globs, ref_losses, strict=True):
        batch = {k: v[2 * row : 2 * row + 2] for k, v in glob.items()}
        loss = tl.train_step(model, mesh, batch, opt, fsdp_over=fsdp_over)
        assert_close(loss, ref_loss, **_TOL)
    want = _params(ref)
    moved = 0.0
    for name, p in _params(model).items():
        assert_close(p, want[name], msg=name, **_TOL)
        moved += float((p - _params(tl.tiny_model().double())[name]).abs().sum())
    assert moved > 0


def readme_grpo_step(cp_mesh: DeviceMesh) -> None:
    """STEPS calls of grpo_step under CP equal cp=1: the losses, the log-probs in caller order,
    the parameters after the last SGD step."""
    rls = [tl.rl_rows(seed=5 + step) for step in range(STEPS)]
    out = {}
    for name, mesh in (("cp1", None), ("cp", cp_mesh)):
        model = tl.tiny_model().double()
        opt = torch.optim.SGD(model.parameters(), lr=0.5)
        steps = []
        for rl in rls:
            loss, logp = tl.grpo_step(
                model, mesh, rl["batch"], rl["advantages"], rl["old_logp"],
                rl["response_mask"], opt,
            )  # fmt: skip
            steps.append((loss, logp))
        out[name] = (steps, _params(model))
    (steps1, p1), (steps, p) = out["cp1"], out["cp"]
    for rl, (loss1, logp1), (loss, logp) in zip(rls, steps1, steps, strict=True):
        assert_close(loss, loss1, **_TOL)
        real = rl["batch"]["labels"] != -100
        assert_close(logp[real], logp1[real], **_TOL)
    moved = 0.0
    for name, v in p.items():
        assert_close(v, p1[name], msg=name, **_TOL)
        moved += float((v - _params(tl.tiny_model().double())[name]).abs().sum())
    assert moved > 0  # the steps changed the policy
