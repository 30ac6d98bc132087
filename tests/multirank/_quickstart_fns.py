"""The README's "Quick start": its script run verbatim, and the local shapes it states."""

from __future__ import annotations

import torch
from torch.distributed.device_mesh import DeviceMesh

import cpshard


def packed_readme_batch() -> dict[str, object]:
    """The README's packed example: ``[2, 128]`` holding 244 real tokens."""
    ids = torch.randint(1, 100, (2, 128), generator=torch.Generator().manual_seed(0))
    seq_lens = [[100, 28], [60, 56]]
    return {"input_ids": ids, "labels": cpshard.shift_labels_packed(ids, seq_lens),
            "seq_lens": seq_lens}  # fmt: skip


def local_shapes(cp_mesh: DeviceMesh | None) -> tuple[tuple[int, ...], str]:
    """Local ``input_ids`` shape and layout of the packed example on this CP group."""
    _, local, sharder = cpshard.make_cp_batch_and_ctx(cp_mesh, packed_readme_batch())
    return tuple(local["input_ids"].shape), sharder.layout
