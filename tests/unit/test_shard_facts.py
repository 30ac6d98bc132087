"""A CPSharder's captured state is one frozen ShardFacts, replaced (never edited) per shard."""

from __future__ import annotations

import contextlib
import dataclasses

import pytest
import torch
from torch.testing import assert_close

import cpshard


def _batch(s: int) -> dict[str, torch.Tensor]:
    return {"input_ids": torch.arange(2 * s).reshape(2, s)}


def test_facts_are_frozen_and_read_only() -> None:
    ctx, _, sharder = cpshard.make_cp_batch_and_ctx(None, _batch(7), check_consistency=False)
    facts = sharder.facts
    assert isinstance(facts, cpshard.ShardFacts) and ctx.facts is facts
    assert (facts.original_seq_len, facts.padded_seq_len) == (7, 7)
    assert facts.cp_mesh is None and facts.check_consistency is False
    assert sharder.check_consistency is False and sharder.cp_mesh is None
    with pytest.raises(dataclasses.FrozenInstanceError):
        facts.padded_seq_len = 9  # type: ignore[misc]
    # the returned sharder is bound to its batch: its facts are that batch's for good
    with pytest.raises(AttributeError, match="bound to its batch"):
        sharder.padded_seq_len = 9
    assert sharder.facts is facts
    # the seed's record_on: an assignment on the sharder that shards replaces its facts, never
    # edits them
    template = cpshard.closed_form_sharder(cpshard.NoneLayout())
    cpshard.make_cp_batch_and_ctx(None, _batch(7), cp_sharder=template)
    latest = template.facts
    template.padded_seq_len = 9
    assert latest.padded_seq_len == 7 and template.facts is not latest
    assert (template.padded_seq_len, template.original_seq_len) == (9, 7)
    with pytest.raises(AttributeError):
        sharder.cp_mesh = None  # type: ignore[misc]


def test_a_sharder_subclass_comes_back_as_itself_bound_to_its_batch() -> None:
    class Tagged(cpshard.CPSharder):
        note = "mine"

        def hello(self) -> str:
            return f"hello from {self.note}"

    base = cpshard.closed_form_sharder(cpshard.NoneLayout())
    mine = Tagged(base.shard_batch, base.local_token_global_indices, layout="none")
    mine.note = "this one"
    _, local, bound = cpshard.make_cp_batch_and_ctx(None, _batch(6), cp_sharder=mine)
    assert isinstance(bound, Tagged) and bound is not mine and bound.is_bound
    assert bound.hello() == "hello from this one" and bound.padded_seq_len == 6
    assert torch.equal(bound.gather_token_tensor(local["input_ids"]), _batch(6)["input_ids"])


def test_facts_are_replaced_per_shard() -> None:
    template = cpshard.closed_form_sharder(cpshard.NoneLayout())
    ctx1, local1, first_bound = cpshard.make_cp_batch_and_ctx(None, _batch(7), cp_sharder=template)
    first = first_bound.facts
    assert first_bound.is_bound and not template.is_bound and template.facts is first
    first_bound.shard_token_tensor(torch.zeros(2, 7))  # fills the bound sharder's index cache
    index = first_bound._token_index(7, torch.device("cpu"))
    ctx2, local2, again = cpshard.make_cp_batch_and_ctx(None, _batch(5), cp_sharder=template)
    assert again is not first_bound and template.facts is again.facts and ctx2.facts is again.facts
    assert again.padded_seq_len == 5 and again.token_meta is not None
    assert first.padded_seq_len == 7 and ctx1.facts is first  # the old shard's facts unchanged
    assert again.shard_token_tensor(torch.ones(2, 5)).shape == (2, 5)
    # the template answers for its latest batch (the seed's holder) and detects an older one
    with pytest.raises(ValueError, match="another batch than this sharder"):
        template.gather_token_tensor(local1["input_ids"])
    assert torch.equal(template.gather_token_tensor(local2["input_ids"]), _batch(5)["input_ids"])
    # the bound sharder of the first batch cannot go stale: it still answers for its own batch
    assert first_bound.facts is first and first_bound.padded_seq_len == 7
    assert first_bound._token_index(7, torch.device("cpu")) is index  # cached per placement
    assert torch.equal(first_bound.gather_token_tensor(local1["input_ids"]), _batch(7)["input_ids"])
    assert_close(first_bound.shard_token_tensor(torch.ones(2, 7)), torch.ones(2, 7))
    with pytest.raises(ValueError, match="another batch than this sharder"):
        first_bound.gather_token_tensor(local2["input_ids"])
    # sharding through a bound sharder shards with its template, and binds a new one
    _, local3, third = cpshard.make_cp_batch_and_ctx(None, _batch(3), cp_sharder=first_bound)
    assert third is not first_bound and template.facts is third.facts
    assert first_bound.padded_seq_len == 7 and third.padded_seq_len == 3


def test_placement_is_the_one_copy_of_the_layout() -> None:
    """rank_map, token meta positions and caller coordinates all come from one placement."""
    _, _, sharder = cpshard.make_cp_batch_and_ctx(
        None, {"input_ids": torch.arange(6).reshape(2, 3), "seq_lens": [[2, 1], [3]]}
    )
    facts = sharder.facts
    place = facts.placement
    assert isinstance(place, cpshard.Placement) and facts.token_meta is not None
    assert facts.rank_map is place.rank_map and facts.token_meta.placement is place
    assert_close(facts.token_meta.positions, place.rank_map.reshape(1, -1))
    assert facts.input_token_stream_positions is place.coordinates.input_token_stream_positions
    assert facts.padded_seq_len == place.padded_len == place.coordinates.padded_seq_len
    assert_close(facts.token_meta.document_ids, place.stream_document_ids())
    with pytest.raises(dataclasses.FrozenInstanceError):
        place.rank_map = place.rank_map  # type: ignore[misc]
    with pytest.raises(ValueError, match="covers P=4 positions"):
        cpshard.Placement(
            torch.arange(4).view(2, 2), torch.zeros(1, 3, dtype=torch.long), place.coordinates
        )


def test_builtin_shard_brings_no_context_the_dispatcher_adds_attention() -> None:
    from cpshard.attention.context import active_mode, cp_context_active

    sharder = cpshard.closed_form_sharder(cpshard.NoneLayout())
    bare, _ = sharder.shard_batch(None, None, _batch(4))
    assert isinstance(bare, cpshard.CPContext) and bare.factory is None
    # Entering the bare shard context would run shard-local attention: it raises instead.
    for enter in (bare, lambda: bare):
        with pytest.raises(ValueError, match="added by the dispatcher"), enter():
            raise AssertionError("unreachable")
    assert not cp_context_active()
    direct, _, _ = sharder.shard(None, _batch(4))  # CPSharder.shard alone composes no attention
    with pytest.raises(ValueError, match="added by the dispatcher"):
        direct()
    ctx, _, _ = cpshard.make_cp_batch_and_ctx(None, _batch(4), cp_sharder=sharder)
    with ctx():
        assert cp_context_active()
    ring, _, _ = cpshard.make_cp_batch_and_ctx(
        None, _batch(4), cp_sharder=sharder, attention="ring"
    )
    with ring():  # the dispatcher's method, also for a sharder given as is
        mode = active_mode()
        assert mode is not None and mode.method == "ring" and mode.meta is sharder.token_meta
    with pytest.raises(ValueError, match="attention must be one of"):
        cpshard.make_cp_batch_and_ctx(None, _batch(4), cp_sharder=sharder, attention="flash")


def test_gather_rank_map_without_process_group() -> None:
    from cpshard.sharding.sharder import gather_rank_map

    assert gather_rank_map(torch.tensor([2, 0, 1]), None, 3).tolist() == [[2, 0, 1]]
    with pytest.raises(ValueError, match=r"rank 0's local_token_global_indices has 2 tokens"):
        gather_rank_map(torch.tensor([0, 1]), None, 3)


def test_model_sharder_without_any_map_raises() -> None:
    from torch import nn

    def shard(cp_mesh: object, tp_mesh: object, batch: dict[str, torch.Tensor], **kw: object):  # type: ignore[no-untyped-def]
        facts = cpshard.ShardFacts(None, 4)  # no rank map, and no way to compute one
        ctx = cpshard.CPContext(contextlib.nullcontext, facts)
        return ctx, {"input_ids": batch["input_ids"].clone()}

    class Owns(nn.Module):
        def prepare_model_inputs_for_cp(self, batch: object, *, num_chunks: int = 1) -> object:
            return {"cp_sharder": cpshard.CPSharder(shard, local_token_global_indices=None)}

    with pytest.raises(ValueError, match="data-dependent layout.*captured no rank map"):
        cpshard.prepare_cp_forward(Owns(), None, _batch(4))


def test_unknown_method_raises_before_the_model_hook_runs() -> None:
    from torch import nn

    calls: list[int] = []

    class Hooked(nn.Module):
        def prepare_model_inputs_for_cp(self, batch: object, *, num_chunks: int = 1) -> object:
            calls.append(num_chunks)  # FSDP2 would unshard parameters for this call
            return {}

    with pytest.raises(ValueError, match="attention must be one of"):
        cpshard.prepare_cp_forward(Hooked(), None, _batch(4), attention="flash")
    assert calls == []
    cpshard.prepare_cp_forward(Hooked(), None, _batch(4))
    assert calls == [1]


def _custom_sharder(ctx_of: object) -> cpshard.CPSharder:
    """A third-party sharder of dense rows at cp=1: identity map, ``ctx_of(facts)`` as context."""

    def shard(cp_mesh: object, tp_mesh: object, batch: dict[str, torch.Tensor], **kw: object):  # type: ignore[no-untyped-def]
        ids = batch["input_ids"]
        padded = torch.cat([ids, ids.new_zeros(ids.shape[0], 1)], 1)  # one CP pad slot
        facts = cpshard.ShardFacts(ids.shape[1], ids.shape[1] + 1)
        return ctx_of(facts), {"input_ids": padded}  # type: ignore[operator]

    def indices(cp_mesh: object, padded_seq_len: int, device: torch.device) -> torch.Tensor:
        return torch.arange(padded_seq_len, device=device)

    return cpshard.CPSharder(shard, indices)


def test_custom_context_factory_carrying_facts_installs_them() -> None:
    """A shard_batch may return any factory with a ``facts`` attribute (not only a CPContext):
    its facts are the sharder's, its context is the ctx."""
    entered: list[int] = []

    class Factory:
        def __init__(self, facts: cpshard.ShardFacts) -> None:
            self.facts = facts

        def __call__(self) -> contextlib.AbstractContextManager[None]:
            entered.append(1)
            return contextlib.nullcontext()

    ctx, local, sharder = cpshard.make_cp_batch_and_ctx(
        None, _batch(4), cp_sharder=_custom_sharder(Factory)
    )
    assert (sharder.original_seq_len, sharder.padded_seq_len) == (4, 5)
    assert ctx.facts is sharder.facts
    with ctx():
        pass
    assert entered == [1]
    t = torch.arange(8.0).reshape(2, 4)
    torch.testing.assert_close(
        sharder.shard_token_tensor(t, fill=-1.0), torch.cat([t, t.new_full((2, 1), -1.0)], 1)
    )
    back = sharder.gather_token_tensor(local["input_ids"], trim=True)
    assert torch.equal(back, _batch(4)["input_ids"])


def test_shard_batch_without_a_context_factory_raises() -> None:
    """``(None, batch)`` is no context: a clear TypeError at shard time, not attention that is
    silently shard-local under ``with ctx():``."""
    with pytest.raises(TypeError, match="must return a context factory"):
        cpshard.make_cp_batch_and_ctx(None, _batch(4), cp_sharder=_custom_sharder(lambda f: None))


def test_third_party_flattening_sharder_in_row_coordinates() -> None:
    """A custom shard_batch that flattens the rows into one stream (``input_row_shape``, no
    input positions): the verbs take and give back ``[B, S]`` tensors, as the contract says."""

    def shard(cp_mesh: object, tp_mesh: object, batch: dict[str, torch.Tensor], **kw: object):  # type: ignore[no-untyped-def]
        ids = batch["input_ids"]
        facts = cpshard.ShardFacts(None, ids.numel(), input_row_shape=tuple(ids.shape))
        return cpshard.CPContext(contextlib.nullcontext, facts), {"input_ids": ids.reshape(1, -1)}

    def indices(cp_mesh: object, padded_seq_len: int, device: torch.device) -> torch.Tensor:
        return torch.arange(padded_seq_len, device=device)

    _, local, sharder = cpshard.make_cp_batch_and_ctx(
        None, _batch(3), cp_sharder=cpshard.CPSharder(shard, indices)
    )
    adv = torch.arange(6.0).reshape(2, 3)
    assert torch.equal(sharder.shard_token_tensor(adv), adv.reshape(1, 6))
    assert torch.equal(
        sharder.gather_token_tensor(local["input_ids"], trim=True), _batch(3)["input_ids"]
    )


def test_shard_bringing_no_context_and_no_token_meta_raises() -> None:
    """``CPContext(None, facts)`` asks the dispatcher for CP attention over ``facts.token_meta``;
    without a token meta there is nothing to attend over: a clear error at shard time instead of
    a ctx under which attention is silently shard-local."""

    def shard(cp_mesh: object, tp_mesh: object, batch: dict[str, torch.Tensor], **kw: object):  # type: ignore[no-untyped-def]
        facts = cpshard.ShardFacts(4, 4)
        return cpshard.CPContext(None, facts), {"input_ids": batch["input_ids"].clone()}

    sharder = cpshard.CPSharder(shard, lambda mesh, p, device: torch.arange(p, device=device))
    with pytest.raises(ValueError, match="brings no context of its own and no token meta"):
        cpshard.make_cp_batch_and_ctx(None, _batch(4), cp_sharder=sharder)
