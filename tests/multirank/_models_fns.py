"""Rank functions: the shipped model-owned models (TinyVLM, GlobalPrefixDecoder) under CP."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.testing import assert_close

import cpshard
from cpshard.loss import count_tokens, cp_cross_entropy, reduce_for_logging
from cpshard.models import GlobalPrefixConfig, GlobalPrefixDecoder, TinyVLM


def _vlm_case() -> tuple[nn.Module, dict[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(5)
    ids = torch.randint(0, 259, (2, 23), generator=gen)
    ids[0, 1:7] = 259  # images of 3 patches: two in row 0, one in row 1
    ids[1, 12:15] = 259
    batch = {
        "input_ids": ids,
        "pixel_values": torch.randn(3, 3, 16, generator=gen, dtype=torch.float64),
        "labels": cpshard.shift_labels(ids),
    }
    return TinyVLM.from_config(seed=4).double(), batch


def _prefix_case() -> tuple[nn.Module, dict[str, torch.Tensor]]:
    ids = torch.randint(0, 259, (2, 27), generator=torch.Generator().manual_seed(6))
    cfg = GlobalPrefixConfig(num_global_tokens=3, block_size=4)
    return GlobalPrefixDecoder.from_config(cfg, seed=4).double(), {
        "input_ids": ids,
        "labels": cpshard.shift_labels(ids),
    }


def _forward(model: nn.Module, local: dict[str, Any]) -> torch.Tensor:
    if "inputs_embeds" in local:
        out: torch.Tensor = model(
            inputs_embeds=local["inputs_embeds"], position_ids=local["position_ids"]
        )
        return out
    out = model(local["input_ids"], local["position_ids"])
    return out


def model_owned_parity(cp_mesh: DeviceMesh, which: str, attention: str) -> None:
    """Loss and every gradient (vision encoder included) under CP equal one process's."""
    model, batch = _vlm_case() if which == "vlm" else _prefix_case()
    ref_model, _ = _vlm_case() if which == "vlm" else _prefix_case()
    n = count_tokens(batch["labels"])
    if which == "vlm":
        full = ref_model(batch["input_ids"], pixel_values=batch["pixel_values"])
    else:
        full = ref_model(batch["input_ids"])
    ref_loss = cp_cross_entropy(full, batch["labels"], num_tokens=n)
    ref_loss.backward()

    ctx, local, sharder = cpshard.prepare_cp_forward(model, cp_mesh, batch, attention=attention)
    with ctx():
        logits = _forward(model, local)
    loss = cp_cross_entropy(logits, local["labels"], num_tokens=n)
    loss.backward()
    cpshard.sync_grads(model, cp_mesh)
    assert_close(reduce_for_logging(loss, cp_mesh), ref_loss.detach())
    for (name, p), q in zip(model.named_parameters(), ref_model.parameters(), strict=True):
        assert p.grad is not None, name
        assert q.grad is not None, name
        assert_close(p.grad, q.grad, msg=name)
    if which == "vlm":
        grad = model.vision.patch.weight.grad  # type: ignore[union-attr]
        assert grad is not None and float(grad.abs().sum()) > 0
    # per-token log-probs back in caller coordinates equal the reference
    logp = torch.log_softmax(logits.detach(), -1)
    tok = logp.gather(-1, local["labels"].clamp(min=0)[..., None])[..., 0]
    fill = 0.0 if sharder.input_token_stream_positions is not None else None
    got = sharder.gather_token_tensor(tok, trim=True, fill=fill)
    ref_logp = torch.log_softmax(full.detach(), -1)
    ref_tok = ref_logp.gather(-1, batch["labels"].clamp(min=0)[..., None])[..., 0]
    keep = batch["labels"] != -100
    assert_close(got[keep], ref_tok[keep])


def vlm_fsdp2_dp_cp(world_mesh: DeviceMesh) -> None:
    """TinyVLM under FSDP2 (dp=2) x CP (cp=2): the hook runs through __call__, so FSDP2
    unshards the vision encoder for it; loss and every gradient equal one process."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    from cpshard.loss import grad_mean_scale
    from cpshard.models import with_images

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "cp"))
    ids = torch.randint(0, 259, (4, 19), generator=torch.Generator().manual_seed(8))
    glob = with_images(ids, patches=3, start=2, seed=9)
    glob["pixel_values"] = glob["pixel_values"].double()
    ref = TinyVLM.from_config(seed=4).double()
    n_all = count_tokens(glob["labels"])
    ref_loss = cp_cross_entropy(
        ref(glob["input_ids"], pixel_values=glob["pixel_values"]), glob["labels"], num_tokens=n_all
    )
    ref_loss.backward()

    model = TinyVLM.from_config(seed=4).double()
    for block in model.lm.blocks:
        fully_shard(block, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])  # root: embedding, vision encoder, head
    dp = mesh["dp"].get_local_rank()
    batch = {k: v[2 * dp : 2 * dp + 2] for k, v in glob.items()}
    ctx, local, _ = cpshard.prepare_cp_forward(model, mesh["cp"], batch)
    with ctx():
        logits = model(inputs_embeds=local["inputs_embeds"], position_ids=local["position_ids"])
    scale = grad_mean_scale(mesh["dp"])
    n = count_tokens(local["labels"], group=mesh)
    loss = cp_cross_entropy(logits, local["labels"], num_tokens=n, scale=scale)
    loss.backward()
    cpshard.sync_grads(model, mesh["cp"])
    assert_close(reduce_for_logging(loss, mesh, scale=scale), ref_loss.detach())
    want = dict(ref.named_parameters())
    for name, p in model.named_parameters():
        assert p.grad is not None, name
        g = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
        assert_close(g, want[name].grad, msg=name)


def _vlm_step(model: nn.Module, cp_mesh: DeviceMesh | None, batch: dict[str, Any]) -> Any:
    n = count_tokens(batch["labels"])
    ctx, local, sharder = cpshard.prepare_cp_forward(model, cp_mesh, batch)
    with ctx():
        logits = model(inputs_embeds=local["inputs_embeds"], position_ids=local["position_ids"])
    loss = cp_cross_entropy(logits, local["labels"], num_tokens=n)
    loss.backward()
    cpshard.sync_grads(model, cp_mesh)
    full = sharder.gather_token_tensor(logits.detach(), trim=True, fill=0.0)
    return reduce_for_logging(loss, cp_mesh), full


def vlm_packed_matches_cp1(cp_mesh: DeviceMesh) -> None:
    """TinyVLM on packed rows (balanced layout): loss, logits and grads equal cp=1."""
    ids = torch.randint(0, 259, (2, 16), generator=torch.Generator().manual_seed(12))
    ids[0, 1:4] = 259  # an image in the first document of each row
    ids[1, 2:5] = 259
    seq_lens = [[7, 6], [9, 7]]
    spec = cpshard.PackSpec.from_seq_lens(seq_lens, 16)
    labels = cpshard.shift_labels_packed(ids, spec).masked_fill(
        cpshard.shift_labels_packed(ids, spec) == 259, -100
    )
    pixels = torch.randn(2, 3, 16, generator=torch.Generator().manual_seed(13), dtype=torch.float64)
    batch = {"input_ids": ids, "labels": labels, "seq_lens": seq_lens, "pixel_values": pixels}
    ref = TinyVLM.from_config(seed=4).double()
    ref_loss, ref_logits = _vlm_step(ref, None, batch)
    model = TinyVLM.from_config(seed=4).double()
    loss, logits = _vlm_step(model, cp_mesh, batch)
    assert_close(loss, ref_loss)
    real = torch.zeros(2, 16, dtype=torch.bool)
    real[0, :13] = True
    real[1, :16] = True
    assert_close(logits[real], ref_logits[real])
    for (name, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
        assert p.grad is not None and q.grad is not None, name
        assert_close(p.grad, q.grad, msg=name)
