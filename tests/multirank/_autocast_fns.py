"""Rank functions of ``test_autocast.py``: a plain training loop under ``torch.autocast(bf16)``.

A tiny HF Llama (fp32 weights) trains 3 SGD steps with its forward, loss and backward inside
``torch.autocast("cpu", dtype=torch.bfloat16)``: its SDPA calls get fp32 q/k (RoPE in fp32) and
a bf16 v, which CP attention casts to bf16 as SDPA does (before the fix every rank raised "q, k,
v must share a dtype", at cp=1 too). The same loop in one process without cpshard (the stock
model, transformers' SDPA), also under autocast, is the reference.

Tolerances (bf16 on both sides, see :data:`LOSS_TOL` / :data:`WEIGHT_TOL`): bf16 keeps 8 bits
of mantissa (unit roundoff 2^-8 ~ 3.9e-3), and CP attention sums in another order than SDPA's
CPU flash kernel (key blocks per rank, merged in fp32), so the attention outputs differ by about
one bf16 ulp and so do the gradients behind them. Measured (3 steps, cp=2 and 3, every method):
loss differences <= 1e-4 relative, weight differences <= ~4e-4 absolute, about what one process
in bf16 differs from one process in fp32; the weights move by ~0.1, and an attention that is
wrong (local to the shard) moves them differently by more than 1e-2.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.testing import assert_close

import cpshard
from cpshard.loss import count_tokens, cp_cross_entropy, reduce_for_logging

STEPS = 3
LOSS_TOL = {"rtol": 1e-3, "atol": 1e-5}
WEIGHT_TOL = {"rtol": 1e-2, "atol": 2e-3}


def _model() -> Any:
    import transformers

    cfg = transformers.LlamaConfig(
        vocab_size=64, hidden_size=48, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=12, num_key_value_heads=6, use_cache=False,  # ulysses at C = 2, 3
        attn_implementation="sdpa",
    )  # fmt: skip
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg)


def _train(cp_mesh: DeviceMesh | None, attention: str) -> tuple[list[float], Any]:
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    losses = []
    for step in range(STEPS):
        gen = torch.Generator().manual_seed(step)
        ids = torch.randint(3, 64, (2, 24 + 6 * step), generator=gen)  # lengths change
        batch = {"input_ids": ids, "labels": cpshard.shift_labels(ids)}
        n = count_tokens(batch["labels"])
        with torch.autocast("cpu", dtype=torch.bfloat16):
            if cp_mesh is None:  # the stock model in one process: transformers' own SDPA
                out, labels = model(input_ids=ids), batch["labels"]
            else:
                ctx, local, _ = cpshard.prepare_cp_forward(
                    model, cp_mesh, batch, attention=attention
                )
                with ctx():
                    out = model(input_ids=local["input_ids"], position_ids=local["position_ids"])
                labels = local["labels"]
            assert out.logits.dtype == torch.bfloat16
            loss = cp_cross_entropy(out.logits, labels, num_tokens=n)
            loss.backward()  # inside autocast too (the methods' backward switches it off)
        cpshard.sync_grads(model, cp_mesh)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(reduce_for_logging(loss.detach(), cp_mesh)))
    return losses, model


def autocast_loop(cp_mesh: DeviceMesh, attention: str) -> tuple[float, float, float]:
    """3 SGD steps under autocast(bf16) with CP == the same loop in one process (bf16 tol).

    Returns:
        The largest loss difference, the largest weight difference, and how far the reference's
        weights moved from their initial values.
    """
    ref_losses, ref = _train(None, attention)
    losses, model = _train(cp_mesh, attention)
    assert_close(torch.tensor(losses), torch.tensor(ref_losses), **LOSS_TOL)
    init = _model().state_dict()
    moved = diff = 0.0
    for (name, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
        assert_close(p, q, **WEIGHT_TOL, msg=name)
        diff = max(diff, float((p - q).abs().max()))
        moved = max(moved, float((q - init[name]).abs().max()))
    assert moved > 20 * WEIGHT_TOL["atol"], moved  # the weights trained
    loss_diff = max(abs(a - b) for a, b in zip(losses, ref_losses, strict=True))
    return loss_diff, diff, moved
