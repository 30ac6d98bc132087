"""Rank functions for 4-D attention masks in the batch (issue 17)."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.device_mesh import DeviceMesh

import cpshard


def four_d_documents_refused(cp_mesh: DeviceMesh, kind: str) -> str:
    """A block-diagonal document mask raises the same error on every rank (cp=1 too), naming
    the seq_lens to pass; a causal padding mask still shards."""
    lens = [5, 7]
    doc = torch.repeat_interleave(torch.arange(2), torch.tensor(lens))
    ar = torch.arange(12)
    m = ((doc[:, None] == doc[None, :]) & (ar[None, :] <= ar[:, None]))[None, None]
    mask = m if kind == "bool" else torch.zeros(m.shape).masked_fill(~m, float("-inf"))
    ids = torch.arange(1, 13)[None]
    with pytest.raises(ValueError, match=r"seq_lens=\[\[5, 7\]\]") as info:
        cpshard.make_cp_batch_and_ctx(cp_mesh, {"input_ids": ids, "attention_mask": mask})
    causal = (ar[None, :] <= ar[:, None])[None, None].clone()
    causal[..., 10:] = False  # the last two tokens are padding
    _, local, sharder = cpshard.make_cp_batch_and_ctx(
        cp_mesh, {"input_ids": ids, "attention_mask": causal}
    )
    pad = sharder.gather_token_tensor(local["padding_mask"], trim=True)
    assert pad.tolist() == [[False] * 10 + [True] * 2]
    return str(info.value)
