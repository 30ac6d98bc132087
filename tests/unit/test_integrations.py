"""cpshard.integrations without a process group: batch conversion and every refused setting.

The runs against the stock trainers are in tests/multirank/test_trainers.py.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch

pytest.importorskip("trl")
pytest.importorskip("accelerate")

from accelerate.data_loader import BatchSamplerShard

import cpshard
from cpshard.integrations.hf_trainer import (
    CPSetup,
    _check_args,
    _checkpoint_under_cp,
    check_cp_size,
    cp_batch_from_trainer_inputs,
    shard_dataloader_by_dp,
)
from cpshard.integrations.trl_trainers import _check_grpo


class _Stream(torch.utils.data.IterableDataset[int]):
    def __iter__(self) -> Any:
        return iter(range(3))


def test_padding_free_rows_become_a_packed_batch_with_document_labels() -> None:
    """TRL's padding-free collator output: one row, positions restarting per document, labels
    -100 at document starts, cu_seq_lens_*; cpshard gets seq_lens and pre-shifted labels."""
    ids = torch.arange(10, 19).view(1, 9)
    pos = torch.tensor([[0, 1, 2, 0, 1, 0, 1, 2, 3]])
    labels = ids.masked_fill(pos == 0, -100)
    inputs = {"input_ids": ids, "labels": labels, "position_ids": pos,
              "cu_seq_lens_q": torch.tensor([0, 3, 5, 9], dtype=torch.int32),
              "cu_seq_lens_k": torch.tensor([0, 3, 5, 9], dtype=torch.int32),
              "max_length_q": 4, "max_length_k": 4, "seq_idx": torch.zeros(1, 9)}  # fmt: skip
    batch = cp_batch_from_trainer_inputs(inputs)
    assert set(batch) == {"input_ids", "labels", "seq_lens", "position_ids"}
    assert batch["seq_lens"] == [[3, 2, 4]] and batch["position_ids"] is pos
    assert batch["labels"].tolist() == [[11, 12, -100, 14, -100, 16, 17, 18, -100]]
    assert torch.equal(inputs["labels"], labels)  # not modified
    # The count the Trainer makes on the unshifted labels is the count of the shifted ones.
    assert int((labels[:, 1:] != -100).sum()) == cpshard.loss.count_tokens(batch["labels"])
    # cu_seq_lens alone (no position_ids) describe the same documents.
    no_pos = {k: v for k, v in inputs.items() if k != "position_ids"}
    assert cp_batch_from_trainer_inputs(no_pos)["seq_lens"] == [[3, 2, 4]]
    # The dispatcher picks a packed layout for it, at cp_mesh=None too.
    _, local, sharder = cpshard.make_cp_batch_and_ctx(None, batch)
    assert sharder.layout == "balanced" and local["input_ids"].shape == (1, 9)


def test_padded_rows_keep_their_mask_and_shift_like_the_model() -> None:
    """The targets are the model's shift over the row, so their count is the Trainer's
    num_items_in_batch (labels[:, 1:] != -100); a pad whose target is scored is refused."""
    ids = torch.tensor([[5, 6, 7, 0], [0, 8, 9, 10]])
    mask = (ids != 0).long()
    labels = ids.masked_fill(mask == 0, -100)
    with pytest.raises(ValueError, match=r"score 1 padded position.*\(row 1, position 0\).*-100"):
        cp_batch_from_trainer_inputs({"input_ids": ids, "attention_mask": mask, "labels": labels})
    fixed = labels.clone()
    fixed[:, 1:][mask[:, :-1] == 0] = -100  # the fix the error names
    batch = cp_batch_from_trainer_inputs({"input_ids": ids, "attention_mask": mask,
                                          "labels": fixed})  # fmt: skip
    assert set(batch) == {"input_ids", "labels", "attention_mask"}
    assert batch["labels"].tolist() == [[6, 7, -100, -100], [-100, 9, 10, -100]]
    assert cpshard.loss.count_tokens(batch["labels"]) == int((fixed[:, 1:] != -100).sum())
    # right padding whose pads keep their labels: the first pad would predict the second
    right = torch.tensor([[5, 6, 0, 0]])
    with pytest.raises(ValueError, match=r"score 1 padded position.*\(row 0, position 2\)"):
        cp_batch_from_trainer_inputs({"input_ids": right, "labels": right,
                                      "attention_mask": (right != 0).long()})  # fmt: skip
    given = torch.full_like(ids, -100)
    out = cp_batch_from_trainer_inputs({"input_ids": ids, "shift_labels": given})
    assert out["labels"] is given  # pre-shifted labels are taken as they are


def test_batches_cpshard_cannot_shard_are_refused() -> None:
    ids = torch.ones(1, 4, dtype=torch.long)
    with pytest.raises(ValueError, match=r"keys \['pixel_values'\]"):
        cp_batch_from_trainer_inputs({"input_ids": ids, "labels": ids, "pixel_values": ids})
    with pytest.raises(ValueError, match="neither labels nor shift_labels"):
        cp_batch_from_trainer_inputs({"input_ids": ids})
    with pytest.raises(ValueError, match="no input_ids"):
        cp_batch_from_trainer_inputs({"labels": ids})


def test_cp_size_must_be_an_int_dividing_the_world() -> None:
    assert check_cp_size(2, 4) == 2
    with pytest.raises(ValueError, match=r"cp_size=3 must divide .*world size 4"):
        check_cp_size(3, 4)
    for bad in (0, -2, 2.0, True, "2"):
        with pytest.raises(ValueError, match="cp_size=.* must be an int >= 1"):
            check_cp_size(bad, 4)


def _trainer(**overrides: Any) -> SimpleNamespace:
    args = SimpleNamespace(
        parallelism_config=None, deepspeed=None, fsdp=None, train_sampling_strategy="random",
        accelerator_config=SimpleNamespace(dispatch_batches=None, split_batches=False),
        eval_strategy="no", average_tokens_across_devices=True, label_smoothing_factor=0.0,
    )  # fmt: skip
    trainer = SimpleNamespace(
        args=args, accelerator=SimpleNamespace(parallelism_config=None),
        train_dataset=[1, 2, 3], compute_loss_func=None, model=torch.nn.Linear(2, 2),
    )  # fmt: skip
    for key, value in overrides.items():
        target = args if hasattr(args, key) else trainer
        setattr(target, key, value)
    return trainer


@pytest.mark.parametrize(
    ("setting", "value", "named"),
    [
        ("parallelism_config", SimpleNamespace(cp_size=2), "parallelism_config"),
        ("fsdp", "full_shard", "deepspeed/fsdp"),
        ("train_sampling_strategy", "batch_rebalance", "train_sampling_strategy"),
        ("accelerator_config", SimpleNamespace(dispatch_batches=True), "dispatch_batches"),
        ("accelerator_config", SimpleNamespace(split_batches=True), "split_batches"),
        ("eval_strategy", "steps", "eval_strategy"),
        ("average_tokens_across_devices", False, "average_tokens_across_devices"),
        ("label_smoothing_factor", 0.1, "label_smoothing_factor"),
        ("compute_loss_func", print, "compute_loss_func"),
        ("train_dataset", _Stream(), "train_dataset"),
    ],
)
def test_settings_that_contradict_cp_are_named(setting: str, value: Any, named: str) -> None:
    _check_args(_trainer(), 2)  # the defaults pass
    with pytest.raises(ValueError, match=f"CP trainer: .*{named}.*Fix: "):
        _check_args(_trainer(**{setting: value}), 2)


def _cp(world: int, rank: int, cp: int) -> CPSetup:
    return CPSetup(cp, world, rank, None, 0, "all_gather", "auto")  # type: ignore[arg-type]


def test_the_dataloader_shard_follows_the_dp_replicas() -> None:
    base = torch.utils.data.BatchSampler(range(16), batch_size=2, drop_last=False)
    for rank in range(4):  # world 4 = dp 2 x cp 2: ranks 0, 1 -> replica 0; 2, 3 -> replica 1
        shard = BatchSamplerShard(base, num_processes=4, process_index=rank)
        loader = SimpleNamespace(batch_sampler=shard)
        assert shard_dataloader_by_dp(loader, _cp(4, rank, 2)) is loader
        assert (shard.num_processes, shard.process_index) == (2, rank // 2)
        want = [[0, 1], [4, 5]] if rank < 2 else [[2, 3], [6, 7]]
        assert list(shard)[:2] == want


def test_one_replica_keeps_the_epochs_partial_last_batch() -> None:
    """cp=2 on 2 ranks is one replica: 5 samples in batches of 2 end with [4], as in one
    process; accelerate's shard (made for 2 processes) would complete it as [4, 0]. Two
    replicas keep accelerate's completion, as a run without CP on 2 processes does."""
    base = torch.utils.data.BatchSampler(range(5), batch_size=2, drop_last=False)
    for rank in range(2):
        shard = BatchSamplerShard(base, num_processes=2, process_index=rank)
        shard_dataloader_by_dp(SimpleNamespace(batch_sampler=shard), _cp(2, rank, 2))
        assert list(shard) == [[0, 1], [2, 3], [4]] and len(shard) == 3
    two = BatchSamplerShard(base, num_processes=4, process_index=3)
    shard_dataloader_by_dp(SimpleNamespace(batch_sampler=two), _cp(4, 3, 2))
    assert list(two) == list(BatchSamplerShard(base, num_processes=2, process_index=1))
    assert len(list(two)[-1]) == 2  # completed with repeated samples


def test_a_rank_aware_sampler_or_an_unsharded_loader_is_refused() -> None:
    sampler = torch.utils.data.DistributedSampler(range(16), num_replicas=4, rank=1)
    shard = BatchSamplerShard(torch.utils.data.BatchSampler(sampler, 2, False), 4, 1)
    with pytest.raises(ValueError, match="train sampler=.*DistributedSampler.*rank-aware"):
        shard_dataloader_by_dp(SimpleNamespace(batch_sampler=shard), _cp(4, 1, 2))
    plain = torch.utils.data.BatchSampler(range(4), 2, False)
    with pytest.raises(ValueError, match="not sharded by accelerate's BatchSamplerShard"):
        shard_dataloader_by_dp(SimpleNamespace(batch_sampler=plain), _cp(4, 1, 2))


def test_activation_checkpointing_recomputes_under_cp() -> None:
    args = SimpleNamespace(activation_checkpointing=True, activation_checkpointing_kwargs=None)
    _checkpoint_under_cp(args)
    assert args.activation_checkpointing_kwargs == {
        "use_reentrant": False, "context_fn": cpshard.attention.checkpoint_context_fn,
    }  # fmt: skip
    bad = SimpleNamespace(activation_checkpointing=True,
                          activation_checkpointing_kwargs={"use_reentrant": True})  # fmt: skip
    with pytest.raises(ValueError, match=r"activation_checkpointing_kwargs\['use_reentrant'\]"):
        _checkpoint_under_cp(bad)


def _grpo(**overrides: Any) -> SimpleNamespace:
    args = SimpleNamespace(per_device_train_batch_size=2, steps_per_generation=1,
                           generation_batch_size=8)  # fmt: skip
    trainer = SimpleNamespace(args=args, num_generations=2, scale_rewards="group",
                              multi_objective_aggregation="sum_then_normalize")  # fmt: skip
    for key, value in overrides.items():
        setattr(args if hasattr(args, key) else trainer, key, value)
    return trainer


@pytest.mark.parametrize(
    ("setting", "value"),
    [("num_generations", 4), ("scale_rewards", "batch"),
     ("multi_objective_aggregation", "normalize_then_sum"), ("generation_batch_size", 6)],
)  # fmt: skip
def test_grpo_settings_that_contradict_cp_are_named(setting: str, value: Any) -> None:
    _check_grpo(_grpo(), 2)
    with pytest.raises(ValueError, match=f"CP trainer: {setting}="):
        _check_grpo(_grpo(**{setting: value}), 2)


def test_evaluation_under_cp_is_refused_by_name() -> None:
    from cpshard.integrations.hf_trainer import CPDataMixin

    trainer = object.__new__(CPDataMixin)
    trainer.cp = _cp(4, 0, 2)
    with pytest.raises(ValueError, match=r"evaluate\(\)='cp_size=2' is not sharded"):
        trainer.get_eval_dataloader()


def test_a_trl_without_the_overridden_methods_is_refused() -> None:
    from cpshard.integrations.trl_trainers import CPGRPOMixin

    class Renamed:  # a TRL release whose GRPO methods have other names
        def __init__(self, **_: Any) -> None:
            pass

    cls = type("Drifted", (CPGRPOMixin, Renamed), {})
    with pytest.raises(TypeError, match="_generate_single_turn.*install trl 1.16"):
        cls(cp_size=2)
