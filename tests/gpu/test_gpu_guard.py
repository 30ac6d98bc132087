"""GPU tier of the guard rails: the batch fingerprint and the shard's record on CUDA.

Ranks of one CP group hash on their own device: XXH3 on the CPU, the lane hash on an accelerator
(no host copy). A CUDA batch and its CPU copy differ in their description (the device type), so
their content hashes need not agree; two CUDA copies must, and one changed value must show. A
local tensor moved to CUDA after a CPU shard is still the shard's. Skipped without CUDA.
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
    from cpshard.sharding.consistency import FIELDS

    differ = {FIELDS[i] for i in range(len(FIELDS)) if cpu[i] != gpu.cpu()[i]}
    assert "dtypes and shapes" in differ  # the device type: ranks on two devices always differ
    again = batch_fingerprint({k: v.clone() for k, v in on_gpu.items()}, **kw)
    assert torch.equal(gpu, again)
    changed = dict(on_gpu, labels=on_gpu["labels"].clone())
    changed["labels"][3, 4000] += 1
    moved = batch_fingerprint(changed, **kw).cpu()
    assert {FIELDS[i] for i in range(len(FIELDS)) if moved[i] != gpu.cpu()[i]} == {"labels"}


def test_record_of_a_cpu_shard_matches_its_tensors_moved_to_cuda() -> None:
    """A CPU shard's record (hashed on the CPU) compared with its local tensors moved by
    ``.to("cuda")``: the same (each is hashed on the record's device), and a changed one not."""
    from cpshard.sharding.facts import local_record, matches_record

    ids = torch.randint(0, 50000, (2, 512), generator=torch.Generator().manual_seed(1))
    pos = torch.arange(512).expand(2, -1).contiguous()
    record = dict(local_record({"input_ids": ids, "position_ids": pos}))
    assert matches_record(record, {"input_ids": ids.cuda(), "position_ids": pos.cuda()})
    assert matches_record(record, {"input_ids": ids.cuda()})  # now from the held hash
    other = ids.cuda()
    other[1, 7] += 1
    assert matches_record(record, {"input_ids": other}) is False
