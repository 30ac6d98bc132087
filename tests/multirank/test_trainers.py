"""HF Trainer and TRL (SFT with padding-free packing, GRPO) under cpshard CP == one process.

Each CP run (``cpshard.integrations``, gloo ranks of the pool, accelerate joining their group as
under torchrun) is compared with the stock trainer in this process on the dp replicas' batches:
the loss of every step (GRPO also its logged entropy and reward) and the final weights, fp32.
The GRPO runs give the CP followers a different generation seed, so they match only because
the CP trainer broadcasts its leader's completions.

In bf16 (TRL's ``SFTConfig`` / ``GRPOConfig`` defaults, ``TrainingArguments(bf16=True)``: the
forward under CPU autocast, whose SDPA calls get fp32 q/k and a bf16 v) the CP runs crashed on
every rank ("q, k, v must share a dtype"); they are compared with the stock trainer in bf16 at
the tolerances of ``_autocast_fns.py`` (bf16 keeps 8 bits of mantissa and CP attention sums in
another order: about one bf16 ulp per attention output; measured <= 2e-5 relative on the losses
and <= 4e-4 on the weights, which move by ~0.07 in 3 steps).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch.testing import assert_close

from _ranks import Ranks

pytest.importorskip("trl")
pytest.importorskip("accelerate")
import trl.trainer.grpo_trainer  # noqa: F401  # before the pool forks: its ranks inherit it
from _autocast_fns import LOSS_TOL, WEIGHT_TOL
from _trainer_fns import (
    bad_cp_size_raises_on_every_rank,
    ddp_over_a_subgroup_raises,
    in_one_process,
    on_ranks,
    scored_pads_raise_on_every_rank,
)

pytestmark = pytest.mark.multirank

STEPS = 2


@pytest.fixture(scope="module")
def ranks() -> Iterator[Ranks]:
    """A pool of its own: forked after trl is imported (the shared pools' ranks would import
    it themselves, ~1 min on 2 loaded cores), and accelerate's process state stays in it."""
    pool = Ranks()
    yield pool
    pool.close()


FP32_TOL = {"rtol": 1e-5, "atol": 1e-6}


def _same(
    cp: dict[str, Any],
    ref: dict[str, Any],
    steps: int = STEPS,
    logs_tol: dict[str, float] = FP32_TOL,
    weights_tol: dict[str, float] = FP32_TOL,
) -> None:
    assert len(cp["logs"]["loss"]) == steps
    for key, got in cp["logs"].items():
        if not got:  # CPSFTTrainer logs no SFT metrics (entropy)
            continue
        want = ref["logs"][key]
        assert len(got) == len(want), key
        assert_close(torch.tensor(got), torch.tensor(want), **logs_tol, msg=key)
    # the weights trained (by far more than the tolerance), so equal weights mean equal updates
    assert ref["moved"] > max(1e-3, 20 * weights_tol["atol"]), ref["moved"]
    for name, w in ref["weights"].items():
        assert_close(cp["weights"][name], w, **weights_tol, msg=name)


@pytest.mark.parametrize(("world", "ga"), [(2, 1), (4, 2)], ids=["cp2", "dp2xcp2"])
def test_sft_padding_free_matches_one_process(ranks: Ranks, world: int, ga: int) -> None:
    cp = ranks(world, on_ranks, "sft", 2, 2, STEPS, ga, timeout=600)[0]
    ref = in_one_process("sft", 2 * world // 2, STEPS, ga)
    assert len(ref["losses"]) == STEPS
    _same(cp, ref)


@pytest.mark.parametrize("world", [2, 4], ids=["cp2", "dp2xcp2"])
def test_grpo_matches_one_process(ranks: Ranks, world: int) -> None:
    cp = ranks(world, on_ranks, "grpo", 2, 2, STEPS, timeout=600)[0]
    ref = in_one_process("grpo", 2 * world // 2, STEPS)
    assert len(ref["logs"]["entropy"]) == STEPS
    _same(cp, ref)


def test_trainer_padded_rows_match_one_process(ranks: Ranks) -> None:
    cp = ranks(2, on_ranks, "trainer", 2, 2, STEPS, 1, timeout=600)[0]
    _same(cp, in_one_process("trainer", 2, STEPS, 1))


BF16_STEPS = 3
BF16_ARGS = {"trainer": (2, BF16_STEPS, 1), "sft": (2, BF16_STEPS, 1), "grpo": (2, BF16_STEPS)}


@pytest.mark.parametrize("world", [2, 3], ids=["cp2", "cp3"])
@pytest.mark.parametrize("what", ["trainer", "sft", "grpo"])
def test_bf16_defaults_match_one_process_in_bf16(ranks: Ranks, what: str, world: int) -> None:
    cp = ranks(world, on_ranks, f"{what}:bf16", world, *BF16_ARGS[what], timeout=600)[0]
    ref = in_one_process(f"{what}:bf16", *BF16_ARGS[what])
    _same(cp, ref, BF16_STEPS, LOSS_TOL, WEIGHT_TOL)


def test_sft_epoch_with_a_partial_last_batch_matches_one_process(ranks: Ranks) -> None:
    """18 documents pack into 9 rows: at cp=2 (one replica) the epoch's 5th batch holds one row,
    as in one process (accelerate, which sharded for 2 processes, would complete it with repeated
    rows)."""
    cp = ranks(2, on_ranks, "sft", 2, 2, -1, 1, True, 18, timeout=600)[0]
    _same(cp, in_one_process("sft", 2, -1, 1, True, 18), steps=5)


def test_sft_epoch_at_dp2xcp2_matches_dp2_without_cp(ranks: Ranks) -> None:
    """With 2 replicas accelerate completes the last global batch (9 rows = 4 + 4 + 1) with
    repeated rows, in a run without CP too: dp=2 x cp=2 matches stock SFT on 2 ranks, which
    is what one replica per process gives (not one process with the replicas' batches)."""
    cp = ranks(4, on_ranks, "sft", 2, 2, -1, 1, True, 18, timeout=600)[0]
    _same(cp, ranks(2, on_ranks, "sft", None, 2, -1, 1, True, 18, timeout=600)[0], steps=3)


@pytest.mark.parametrize("world", [2, 4], ids=["cp2", "dp2xcp2"])
def test_trainer_left_padded_rows_match_one_process(ranks: Ranks, world: int) -> None:
    """Left padding whose collator gives no pad a target: 3 steps exact."""
    cp = ranks(world, on_ranks, "trainer", 2, 2, 3, 1, "left", False, timeout=600)[0]
    _same(cp, in_one_process("trainer", 2 * world // 2, 3, 1, "left", False), steps=3)


def test_trainer_scored_pads_raise_on_every_rank(ranks: Ranks) -> None:
    """Left padding with transformers' own collator scores the pad before each row's first
    token (its logits depend on the attention implementation): refused on every rank, also on
    replica 1, whose batch has no such pad, before the first step."""
    out = ranks(4, scored_pads_raise_on_every_rank, timeout=600)
    assert len({msg for msg, _ in out}) == 1 and "labels[:, 1:][attention_mask" in out[0][0]
    assert [n > 0 for _, n in out] == [True, True, False, False]


def test_bad_settings_raise_on_every_rank_before_a_step(ranks: Ranks) -> None:
    msgs = ranks(4, bad_cp_size_raises_on_every_rank, timeout=600)
    assert len(set(msgs)) == 1 and "world size 4" in msgs[0]
    assert ranks(4, ddp_over_a_subgroup_raises) == ["ok"] * 4
