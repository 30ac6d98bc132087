"""Train a tiny decoder with context parallelism, in one file.

Local CPU ranks (gloo):   python examples/train_cp.py --ranks 2
Many GPUs (NCCL):         torchrun --nproc-per-node 8 examples/train_cp.py --cp 8

The loop is the same at every CP size: shard the batch, run the model inside ``ctx()``, take a
CP-correct loss, sum gradients over the CP group (``cpshard.sync_grads``), and gather per-token
log-probs back to the caller's coordinates (what an RL trainer would log or reuse).
"""

from __future__ import annotations

import argparse
import os
from datetime import timedelta

import torch
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

import cpshard
from cpshard.launch import run_local_ranks
from cpshard.loss import count_tokens, cp_cross_entropy, reduce_for_logging
from cpshard.models import TinyDecoder, TinyDecoderConfig
from cpshard.tools.corpus import PAD_ID, VOCAB_SIZE, dense_batch


def train(cp_mesh: DeviceMesh, steps: int, seq_len: int, attention: str) -> list[float]:
    device = cp_mesh.device_type
    torch.manual_seed(0)  # the same init on every rank
    model = TinyDecoder(TinyDecoderConfig(vocab_size=VOCAB_SIZE)).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for step in range(steps):
        batch = {k: v.to(device) for k, v in dense_batch(4, seq_len, seed=step).items()}
        ctx, local, sharder = cpshard.prepare_cp_forward(
            model, cp_mesh, batch, padding_token_id=PAD_ID, attention=attention
        )
        with ctx():
            logits = model(local["input_ids"], local["position_ids"])
        loss = cp_cross_entropy(logits, local["labels"], num_tokens=count_tokens(batch["labels"]))
        loss.backward()
        cpshard.sync_grads(model, cp_mesh)  # sum the partial gradients over the CP group
        opt.step()
        opt.zero_grad(set_to_none=True)
        logp = torch.log_softmax(logits.detach().float(), -1)
        token_logp = logp.gather(-1, local["labels"].clamp(min=0)[..., None])[..., 0]
        full_logp = sharder.gather_token_tensor(token_logp, trim=True)  # [4, seq_len], all ranks
        assert full_logp.shape == batch["input_ids"].shape
        losses.append(float(reduce_for_logging(loss, cp_mesh)))
        if cp_mesh.get_local_rank() == 0:
            print(f"step {step}: loss {losses[-1]:.4f} (cp={cp_mesh.size()}, {sharder.layout})")
    return losses


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--ranks", type=int, default=2, help="local CPU ranks (without torchrun)")
    p.add_argument("--cp", type=int, default=0, help="CP size under torchrun (default: world)")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--attention", default="ring", choices=("all_gather", "ring", "ulysses"))
    p.add_argument(
        "--pg-timeout", type=float, default=300.0,
        help="process-group timeout in seconds: if a rank dies, the others fail after this "
        "long instead of hanging (torch's default is 30 minutes)",
    )  # fmt: skip
    a = p.parse_args()
    if "LOCAL_RANK" not in os.environ:  # local CPU ranks over gloo
        run_local_ranks(a.ranks, train, a.steps, a.seq_len, a.attention, pg_timeout_s=a.pg_timeout)
        return
    torch.distributed.init_process_group(
        "nccl" if torch.cuda.is_available() else "gloo", timeout=timedelta(seconds=a.pg_timeout)
    )
    world = torch.distributed.get_world_size()
    cp = a.cp or world
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda":
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    mesh = init_device_mesh(device, (world // cp, cp), mesh_dim_names=("dp", "cp"))
    # each dp replica would train on its own batches; this example feeds them the same ones
    train(mesh["cp"], a.steps, a.seq_len, a.attention)
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
