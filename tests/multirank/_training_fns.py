"""Rank functions: training loops as they are written (FSDP2 on dp x cp, RL, accumulation)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from torch.testing import assert_close

import cpshard
import cpshard.loss
import cpshard.tools.corpus
from cpshard.loss import (
    count_tokens,
    cp_cross_entropy,
    grad_mean_scale,
    reduce_for_logging,
)
from cpshard.models import TinyDecoder, TinyDecoderConfig
from cpshard.tools.corpus import PAD_ID, VOCAB_SIZE, dense_batch

_CFG = TinyDecoderConfig(vocab_size=VOCAB_SIZE, hidden_size=32, num_layers=2, intermediate_size=64)


def _model() -> TinyDecoder:
    return TinyDecoder.from_config(_CFG, seed=0).double()


def _full_grads(model: nn.Module) -> dict[str, torch.Tensor]:
    out = {}
    for name, p in model.named_parameters():
        assert p.grad is not None, name
        g = p.grad
        out[name] = g.full_tensor() if isinstance(g, DTensor) else g
    return out


def fsdp2_dp_cp(world_mesh: DeviceMesh, recipe: str) -> None:
    """dp=2 x cp=2 on 4 ranks: both FSDP2 recipes equal one process on the global batch."""
    assert world_mesh.size() == 4
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "cp"))
    dp = mesh["dp"].get_local_rank()
    glob = dense_batch(4, 22, seed=7)
    # one process: the global per-token mean over all 4 rows
    ref = _model()
    n_all = count_tokens(glob["labels"])
    logits = ref(glob["input_ids"])
    ref_loss = cp_cross_entropy(logits, glob["labels"], num_tokens=n_all)
    ref_loss.backward()

    model = _model()
    if recipe == "dp_shard+sync_grads":
        shard_mesh, scale = mesh["dp"], grad_mean_scale(mesh["dp"])
    else:  # fully_shard over the flattened dp x cp ranks (here: the whole world)
        shard_mesh, scale = world_mesh, grad_mean_scale(mesh)
    for block in model.blocks:
        fully_shard(block, mesh=shard_mesh)
    fully_shard(model, mesh=shard_mesh)

    batch = {k: v[2 * dp : 2 * dp + 2] for k, v in glob.items()}  # this dp replica's rows
    ctx, local, _ = cpshard.prepare_cp_forward(model, mesh["cp"], batch, padding_token_id=PAD_ID)
    with ctx():
        out = model(local["input_ids"], local["position_ids"])
    n = count_tokens(local["labels"], group=mesh)  # real tokens of the whole dp x cp step
    assert n == n_all
    loss = cp_cross_entropy(out, local["labels"], num_tokens=n, scale=scale)
    loss.backward()
    if recipe == "dp_shard+sync_grads":
        cpshard.sync_grads(model, mesh["cp"])
    assert_close(reduce_for_logging(loss, mesh, scale=scale), ref_loss.detach())
    want = {k: v for k, v in ((n_, p.grad) for n_, p in ref.named_parameters())}
    got = _full_grads(model)
    for name, g in want.items():
        assert g is not None
        assert_close(got[name], g, msg=name)


def fsdp2_forgotten_sync_is_wrong(world_mesh: DeviceMesh) -> float:
    """Without sync_grads the FSDP2-over-dp gradients are wrong (the test must be able to fail)."""
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "cp"))
    glob = dense_batch(4, 22, seed=7)
    ref = _model()
    cp_cross_entropy(
        ref(glob["input_ids"]), glob["labels"], num_tokens=count_tokens(glob["labels"])
    ).backward()
    model = _model()
    fully_shard(model, mesh=mesh["dp"])
    dp = mesh["dp"].get_local_rank()
    batch = {k: v[2 * dp : 2 * dp + 2] for k, v in glob.items()}
    ctx, local, _ = cpshard.prepare_cp_forward(model, mesh["cp"], batch, padding_token_id=PAD_ID)
    with ctx():
        out = model(local["input_ids"], local["position_ids"])
    n = count_tokens(local["labels"], group=mesh)
    cp_cross_entropy(
        out, local["labels"], num_tokens=n, scale=grad_mean_scale(mesh["dp"])
    ).backward()
    got = _full_grads(model)
    return max(
        float((got[k] - p.grad).abs().max())
        for k, p in ref.named_parameters()
        if p.grad is not None
    )


def sync_grads_errors(world_mesh: DeviceMesh) -> None:
    """A 2-D mesh, a mesh without this rank: clear errors on every rank, before any collective."""
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "cp"))
    model = _model()
    with pytest.raises(ValueError, match="cp_mesh must be 1-D"):
        cpshard.sync_grads(model, mesh)
    rank = world_mesh.get_local_rank()
    other = DeviceMesh("cpu", [r for r in range(4) if r // 2 != rank // 2], _init_backend=False)
    with pytest.raises(ValueError, match="does not contain this rank"):
        cpshard.sync_grads(model, other)
    with pytest.raises(ValueError, match="does not contain this rank"):
        count_tokens(torch.zeros(1, 3), group=other)
    cpshard.sync_grads(model, None)  # no CP: a no-op
    assert all(p.grad is None for p in model.parameters())


def _rl_rows() -> dict[str, Any]:
    """Two packed rows of prompt+response sequences, with per-token RL tensors [B, S]."""
    gen = torch.Generator().manual_seed(11)
    seq_lens = [[9, 8], [6, 7, 5]]  # row 0 ends with 3 pads
    prompt = [[4, 3], [2, 4, 3]]
    bsz, seq_len = 2, 20
    ids = torch.full((bsz, seq_len), PAD_ID, dtype=torch.long)
    response = torch.zeros(bsz, seq_len, dtype=torch.bool)  # token t is a response token
    adv = torch.zeros(bsz, seq_len, dtype=torch.float64)
    for b, (lens, prompts) in enumerate(zip(seq_lens, prompt, strict=True)):
        start = 0
        for n, p in zip(lens, prompts, strict=True):
            ids[b, start : start + n] = torch.randint(0, 256, (n,), generator=gen)
            response[b, start + p : start + n] = True
            adv[b, start : start + n] = float(torch.randn((), generator=gen))  # one per sequence
            start += n
    spec = cpshard.PackSpec.from_seq_lens(seq_lens, seq_len)
    labels = cpshard.shift_labels_packed(ids, spec)
    # loss on predictions of response tokens: position t predicts t + 1
    loss_mask = torch.zeros_like(response)
    loss_mask[:, :-1] = response[:, 1:]
    loss_mask &= labels != -100
    old_logp = -torch.rand(bsz, seq_len, generator=gen, dtype=torch.float64) * 3
    return {
        "batch": {"input_ids": ids, "labels": labels, "seq_lens": seq_lens},
        "loss_mask": loss_mask,
        "advantages": adv * loss_mask,
        "old_logp": old_logp,
    }


def _grpo_step(
    model: nn.Module, cp_mesh: DeviceMesh | None, case: dict[str, Any], mode: str, layout: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """Clipped policy loss under CP: RL tensors in caller [B, S] coordinates."""
    ctx, local, sharder = cpshard.prepare_cp_forward(
        model, cp_mesh, case["batch"], padding_token_id=PAD_ID, loss_mask=case["loss_mask"],
        layout=layout,  # type: ignore[arg-type]
    )  # fmt: skip
    with ctx():
        logits = model(local["input_ids"], local["position_ids"])
    logp = torch.log_softmax(logits, -1)
    logp = logp.gather(-1, local["labels"].clamp(min=0)[..., None])[..., 0]  # [1, L]
    n = count_tokens(case["loss_mask"])  # response tokens of the global batch
    clip = 0.2
    if mode == "local":  # advantages and old log-probs follow the shards
        adv = sharder.shard_token_tensor(case["advantages"], fill=0.0)
        old = sharder.shard_token_tensor(case["old_logp"], fill=0.0)
        mask = local["loss_mask"].bool()
        ratio = torch.exp(logp - old)
        per_tok = -torch.minimum(ratio * adv, ratio.clamp(1 - clip, 1 + clip) * adv)
        loss = cpshard.loss.cp_token_mean(per_tok, mask, num_tokens=n)
    else:  # log-probs gathered to caller coordinates; the same loss on every CP rank
        full = sharder.gather_token_tensor(logp, trim=True, fill=0.0, grad="replicated")
        ratio = torch.exp(full - case["old_logp"])
        adv = case["advantages"]
        per_tok = -torch.minimum(ratio * adv, ratio.clamp(1 - clip, 1 + clip) * adv)
        # the whole loss on every rank: grad="replicated" keeps each rank's own tokens' share
        loss = (per_tok * case["loss_mask"]).sum() / n
    loss.backward()
    cpshard.sync_grads(model, cp_mesh)
    gathered = sharder.gather_token_tensor(logp.detach(), trim=True, fill=0.0)
    replicas = sharder.cp_size if mode == "gathered" else 1
    return reduce_for_logging(loss, cp_mesh, scale=replicas), gathered


def grpo_packed_step(cp_mesh: DeviceMesh, mode: str, layout: str) -> None:
    """A GRPO-style step on packed prompt+response rows equals cp=1: loss, grads, log-probs."""
    case = _rl_rows()
    ref = _model()
    ref_loss, ref_logp = _grpo_step(ref, None, case, mode, layout)
    model = _model()
    loss, logp = _grpo_step(model, cp_mesh, case, mode, layout)
    assert_close(loss, ref_loss)
    real = case["batch"]["labels"] != -100
    assert_close(logp[real], ref_logp[real])
    assert logp.shape == (2, 20)
    for (name, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
        assert p.grad is not None and q.grad is not None, name
        assert_close(p.grad, q.grad, msg=name)
    assert float(ref_loss.abs()) > 0


def _micro_batches(step: int) -> list[dict[str, Any]]:
    """Two micro-batches per step: dense rows and a packed stream, lengths change every step."""
    dense = dense_batch(2, 15 + 3 * step, seed=step)
    ids, lens = cpshard.tools.corpus.packed_batch(24 + 5 * step, max_doc_len=9, seed=100 + step)
    spec = cpshard.PackSpec.from_seq_lens([lens], ids.shape[1])
    packed = {
        "input_ids": ids,
        "labels": cpshard.shift_labels_packed(ids, spec),
        "seq_lens": [lens],
    }
    return [dense, packed]


def _train(cp_mesh: DeviceMesh | None, steps: int) -> tuple[list[float], nn.Module]:
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    losses = []
    for step in range(steps):
        micro = _micro_batches(step)
        n = sum(count_tokens(m["labels"]) for m in micro)  # the step's tokens, all micro-batches
        total = torch.zeros((), dtype=torch.float64)
        for m in micro:
            ctx, local, _ = cpshard.prepare_cp_forward(model, cp_mesh, m, padding_token_id=PAD_ID)
            with ctx():
                logits = model(local["input_ids"], local["position_ids"])
            loss = cp_cross_entropy(logits, local["labels"], num_tokens=n)
            loss.backward()  # accumulate
            total = total + reduce_for_logging(loss, cp_mesh)
        cpshard.sync_grads(model, cp_mesh)  # once per step, after the last micro-batch
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(total))
    return losses, model


def accumulation_adamw(cp_mesh: DeviceMesh) -> None:
    """5 AdamW steps of 2 micro-batches (dense + packed, changing lengths) equal cp=1."""
    ref_losses, ref = _train(None, 5)
    losses, model = _train(cp_mesh, 5)
    assert_close(torch.tensor(losses), torch.tensor(ref_losses))
    assert ref_losses[-1] < ref_losses[0]
    for (name, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
        assert_close(p, q, msg=name)


def _router_load(local: dict[str, Any], vocab: int) -> torch.Tensor:
    """A token-counting consumer (an MoE router's load): real tokens per id, pads left out."""
    real = ~local["padding_mask"]
    return torch.bincount(local["input_ids"][real], minlength=vocab)


def pads_visible_to_consumers(cp_mesh: DeviceMesh, layout: str) -> None:
    """padding_mask marks every CP pad slot: the consumer sees the same tokens at cp=1 and N."""
    ids, lens = cpshard.tools.corpus.packed_batch(37, max_doc_len=11, seed=3)
    if layout == "dense":
        batch: dict[str, Any] = dense_batch(3, 13, seed=2)  # attention_mask -> padding_mask
    else:
        batch = {"input_ids": ids, "seq_lens": [lens]}
    kw: dict[str, Any] = {"padding_token_id": PAD_ID}
    if layout != "dense":
        kw["layout"] = layout
    _, ref, _ = cpshard.make_cp_batch_and_ctx(None, batch, **kw)
    _, local, sharder = cpshard.make_cp_batch_and_ctx(cp_mesh, batch, **kw)
    assert "padding_mask" in ref and "padding_mask" in local
    load = _router_load(local, VOCAB_SIZE)
    total = load.clone()
    torch.distributed.all_reduce(total, group=cp_mesh.get_group())
    assert torch.equal(total, _router_load(ref, VOCAB_SIZE))
    real = batch["input_ids"] != PAD_ID
    assert int(total.sum()) == int(real.sum())
    # the CP pads (if any) are all marked: exactly the slots beyond the real tokens
    pads = int(local["padding_mask"].sum())
    all_pads = torch.tensor([pads])
    torch.distributed.all_reduce(all_pads, group=cp_mesh.get_group())
    assert sharder.padded_seq_len is not None
    rows = local["input_ids"].shape[0]
    assert int(all_pads) == rows * sharder.padded_seq_len - int(real.sum())


def sync_grads_partial_none(cp_mesh: DeviceMesh) -> None:
    """A parameter used on some CP ranks only is summed everywhere; an unused one stays None."""
    rank = cp_mesh.get_local_rank()
    torch.manual_seed(0)
    used, sometimes, never = nn.Linear(3, 3), nn.Linear(3, 3), nn.Linear(3, 3)
    frozen = nn.Linear(3, 3).requires_grad_(False)
    model = nn.ModuleList([used, sometimes, never, frozen])
    x = torch.full((1, 3), float(rank + 1))
    # a CP step's context (sync_grads sums only gradients a CP forward made)
    ctx, _, _ = cpshard.make_cp_batch_and_ctx(cp_mesh, {"input_ids": torch.ones(1, 8).long()})
    with ctx():
        out = used(x).sum()
        if rank == 0:
            out = out + sometimes(x).sum()
    out.backward()
    cpshard.sync_grads(model, cp_mesh)
    world = cp_mesh.size()
    assert used.weight.grad is not None and sometimes.weight.grad is not None
    total = sum(r + 1 for r in range(world))
    assert_close(used.weight.grad, torch.full((3, 3), float(total)))
    assert_close(sometimes.weight.grad, torch.full((3, 3), 1.0))  # rank 0's x only
    assert never.weight.grad is None and frozen.weight.grad is None
