"""GPU tier: the shipped model-owned models through prepare_cp_forward on CUDA (cp=1).

Skipped without CUDA. Run on a GPU machine with ``python3 -m pytest tests/gpu``.
"""

from __future__ import annotations

import pytest
import torch
from torch.testing import assert_close

import cpshard
from cpshard.loss import count_tokens, cp_cross_entropy
from cpshard.models import GlobalPrefixConfig, GlobalPrefixDecoder, TinyVLM, with_images

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


def _loss_and_grads(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> tuple[float, list]:
    ctx, local, _ = cpshard.prepare_cp_forward(model, None, batch)
    with ctx():
        if "inputs_embeds" in local:
            logits = model(inputs_embeds=local["inputs_embeds"], position_ids=local["position_ids"])
        else:
            logits = model(local["input_ids"], local["position_ids"])
    loss = cp_cross_entropy(logits, local["labels"], num_tokens=count_tokens(batch["labels"]))
    loss.backward()
    cpshard.sync_grads(model, None)
    return float(loss), [p.grad.cpu() for p in model.parameters()]


@pytest.mark.parametrize("which", ["vlm", "global_prefix"])
def test_models_on_cuda_match_cpu(which: str) -> None:
    ids = torch.randint(0, 259, (2, 29), generator=torch.Generator().manual_seed(0))
    if which == "vlm":
        batch = with_images(ids, patches=4, seed=1)
        make = lambda: TinyVLM.from_config(seed=2).double()  # noqa: E731
    else:
        batch = {"input_ids": ids, "labels": cpshard.shift_labels(ids)}
        cfg = GlobalPrefixConfig(num_global_tokens=3, block_size=4)
        make = lambda: GlobalPrefixDecoder.from_config(cfg, seed=2).double()  # noqa: E731
    batch = {k: v.double() if v.is_floating_point() else v for k, v in batch.items()}
    cpu_loss, cpu_grads = _loss_and_grads(make(), batch)
    cuda_batch = {k: v.cuda() for k, v in batch.items()}
    gpu_loss, gpu_grads = _loss_and_grads(make().cuda(), cuda_batch)
    assert abs(cpu_loss - gpu_loss) < 1e-9
    for a, b in zip(gpu_grads, cpu_grads, strict=True):
        assert_close(a, b)
