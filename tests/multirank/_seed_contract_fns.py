"""Rank functions for the seed's sharder contract (NeMo Automodel PR #2937 at ``3ae1c0ed5``).

A model hook written to the seed builds its sharder in two steps (``shard_batch=None``, then
``functools.partial(shard_contiguous, record_on=sharder)``), and its ``shard_batch`` records the
facts it learned on the sharder (``record_on.original_seq_len = S``) instead of returning them.
Its context is its own (here a ``nullcontext``: the model mixes no tokens).
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.testing import assert_close

import cpshard

VOCAB = 50


def _rank_world(cp_mesh: DeviceMesh | None) -> tuple[int, int]:
    if cp_mesh is None:
        return 0, 1
    return cp_mesh.get_local_rank(), cp_mesh.size()


def contiguous_indices(
    cp_mesh: DeviceMesh | None, padded_seq_len: int, device: torch.device
) -> torch.Tensor:
    """The seed's contiguous map: rank ``r`` owns ``[r * L, (r + 1) * L)``."""
    rank, world = _rank_world(cp_mesh)
    n = padded_seq_len // world
    return torch.arange(rank * n, (rank + 1) * n, device=device)


def shard_contiguous(
    cp_mesh: DeviceMesh | None,
    tp_mesh: DeviceMesh | None,
    batch: dict[str, Any],
    *,
    loss_mask: torch.Tensor | None = None,
    padding_token_id: int = 0,
    record_on: cpshard.CPSharder | None = None,
) -> tuple[Any, dict[str, Any]]:
    """The seed's ``shard_batch_contiguous``: pad to ``2C``, slice, record the facts."""
    rank, world = _rank_world(cp_mesh)
    ids = batch["input_ids"]
    seq_len = ids.shape[1]
    chunk = 2 * world
    padded = -(-seq_len // chunk) * chunk
    extra = padded - seq_len
    pos = torch.arange(padded).expand(ids.shape[0], padded)
    full = {
        "input_ids": torch.cat([ids, ids.new_full((ids.shape[0], extra), padding_token_id)], 1),
        "position_ids": pos,
        "labels": torch.cat([batch["labels"], ids.new_full((ids.shape[0], extra), -100)], 1),
    }
    n = padded // world
    local = {k: v[:, rank * n : (rank + 1) * n].clone() for k, v in full.items()}
    if record_on is not None:  # the seed's capture: facts recorded on the sharder
        record_on.original_seq_len = seq_len
        record_on.padded_seq_len = padded
    return contextlib.nullcontext, local


class SeedOwned(nn.Module):
    """A model that owns its CP the seed's way (its per-token head mixes no tokens)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(VOCAB, 8)
        self.head = nn.Linear(8, 3)

    def prepare_model_inputs_for_cp(
        self, batch: dict[str, Any], *, num_chunks: int = 1
    ) -> dict[str, Any]:
        sharder = cpshard.CPSharder(
            shard_batch=None, local_token_global_indices=contiguous_indices, layout="contiguous"
        )
        sharder.shard_batch = functools.partial(shard_contiguous, record_on=sharder)
        return {"cp_sharder": sharder}

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.emb(input_ids)) + position_ids.unsqueeze(-1).to(torch.float32)


def seed_hook_records_on_sharder(cp_mesh: DeviceMesh, seq_len: int) -> None:
    """prepare_cp_forward with the seed's hook: facts recorded in shard_batch feed the verbs;
    the forward and the gathered per-token outputs equal one process."""
    rank, world = _rank_world(cp_mesh)
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(1, VOCAB, (2, seq_len), generator=g)
    batch = {"input_ids": ids, "labels": ids.roll(-1, 1)}
    model = SeedOwned()
    for step in range(2):  # a second batch: the facts are the new shard's
        batch_s = {k: v[:, : seq_len - step] for k, v in batch.items()}
        s = seq_len - step
        ctx, local, sharder = cpshard.prepare_cp_forward(model, cp_mesh, batch_s)
        padded = -(-s // (2 * world)) * (2 * world)
        assert (sharder.original_seq_len, sharder.padded_seq_len) == (s, padded)
        assert isinstance(sharder.facts, cpshard.ShardFacts) and sharder.cp_mesh is cp_mesh
        with ctx():
            out = model(local["input_ids"], local["position_ids"])
        full = sharder.gather_token_tensor(out, trim=True)
        assert_close(full, model(batch_s["input_ids"], torch.arange(s).expand(2, s)))
        adv = torch.randn(2, s, generator=g)
        shard = sharder.shard_token_tensor(adv, fill=0.0)
        n = padded // world
        want = torch.cat([adv, adv.new_zeros(2, padded - s)], 1)[:, rank * n : (rank + 1) * n]
        assert_close(shard, want)
        assert_close(sharder.gather_token_tensor(shard, trim=True), adv)


def sharder_built_with_facts(cp_mesh: DeviceMesh) -> None:
    """CPSharder(..., original_seq_len=, padded_seq_len=) works before any shard, and a shard
    whose context carries no facts starts from the construction facts."""
    rank, world = _rank_world(cp_mesh)
    padded = 4 * world
    sharder = cpshard.CPSharder(
        None, contiguous_indices, layout="contiguous", original_seq_len=padded - 1,
        padded_seq_len=padded,
    )  # fmt: skip
    assert (sharder.original_seq_len, sharder.padded_seq_len) == (padded - 1, padded)
    x = torch.arange(padded - 1.0).reshape(1, -1)
    # no shard yet: no mesh bound, so the verbs act at cp=1 on the constructed facts
    assert_close(sharder.shard_token_tensor(x, fill=-1.0)[0, -1], torch.tensor(-1.0))

    def facts_free(cp_mesh: Any, tp_mesh: Any, batch: dict[str, Any], **kw: Any) -> Any:
        n = padded // world
        ids = torch.cat([batch["input_ids"], batch["input_ids"].new_zeros(1, 1)], 1)
        return contextlib.nullcontext, {"input_ids": ids[:, rank * n : (rank + 1) * n]}

    sharder.shard_batch = facts_free
    ids = torch.arange(1, padded).reshape(1, -1)
    _, local, bound = cpshard.make_cp_batch_and_ctx(cp_mesh, {"input_ids": ids}, cp_sharder=sharder)
    # the dispatcher returns a sharder bound to the batch; the one the caller built (the seed's
    # holder) answers for its latest batch too, with the same facts
    assert bound.is_bound and bound.facts is sharder.facts and sharder.cp_mesh is cp_mesh
    for s in (sharder, bound):
        assert (s.original_seq_len, s.padded_seq_len) == (padded - 1, padded)
        assert_close(s.gather_token_tensor(local["input_ids"], trim=True), ids)


def bound_sharder_outlives_later_shards(cp_mesh: DeviceMesh, seq_len: int) -> None:
    """A sharder returned for one batch keeps answering for that batch after the same model
    hook (record_on=sharder) shards later batches: no stale sharder, nothing to detect."""
    rank, world = _rank_world(cp_mesh)
    model = SeedOwned()
    g = torch.Generator().manual_seed(3)
    first = torch.randint(1, VOCAB, (2, seq_len), generator=g)
    _, local1, sharder1 = cpshard.prepare_cp_forward(
        model, cp_mesh, {"input_ids": first, "labels": first}
    )
    later = torch.randint(1, VOCAB, (1, seq_len + 5), generator=g)
    _, local2, sharder2 = cpshard.prepare_cp_forward(
        model, cp_mesh, {"input_ids": later, "labels": later}
    )
    assert sharder1 is not sharder2 and sharder1.original_seq_len == seq_len
    assert sharder2.original_seq_len == seq_len + 5
    assert_close(sharder1.gather_token_tensor(local1["input_ids"], trim=True), first)
    assert_close(sharder2.gather_token_tensor(local2["input_ids"], trim=True), later)
    adv = torch.randn(2, seq_len, generator=g)
    back = sharder1.gather_token_tensor(sharder1.shard_token_tensor(adv, fill=0.0), trim=True)
    assert_close(back, adv)


def record_on_assignment_replaces_facts(cp_mesh: DeviceMesh) -> None:
    """The seed's ``record_on`` assignments on a bare sharder (no shard yet) and on a sharder
    built with fact fields: each replaces the frozen facts, and the verbs use them."""
    rank, world = _rank_world(cp_mesh)
    padded = 2 * world
    sharder = cpshard.CPSharder(None, contiguous_indices, layout="contiguous")
    before = sharder.facts
    sharder.original_seq_len = padded - 1
    sharder.padded_seq_len = padded
    assert sharder.facts is not before and before.padded_seq_len is None
    assert (sharder.original_seq_len, sharder.padded_seq_len) == (padded - 1, padded)
    x = torch.arange(padded - 1.0).reshape(1, -1)
    want = torch.cat([x, x.new_full((1, 1), -1.0)], 1)
    assert_close(sharder.shard_token_tensor(x, fill=-1.0), want)  # no mesh yet: cp=1 verbs
    built = cpshard.CPSharder(
        None, contiguous_indices, original_seq_len=3, padded_seq_len=4, input_row_shape=(2, 2)
    )
    assert (built.original_seq_len, built.padded_seq_len, built.input_row_shape) == (3, 4, (2, 2))
    built.input_row_shape = None
    assert built.input_row_shape is None and built.padded_seq_len == 4
