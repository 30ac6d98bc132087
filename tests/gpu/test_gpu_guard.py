"""GPU tier of the guard rails: the batch fingerprint is the same on CUDA as on the CPU.

Ranks of one CP group hash on their own device; the hash is integer arithmetic, so a CUDA batch
and its CPU copy must give the same fingerprint. Skipped without CUDA.
"""

from __future__ import annotations

import pytest
import torch

import cpshard
from cpshard.sharding.consistency import batch_fingerprint

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


def test_fingerprint_matches_across_devices() -> None:
    ids = torch.randint(0, 50000, (4, 4096), generator=torch.Generator().manual_seed(0))
    mask = torch.ones(4, 4096, dtype=torch.long)
    mask[1, -100:] = 0
    batch = {
        "input_ids": ids,
        "labels": cpshard.shift_labels(ids, padding_mask=mask == 0),
        "attention_mask": mask,
        "inputs_embeds_like": torch.randn(4, 4096, 8),
    }
    on_gpu = {k: v.cuda() for k, v in batch.items()}
    kw = {"layout": "auto", "attention": "ring", "padding_token_id": 0}
    cpu = batch_fingerprint(batch, **kw)
    gpu = batch_fingerprint(on_gpu, **kw)
    assert gpu.device.type == "cuda"
    # the "dtypes and shapes" slot names the device type, every other slot must agree
    from cpshard.sharding.consistency import FIELDS

    differ = {FIELDS[i] for i in range(len(FIELDS)) if cpu[i] != gpu.cpu()[i]}
    assert differ == {"dtypes and shapes"}
