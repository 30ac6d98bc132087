"""Rank functions for the guard-rail tests: ranks given different batches or verb inputs."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch.distributed.device_mesh import DeviceMesh

import cpshard
from cpshard.models import TinyDecoder, TinyDecoderConfig

B, S = 2, 12


def _base(packed: bool) -> dict[str, Any]:
    ids = torch.arange(1, B * S + 1).reshape(B, S) % 50 + 1
    mask = torch.ones(B, S, dtype=torch.long)
    mask[1, -3:] = 0
    batch: dict[str, Any] = {
        "input_ids": ids,
        "labels": cpshard.shift_labels(ids, padding_mask=mask == 0),
        "attention_mask": mask,
    }
    if packed:
        del batch["attention_mask"]
        batch["seq_lens"] = [[5, 7], [4, 4]]
    return batch


def _diverge(batch: dict[str, Any], variant: str, kwargs: dict[str, Any]) -> None:
    """Apply one data-loader bug to this rank's batch (or arguments)."""
    ids = batch["input_ids"]
    if variant == "content":  # same shapes, one token differs
        ids = ids.clone()
        ids[1, 4] += 1
        batch["input_ids"] = ids
    elif variant == "swap":  # same multiset of tokens, two rows swapped
        batch["input_ids"] = ids.flip(0)
    elif variant == "seq_lens":
        batch["seq_lens"] = [[6, 6], [4, 4]]
    elif variant == "attention_mask":
        mask = batch["attention_mask"].clone()
        mask[1, -4] = 0
        batch["attention_mask"] = mask
    elif variant == "labels":
        batch["labels"] = cpshard.shift_labels(ids)
    elif variant == "position_ids":
        batch["position_ids"] = torch.arange(S).expand(B, S) + 1
    elif variant == "seq_len":  # a different S: gloo would abort on the size mismatch
        for k in ("input_ids", "labels", "attention_mask"):
            if k in batch:
                batch[k] = batch[k][:, :-4]
    elif variant == "batch_size":
        for k in ("input_ids", "labels", "attention_mask"):
            batch[k] = batch[k][:1]
    elif variant == "dtype":
        batch["input_ids"] = ids.int()
    elif variant == "extra_key":
        batch["advantages"] = torch.zeros(B, S)
    elif variant == "layout":
        kwargs["layout"] = "contiguous"
    elif variant == "attention":
        kwargs["attention"] = "ring"
    elif variant == "pad_id":
        kwargs["padding_token_id"] = 3
    elif variant == "invalid_here_only":  # only this rank's batch is malformed (S = 0)
        batch["input_ids"] = ids[:, :0]
    else:
        raise AssertionError(variant)


def divergent_batch(cp_mesh: DeviceMesh, variant: str, packed: bool, with_model: bool) -> str:
    """The last rank gets a different batch: every rank raises the same ValueError."""
    rank, world = cp_mesh.get_local_rank(), cp_mesh.size()
    batch = _base(packed)
    kwargs: dict[str, Any] = {"padding_token_id": 0}
    if rank == world - 1:
        _diverge(batch, variant, kwargs)
    model = TinyDecoder(TinyDecoderConfig(vocab_size=64))

    def call() -> Any:
        if with_model:
            return cpshard.prepare_cp_forward(model, cp_mesh, batch, **kwargs)
        return cpshard.make_cp_batch_and_ctx(cp_mesh, batch, **kwargs)

    with pytest.raises(ValueError, match="were given different batches") as info:
        call()
    msg = str(info.value)
    assert f"ranks {list(range(world - 1))} vs ranks [{world - 1}]" in msg or variant in (
        "seq_len",
        "batch_size",
    ), msg
    return msg


def same_batch_passes(cp_mesh: DeviceMesh, packed: bool) -> int | None:
    """Identical batches pass the check; the opt-out skips it."""
    _, _, sharder = cpshard.make_cp_batch_and_ctx(cp_mesh, _base(packed))
    assert sharder.check_consistency
    _, _, off = cpshard.make_cp_batch_and_ctx(cp_mesh, _base(packed), check_consistency=False)
    assert not off.check_consistency
    return sharder.padded_seq_len


def divergent_gather(cp_mesh: DeviceMesh, variant: str) -> str:
    """gather_token_tensor given different dtypes / shapes / arguments raises on every rank."""
    rank, world = cp_mesh.get_local_rank(), cp_mesh.size()
    _, out, sharder = cpshard.make_cp_batch_and_ctx(cp_mesh, _base(False))
    t: Any = torch.randn(out["input_ids"].shape)
    kwargs: dict[str, Any] = {}
    if rank == world - 1:
        if variant == "dtype":
            t = t.view(torch.int32)  # same bytes: the all-gather itself would not notice
        elif variant == "shape":
            t = t[:1]
        elif variant == "not_a_tensor":
            t = t.tolist()
        elif variant == "trim":
            kwargs["trim"] = True
        else:
            raise AssertionError(variant)
    with pytest.raises(ValueError, match="gather_token_tensor was called with different") as info:
        sharder.gather_token_tensor(t, **kwargs)
    # the group is still usable afterwards: the next gather runs normally
    full = sharder.gather_token_tensor(out["labels"].float())
    assert full.shape == (B, sharder.padded_seq_len)
    return str(info.value)
