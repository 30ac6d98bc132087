"""Training loops with cpshard: FSDP2 on a dp x cp mesh, and a GRPO-style RL step.

Local CPU ranks (gloo):   python examples/training_loops.py          (4 ranks: dp=2 x cp=2)
Many GPUs (NCCL):         torchrun --nproc-per-node 8 examples/training_loops.py --cp 4

The functions between the README markers are the README's "Training loops" section verbatim (a
test checks that and runs them against one process).
"""

from __future__ import annotations

import argparse
import os
from typing import Any

import torch
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard

import cpshard
from cpshard.launch import run_local_ranks
from cpshard.loss import (
    count_tokens,
    cp_cross_entropy,
    cp_token_mean,
    grad_mean_scale,
    reduce_for_logging,
)
from cpshard.models import TinyDecoder, TinyDecoderConfig
from cpshard.tools.corpus import PAD_ID, VOCAB_SIZE, dense_batch


# --- README: training loops (begin)
def train_step(model, mesh, batch, opt, *, fsdp_over="dp"):
    """One step on a 2-D ("dp", "cp") mesh; `batch` is this dp replica's global batch.

    fsdp_over="dp":    fully_shard(model, mesh=mesh["dp"]) and sync_grads over mesh["cp"].
    fsdp_over="dp_cp": fully_shard over all dp x cp ranks (flattened); FSDP2 reduces everything.
    """
    ctx, local, _ = cpshard.prepare_cp_forward(model, mesh["cp"], batch, padding_token_id=PAD_ID)
    with ctx():
        logits = model(local["input_ids"], local["position_ids"])
    n = count_tokens(local["labels"], group=mesh)  # real tokens of the whole dp x cp step
    scale = grad_mean_scale(mesh["dp"] if fsdp_over == "dp" else mesh)  # FSDP2 averages over it
    loss = cp_cross_entropy(logits, local["labels"], num_tokens=n, scale=scale)
    loss.backward()
    if fsdp_over == "dp":
        cpshard.sync_grads(model, mesh["cp"])  # sum the CP ranks' partial gradients
    opt.step()
    opt.zero_grad(set_to_none=True)
    return reduce_for_logging(loss, mesh, scale=scale)  # the true global per-token loss


def grpo_step(model, cp_mesh, batch, advantages, old_logp, response_mask, opt, clip=0.2):
    """Clipped policy loss on (packed) prompt+response rows; RL tensors in caller [B, S]."""
    ctx, local, sharder = cpshard.prepare_cp_forward(
        model, cp_mesh, batch, padding_token_id=PAD_ID, loss_mask=response_mask
    )
    with ctx():
        logits = model(local["input_ids"], local["position_ids"])
    logp = torch.log_softmax(logits.float(), -1)
    logp = logp.gather(-1, local["labels"].clamp(min=0)[..., None])[..., 0]
    adv = sharder.shard_token_tensor(advantages, fill=0.0)  # caller [B, S] -> this rank's tokens
    old = sharder.shard_token_tensor(old_logp, fill=0.0)
    ratio = torch.exp(logp - old)
    per_token = -torch.minimum(ratio * adv, ratio.clamp(1 - clip, 1 + clip) * adv)
    n = count_tokens(response_mask)  # response tokens of the global batch, no collective
    loss = cp_token_mean(per_token, local["loss_mask"].bool(), num_tokens=n)
    loss.backward()
    cpshard.sync_grads(model, cp_mesh)
    opt.step()
    opt.zero_grad(set_to_none=True)
    new_logp = sharder.gather_token_tensor(logp.detach(), trim=True, fill=0.0)  # caller [B, S]
    return reduce_for_logging(loss, cp_mesh), new_logp


# --- README: training loops (end)


def tiny_model(seed: int = 0) -> TinyDecoder:
    """The example's model: the same weights on every rank."""
    cfg = TinyDecoderConfig(vocab_size=VOCAB_SIZE, hidden_size=32, intermediate_size=64)
    return TinyDecoder.from_config(cfg, seed=seed)


def rl_rows(seed: int = 0) -> dict[str, Any]:
    """Packed prompt+response rows: ``batch``, ``advantages``, ``old_logp``, ``response_mask``."""
    gen = torch.Generator().manual_seed(seed)
    seq_lens, prompts, seq_len = [[9, 8], [6, 7, 5]], [[4, 3], [2, 4, 3]], 20
    ids = torch.full((2, seq_len), PAD_ID, dtype=torch.long)
    response = torch.zeros(2, seq_len, dtype=torch.bool)  # token t is a response token
    adv = torch.zeros(2, seq_len)
    for b, (lens, prompt) in enumerate(zip(seq_lens, prompts, strict=True)):
        start = 0
        for n, p in zip(lens, prompt, strict=True):
            ids[b, start : start + n] = torch.randint(0, 256, (n,), generator=gen)
            response[b, start + p : start + n] = True
            adv[b, start : start + n] = float(torch.randn((), generator=gen))  # per sequence
            start += n
    labels = cpshard.shift_labels_packed(ids, cpshard.PackSpec.from_seq_lens(seq_lens, seq_len))
    mask = torch.zeros_like(response)
    mask[:, :-1] = response[:, 1:]  # position t predicts token t + 1
    mask &= labels != -100
    return {
        "batch": {"input_ids": ids, "labels": labels, "seq_lens": seq_lens},
        "advantages": adv * mask,
        "old_logp": -3 * torch.rand(2, seq_len, generator=gen),
        "response_mask": mask,
    }


def run(mesh: DeviceMesh, steps: int) -> list[float]:
    """FSDP2 steps on the 2-D mesh (both recipes: sharded over dp, then over the flattened dp x
    cp ranks), then GRPO steps on its CP groups; returns the losses."""
    losses = []
    device = mesh.device_type
    flat = init_device_mesh(device, (mesh.size(),), mesh_dim_names=("dp_cp",))
    for fsdp_over in ("dp", "dp_cp"):
        model = tiny_model().to(device)
        fully_shard(model, mesh=mesh["dp"] if fsdp_over == "dp" else flat)
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
        for step in range(steps):
            glob = dense_batch(2 * mesh["dp"].size(), 64, seed=step)
            dp = mesh["dp"].get_local_rank()
            batch = {k: v[2 * dp : 2 * dp + 2].to(device) for k, v in glob.items()}
            losses.append(float(train_step(model, mesh, batch, opt, fsdp_over=fsdp_over)))
    policy = tiny_model().to(device)
    opt = torch.optim.AdamW(policy.parameters(), lr=3e-3)
    for step in range(steps):
        rl = rl_rows(seed=step)
        rl = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in rl.items()}
        rl["batch"] = {
            k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in rl["batch"].items()
        }
        loss, logp = grpo_step(
            policy, mesh["cp"], rl["batch"], rl["advantages"], rl["old_logp"],
            rl["response_mask"], opt,
        )  # fmt: skip
        assert logp.shape == rl["batch"]["input_ids"].shape
        losses.append(float(loss))
    if torch.distributed.get_rank() == 0:
        print(" ".join(f"{x:.4f}" for x in losses))
    return losses


def _local(world_mesh: DeviceMesh, cp: int, steps: int) -> list[float]:
    world = world_mesh.size()
    mesh = init_device_mesh("cpu", (world // cp, cp), mesh_dim_names=("dp", "cp"))
    return run(mesh, steps)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--ranks", type=int, default=4, help="local CPU ranks (without torchrun)")
    p.add_argument("--cp", type=int, default=2, help="CP size (dp = ranks / cp)")
    p.add_argument("--steps", type=int, default=3)
    a = p.parse_args()
    if "LOCAL_RANK" not in os.environ:
        run_local_ranks(a.ranks, _local, a.cp, a.steps)
        return
    torch.distributed.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    world = torch.distributed.get_world_size()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda":
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    run(init_device_mesh(device, (world // a.cp, a.cp), mesh_dim_names=("dp", "cp")), a.steps)
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
