"""Rank functions for the batch fingerprint (issue 17): what it covers, and its opt-out."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from torch.distributed.device_mesh import DeviceMesh

import cpshard
from cpshard.models import TinyDecoder, TinyDecoderConfig

B, S, H = 2, 24, 256  # 12288 embedding values: more than the old 4096-value sample


def _batch(variant: str) -> dict[str, Any]:
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(1, 60, (B, S), generator=g)
    batch: dict[str, Any] = {"input_ids": ids, "labels": cpshard.shift_labels(ids)}
    if variant == "embeds_late_row":
        batch = {"inputs_embeds": torch.randn(B, S, H, generator=g), "labels": batch["labels"]}
    if variant == "numpy":
        batch["sample_weight"] = np.linspace(0.0, 1.0, B)
    if variant == "list":
        batch["source"] = ["wiki", "code"]
    if variant == "sparse":  # not plain strided tensors: hashed by their parts, never raising
        batch["graph"] = torch.eye(6).to_sparse()
        batch["codes"] = torch.quantize_per_tensor(torch.arange(6.0), 0.5, 0, torch.quint8)
        batch["parts"] = torch.nested.nested_tensor([torch.ones(2), torch.ones(3)])
    return batch


def _diverge(batch: dict[str, Any], variant: str) -> None:
    if variant == "embeds_late_row":  # one value of the last token row of the last sequence
        emb = batch["inputs_embeds"].clone()
        emb[B - 1, S - 1, H - 1] += 1e-4
        batch["inputs_embeds"] = emb
    elif variant == "crafted":  # a collision of a weighted-sum hash sum_k x_k (2k + 1)
        ids = batch["input_ids"].clone()
        ids[0, 0] += 3
        ids[0, 1] -= 1
        batch["input_ids"] = ids
    elif variant == "numpy":
        w = batch["sample_weight"].copy()
        w[-1] = 0.5
        batch["sample_weight"] = w
    elif variant == "list":
        batch["source"] = ["wiki", "web"]
    elif variant == "sparse":
        batch["graph"] = (torch.eye(6) * 2).to_sparse()
    else:
        raise AssertionError(variant)


def _prepare(cp_mesh: DeviceMesh, batch: dict[str, Any], with_model: bool, **kw: Any) -> Any:
    if with_model:
        model = TinyDecoder(TinyDecoderConfig(vocab_size=64))
        return cpshard.prepare_cp_forward(model, cp_mesh, batch, **kw)
    return cpshard.make_cp_batch_and_ctx(cp_mesh, batch, **kw)


def divergent_content(cp_mesh: DeviceMesh, variant: str, with_model: bool) -> str:
    """The last rank's batch differs where the old fingerprint did not look: every rank raises
    the same ValueError before any data-sized collective."""
    rank, world = cp_mesh.get_local_rank(), cp_mesh.size()
    batch = _batch(variant)
    if rank == world - 1:
        _diverge(batch, variant)
    pad = None if "inputs_embeds" in batch else 0
    with pytest.raises(ValueError, match="were given different batches") as info:
        _prepare(cp_mesh, batch, with_model, padding_token_id=pad)
    msg = str(info.value)
    assert f"ranks {list(range(world - 1))} vs ranks [{world - 1}]" in msg, msg
    return msg


def opt_out_on_some_ranks(cp_mesh: DeviceMesh, with_model: bool) -> str:
    """check_consistency=False on rank 0 only: the same clear error on every rank (the opt-out
    skips the hashing, not the collective), never a mismatched collective."""
    rank = cp_mesh.get_local_rank()
    batch = _batch("crafted")
    flag = rank != 0
    same_phase = "disagree on entering the same phase: check_consistency"
    with pytest.raises(ValueError, match=same_phase) as info:
        _prepare(cp_mesh, batch, with_model, check_consistency=flag)
    # and the collectives still pair: a following check on every rank works
    _, _, sharder = cpshard.make_cp_batch_and_ctx(cp_mesh, batch)
    assert sharder.padded_seq_len is not None
    return str(info.value)


def opt_out_everywhere_reads_no_values(cp_mesh: DeviceMesh) -> int:
    """check_consistency=False on every rank: different values are not compared (the caller's
    promise), but the exchange still runs and the shapes still agree."""
    rank = cp_mesh.get_local_rank()
    batch = _batch("crafted")
    if rank == 0:
        _diverge(batch, "crafted")
    _, local, sharder = cpshard.make_cp_batch_and_ctx(cp_mesh, batch, check_consistency=False)
    assert not sharder.check_consistency
    return int(local["input_ids"].shape[1])


def cost_models_differ(cp_mesh: DeviceMesh) -> str:
    """The last rank passes another ``attention_cost``: under ``attention="auto"`` it could choose
    another method (mismatched collectives); every rank raises the same error instead."""
    from dataclasses import replace

    from cpshard.attention.cost import CostModel

    rank, world = cp_mesh.get_local_rank(), cp_mesh.size()
    cost = CostModel.cpu_gloo()
    if rank == world - 1:
        cost = replace(cost, link_bandwidth=cost.link_bandwidth * 2)
    with pytest.raises(ValueError, match="were given different batches") as info:
        cpshard.make_cp_batch_and_ctx(cp_mesh, _batch("crafted"), attention_cost=cost)
    msg = str(info.value)
    assert f"options (ranks {list(range(world - 1))} vs ranks [{world - 1}])" in msg, msg
    return msg


def sharders_differ(cp_mesh: DeviceMesh) -> str:
    """The last rank is given a sharder of the same type with another layout (its pad multiple):
    its shard would have another padded length (mismatched data collectives later); every rank
    raises the same error at the fingerprint instead."""
    from cpshard.layouts.closed_form import ContiguousLayout

    rank, world = cp_mesh.get_local_rank(), cp_mesh.size()
    sharder = cpshard.closed_form_sharder(
        ContiguousLayout(pad_multiple=4 if rank == world - 1 else 2)
    )
    with pytest.raises(ValueError, match="were given different batches") as info:
        cpshard.make_cp_batch_and_ctx(cp_mesh, _batch("crafted"), cp_sharder=sharder)
    msg = str(info.value)
    assert f"options (ranks {list(range(world - 1))} vs ranks [{world - 1}])" in msg, msg
    # the same sharder everywhere, used before (it holds its last shard's facts): no error
    same = cpshard.closed_form_sharder(ContiguousLayout(pad_multiple=2))
    for _ in range(2):
        cpshard.make_cp_batch_and_ctx(cp_mesh, _batch("crafted"), cp_sharder=same)
    return msg
