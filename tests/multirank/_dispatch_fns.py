"""Rank functions for the dispatch tests: model-owned CP hooks (top-level for the pool)."""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import pytest
import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

import cpshard
from _counting import counting_checks
from cpshard._comm import CommRecorder
from cpshard.dispatch import run_prepare
from cpshard.layouts.closed_form import ContiguousLayout
from cpshard.models.decoder import TinyDecoder, TinyDecoderConfig
from cpshard.options import PrepareOptions
from cpshard.sharding.batch import shard_batch_dense
from cpshard.sharding.sharder import CPContext, CPSharder


class HookModel(nn.Module):
    """Owns its CP: folds ``pixel_values`` into ``inputs_embeds`` and picks a contiguous layout."""

    def __init__(self, bad: str = "") -> None:
        super().__init__()
        torch.manual_seed(0)  # the same weights on every CP rank (the prepare compares them)
        self.embed = nn.Embedding(50, 4)
        self.bad = bad
        self.calls = 0

    def prepare_model_inputs_for_cp(self, batch: dict[str, Any], *, num_chunks: int = 1) -> Any:
        self.calls += 1
        if self.bad == "not_a_dict":
            return [1]
        emb = self.embed(batch.pop("input_ids")) + batch["pixel_values"].sum()
        sharder: Any = "nope" if self.bad == "sharder" else None
        if sharder is None:
            sharder = cpshard.closed_form_sharder(ContiguousLayout(pad_multiple=num_chunks))
        return {
            "cp_sharder": sharder,
            "inputs_embeds": emb,
            "input_ids": None,
            "pixel_values": None,
        }


class ForwardHookModel(HookModel):
    """Same hook, reached through ``__call__`` (``_pre_embed_only``), as FSDP2 needs."""

    def __init__(self) -> None:
        super().__init__()
        self.pre_forward_calls = 0
        self.register_forward_pre_hook(self._count, with_kwargs=True)

    def _count(self, module: nn.Module, args: Any, kwargs: Any) -> None:
        self.pre_forward_calls += 1

    def forward(
        self,
        input_ids: torch.Tensor | None = None,
        *,
        _pre_embed_only: bool = False,
        _cp_batch: dict[str, Any] | None = None,
        num_chunks: int = 1,
    ) -> Any:
        if _pre_embed_only:
            assert _cp_batch is not None
            return self.prepare_model_inputs_for_cp(_cp_batch, num_chunks=num_chunks)
        raise AssertionError("not used in this test")


def _batch() -> dict[str, Any]:
    return {
        "input_ids": torch.arange(10).reshape(1, 10),
        "pixel_values": torch.ones(1, 3),
        "labels": torch.arange(10).reshape(1, 10),
    }


def model_owned_hook(cp_mesh: DeviceMesh, through_forward: bool) -> None:
    world = cp_mesh.size()
    model = ForwardHookModel() if through_forward else HookModel()
    batch = _batch()
    keep = {k: v.clone() for k, v in batch.items()}
    ctx, out, sharder = cpshard.prepare_cp_forward(model, cp_mesh, batch, num_chunks=3)
    assert set(batch) == set(keep)
    for k in keep:
        assert torch.equal(batch[k], keep[k])
    # The hook runs at every CP size (cp=1 included), so cp=1 runs the same model path.
    assert model.calls == 1
    if through_forward:
        assert isinstance(model, ForwardHookModel)
        assert model.pre_forward_calls == 1
    assert sharder.layout == "contiguous"
    assert "input_ids" not in out and "pixel_values" not in out
    padded = 10 + (-10) % (world * 3)
    assert sharder.padded_seq_len == padded
    assert out["inputs_embeds"].shape == (1, padded // world, 4)
    # gradients reach the model's embedding through the out-of-place shard
    out["inputs_embeds"].sum().backward()
    assert model.embed.weight.grad is not None
    with ctx():
        pass


def hook_errors(cp_mesh: DeviceMesh) -> None:
    with pytest.raises(TypeError, match=r"must return a dict \{'cp_sharder'"):
        cpshard.prepare_cp_forward(HookModel("not_a_dict"), cp_mesh, _batch())
    with pytest.raises(TypeError, match="'cp_sharder' must be a CPSharder, got str"):
        cpshard.prepare_cp_forward(HookModel("sharder"), cp_mesh, _batch())
    with pytest.raises(TypeError, match="'cp_sharder' must be a CPSharder, got str"):
        cpshard.prepare_cp_forward(_OwnsSharder("nope"), cp_mesh, _batch())
    with pytest.raises(ValueError, match="num_chunks must be >= 1"):
        cpshard.prepare_cp_forward(HookModel(), cp_mesh, _batch(), num_chunks=0)


class _OwnsSharder(nn.Module):
    """A model whose hook returns a given sharder."""

    def __init__(self, sharder: Any) -> None:
        super().__init__()
        self.sharder = sharder

    def prepare_model_inputs_for_cp(self, batch: dict[str, Any], *, num_chunks: int = 1) -> Any:
        return {"cp_sharder": self.sharder}


def _bad_map_shard(
    cp_mesh: DeviceMesh | None, tp_mesh: DeviceMesh | None, batch: dict[str, Any], **kw: Any
) -> Any:
    """A dense contiguous shard whose captured map lets the last rank claim rank 0's tokens."""
    ctx, out = shard_batch_dense(cp_mesh, tp_mesh, batch, layout=ContiguousLayout(), **kw)
    rank_map = ctx.facts.rank_map.clone()
    rank_map[-1] = rank_map[0]
    return CPContext(ctx, dataclasses.replace(ctx.facts, rank_map=rank_map)), out


def _local_only_shard(
    cp_mesh: DeviceMesh | None, tp_mesh: DeviceMesh | None, batch: dict[str, Any], **kw: Any
) -> Any:
    """A shard that captures no rank map (the dispatcher must learn it by an all-gather)."""
    ctx, out = shard_batch_dense(cp_mesh, tp_mesh, batch, layout=ContiguousLayout(), **kw)
    return CPContext(ctx, dataclasses.replace(ctx.facts, rank_map=None)), out


def _repeated_positions_shard(
    cp_mesh: DeviceMesh | None, tp_mesh: DeviceMesh | None, batch: dict[str, Any], **kw: Any
) -> Any:
    ctx, out = shard_batch_dense(cp_mesh, tp_mesh, batch, layout=ContiguousLayout(), **kw)
    pos = torch.zeros(1, 10, dtype=torch.long)  # every input token in slot 0
    return CPContext(ctx, dataclasses.replace(ctx.facts, input_token_stream_positions=pos)), out


def model_owned_map_errors(cp_mesh: DeviceMesh) -> None:
    """Model-owned sharders whose index map is not a bijection: the same error on every rank."""
    batch = {"input_ids": torch.arange(10).reshape(1, 10)}
    bad = CPSharder(shard_batch=_bad_map_shard, local_token_global_indices=None)
    with pytest.raises(ValueError, match="not a bijection onto its padded stream of"):
        cpshard.prepare_cp_forward(_OwnsSharder(bad), cp_mesh, batch)
    # no captured map: each rank claims the first L positions; learned by one all-gather
    lazy = CPSharder(
        shard_batch=_local_only_shard,
        local_token_global_indices=lambda mesh, p, dev: torch.arange(p // cp_mesh.size()),
    )
    with pytest.raises(ValueError, match="not a bijection"):
        cpshard.prepare_cp_forward(_OwnsSharder(lazy), cp_mesh, batch)
    too_long = CPSharder(
        shard_batch=_local_only_shard,
        local_token_global_indices=lambda mesh, p, dev: torch.arange(p // cp_mesh.size() + 1),
    )
    with pytest.raises(ValueError, match=r"rank 0's local_token_global_indices has \d+ tokens"):
        cpshard.prepare_cp_forward(_OwnsSharder(too_long), cp_mesh, batch)
    dup = CPSharder(shard_batch=_repeated_positions_shard, local_token_global_indices=None)
    with pytest.raises(ValueError, match="two input tokens map to the same stream slot"):
        cpshard.prepare_cp_forward(_OwnsSharder(dup), cp_mesh, batch)
    # a correct lazy sharder passes the same check
    good = CPSharder(
        shard_batch=_local_only_shard,
        local_token_global_indices=lambda mesh, p, dev: ContiguousLayout().local_indices(
            cp_mesh.get_local_rank(), cp_mesh.size(), p, dev
        ),
    )
    cpshard.prepare_cp_forward(_OwnsSharder(good), cp_mesh, batch)


def checks_once_one_collective(cp_mesh: DeviceMesh, packed: bool) -> None:
    """Each check of a prepare runs once, in pipeline order, and the whole prepare issues one
    collective (the step header carrying the batch fingerprint), for both entry points."""
    cfg = TinyDecoderConfig(vocab_size=50, hidden_size=16, num_layers=1, num_heads=2,
                            num_kv_heads=1, intermediate_size=32)  # fmt: skip
    batch: dict[str, Any] = {"input_ids": torch.arange(20).reshape(2, 10)}
    if packed:
        batch = {"input_ids": torch.arange(10).reshape(1, 10), "seq_lens": [[4, 6]]}
    cases = [
        (None, PrepareOptions(), ["cp_mesh", "batch_mapping", "padding_token_id"]),
        (HookModel(), PrepareOptions(num_chunks=2),
         ["cp_mesh", "batch_mapping", "padding_token_id", "model_sharder"]),
        (TinyDecoder.from_config(cfg, seed=0), PrepareOptions(num_chunks=1),
         ["cp_mesh", "token_mixers", "batch_mapping", "padding_token_id"]),
    ]  # fmt: skip
    for model, options, expected in cases:
        work = _batch() if isinstance(model, HookModel) else batch  # the hook's own layout
        checks, calls = counting_checks()
        with CommRecorder() as rec:
            _, local, sharder = run_prepare(model, cp_mesh, work, options, checks)
        assert calls == expected, (type(model).__name__, calls)
        assert rec.count() == rec.count("all_gather") == 1, rec.events
        assert sharder.cp_size == cp_mesh.size() and sharder.padded_seq_len is not None


def options_raise_on_every_rank(cp_mesh: DeviceMesh) -> None:
    """An invalid option raises on every rank right after the one step header (whose fingerprint
    carries the options), before the model hook or any data collective, and the CP group's step
    is left as it was (the next prepare works). Given wrong on one rank only, it raises on every
    rank too: no rank is left waiting in the header's all-gather."""
    model = HookModel()
    calls: list[tuple[Any, dict[str, Any], type[Exception], str]] = [
        (None, {"layout": "zigzag"}, ValueError, "layout must be one of"),
        (None, {"attention": "flash"}, ValueError, "attention must be one of"),
        (None, {"attention_cost": 1e9}, TypeError, "attention_cost must be a"),
        (None, {"cp_sharder": "contiguous"}, TypeError, "cp_sharder must be a cpshard.CPSharder"),
        (model, {"num_chunks": 0}, ValueError, "num_chunks must be >= 1, got num_chunks=0"),
        (model, {"layout": "zigzag"}, ValueError, "layout must be one of"),
        (model, {"attention": "flash"}, ValueError, "attention must be one of"),
    ]
    for owner, kwargs, error, match in calls:
        call = (
            functools.partial(cpshard.make_cp_batch_and_ctx, cp_mesh, _batch(), **kwargs)
            if owner is None
            else functools.partial(cpshard.prepare_cp_forward, owner, cp_mesh, _batch(), **kwargs)
        )
        with CommRecorder() as rec, pytest.raises(error, match=match):
            call()
        assert rec.count() == rec.count("all_gather") == 1, (kwargs, rec.events)  # the header
    odd = cp_mesh.get_local_rank() == 1  # one rank only asks for a method that does not exist
    with CommRecorder() as rec, pytest.raises(ValueError, match="attention") as info:
        cpshard.make_cp_batch_and_ctx(cp_mesh, _batch(), attention="flash" if odd else "ring")
    assert rec.count() == 1, rec.events
    assert "different" in str(info.value), str(info.value)
    assert model.calls == 0  # the hook never ran
    with CommRecorder() as rec:
        cpshard.prepare_cp_forward(model, cp_mesh, _batch())
    assert rec.count() == 1 and model.calls == 1
