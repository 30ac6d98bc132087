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


def readme_train_step(world_mesh: DeviceMesh, fsdp_over: str) -> None:
    """train_step on dp=2 x cp=2 equals one SGD step of one process on the global batch."""
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "cp"))
    glob = dense_batch(4, 21, seed=3)
    ref = tl.tiny_model().double()
    ref_loss = cp_cross_entropy(
        ref(glob["input_ids"]), glob["labels"], num_tokens=count_tokens(glob["labels"])
    )
    ref_loss.backward()
    torch.optim.SGD(ref.parameters(), lr=0.5).step()

    model = tl.tiny_model().double()
    fully_shard(model, mesh=mesh["dp"] if fsdp_over == "dp" else world_mesh)
    dp = mesh["dp"].get_local_rank()
    batch = {k: v[2 * dp : 2 * dp + 2] for k, v in glob.items()}
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    loss = tl.train_step(model, mesh, batch, opt, fsdp_over=fsdp_over)
    assert_close(loss, ref_loss.detach())
    want = _params(ref)
    for name, p in _params(model).items():
        assert_close(p, want[name], msg=name, **_TOL)


def readme_grpo_step(cp_mesh: DeviceMesh) -> None:
    """grpo_step under CP equals cp=1: loss, log-probs in caller order, parameters after SGD."""
    rl = tl.rl_rows(seed=5)
    out = {}
    for name, mesh in (("cp1", None), ("cp", cp_mesh)):
        model = tl.tiny_model().double()
        opt = torch.optim.SGD(model.parameters(), lr=0.5)
        loss, logp = tl.grpo_step(
            model, mesh, rl["batch"], rl["advantages"], rl["old_logp"], rl["response_mask"], opt
        )
        out[name] = (loss, logp, _params(model))
    (loss1, logp1, p1), (loss, logp, p) = out["cp1"], out["cp"]
    assert_close(loss, loss1, **_TOL)
    real = rl["batch"]["labels"] != -100
    assert_close(logp[real], logp1[real], **_TOL)
    moved = 0.0
    for name, v in p.items():
        assert_close(v, p1[name], msg=name, **_TOL)
        moved += float((v - _params(tl.tiny_model().double())[name]).abs().sum())
    assert moved > 0  # the step changed the policy
