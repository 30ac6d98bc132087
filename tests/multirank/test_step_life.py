"""The step's life on every rank (``cpshard.guards.step``): no hang, no one-rank abort.

A rank that leaves a phase of its step at a phase boundary (it skips the backward or
``sync_grads``, its backward raises before its first CP collective, an exception leaves ``ctx()``
after the forward) meets its peers' step header: every rank raises the same error, and the ranks
are in step again. A rank that leaves a phase in the middle raises locally at its next call.
Out-of-step cases run on a pool of their own with a short process-group timeout, so a broken
group (today's gloo abort, or a wait) fails the test instead of poisoning others.
"""

from __future__ import annotations

import pytest
from _step_fns import (
    ODD_RANK,
    attention_differs,
    check_consistency_on_some_ranks,
    every_rank_raised,
    every_rank_raises_then_fresh_mesh,
    frozen_on_one_rank,
    leave_in_the_middle,
    leave_the_step,
    mask_dtypes_differ,
    mesh_without_this_rank,
    pad_id_outside_vocabulary,
    position_ids_of_two_sections,
    seq_dim_spelled_differently,
    sync_misuse,
    sync_on_dp_mesh,
    two_models_one_mesh,
    window_first_met_compiled,
)

from _ranks import Ranks
from cpshard.tools.launch import LocalRanks, RankFailure

pytestmark = pytest.mark.multirank

PG_TIMEOUT_S = 20.0  # a rank waits this long in a collective its peers never join
WAIT_S = 120.0  # generous: only a true hang (or today's abort) exceeds it


BACKWARD = "rank 0 runs the backward's first CP attention call"
NEW_STEP = f"rank {ODD_RANK} started a new step"
FAILED = f"rank {ODD_RANK} raised an exception inside ctx()"


@pytest.mark.parametrize(
    ("case", "doing"),
    [
        # the odd rank skips the backward but not the sync: it meets its peer's backward there
        ("skip_backward", f"{BACKWARD}; rank {ODD_RANK} runs cpshard.sync_grads"),
        ("backward_error", f"{BACKWARD}; {NEW_STEP}"),
        ("skip_sync", f"rank 0 runs cpshard.sync_grads; {NEW_STEP}"),
    ],
)
def test_a_rank_that_leaves_the_step_raises_with_its_peers(case: str, doing: str) -> None:
    with LocalRanks(2, pg_timeout_s=PG_TIMEOUT_S) as pool:
        out = pool.run(leave_the_step, case, timeout_s=WAIT_S)
    messages = [o["message"] for o in out]
    assert len(set(messages)) == 1, messages  # the same error on every rank
    assert "out of step" in messages[0] and doing in messages[0], messages[0]
    assert out[0]["after"] == pytest.approx(out[1]["after"])  # in step again: a full step works


def test_an_exception_leaving_ctx_after_the_forward_tells_the_peers_at_once() -> None:
    """The odd rank's exception leaves ctx() after its forward: its peer raises in its backward,
    naming it; the odd rank gets its own exception (its loop catches it), and both are in step."""
    with LocalRanks(2, pg_timeout_s=PG_TIMEOUT_S) as pool:
        out = pool.run(leave_the_step, "raise_in_ctx_after_forward", timeout_s=WAIT_S)
    assert out[ODD_RANK]["message"] == "", out  # its own exception, caught by its loop
    other = out[1 - ODD_RANK]["message"]
    assert "out of step" in other and f"{BACKWARD}; {FAILED}" in other, other
    assert out[0]["after"] == pytest.approx(out[1]["after"])


def test_a_pad_id_outside_an_unreadable_vocabulary_fails_every_rank_fast() -> None:
    """The ranks holding CP pad slots fail in the embedding; the others raise at once, naming
    them, instead of waiting in the forward's first CP collective."""
    with LocalRanks(2, pg_timeout_s=PG_TIMEOUT_S) as pool:
        out = pool.run(pad_id_outside_vocabulary, timeout_s=WAIT_S)
    kinds = sorted(m.split(":")[0] for m in out)
    assert kinds == ["IndexError", "OutOfStepError"], out
    assert "raised an exception inside ctx()" in next(m for m in out if "OutOfStep" in m), out


@pytest.mark.parametrize(
    ("case", "names"),
    [
        ("forward", "in the middle of the model's forward"),
        ("backward", "last backward() stopped in the middle"),
    ],
)
def test_a_rank_that_leaves_midway_raises_locally(case: str, names: str) -> None:
    with (
        LocalRanks(2, pg_timeout_s=4.0, grace_s=WAIT_S) as pool,
        pytest.raises(RankFailure) as err,
    ):
        pool.run(leave_in_the_middle, case, timeout_s=WAIT_S)
    outcomes = err.value.outcomes
    assert not [o.rank for o in outcomes if o.status == "no answer"], outcomes
    odd = outcomes[ODD_RANK]
    assert odd.status == "raised", odd  # in Python, not a gloo abort
    assert "out of step" in odd.detail and names in odd.detail, odd.detail
    assert "Timed out" not in odd.detail, odd.detail  # it entered no collective
    other = outcomes[1 - ODD_RANK]
    assert other.status in ("raised", "died"), other  # the process-group timeout ends its wait


@pytest.mark.parametrize(
    ("case", "expect"),
    [
        ("forgotten", "sync_grads(model, cp_mesh) was not called"),
        ("doubled", "called again with no backward()"),
        ("per_micro_batch", "already summed"),
        ("accumulate", "no error"),
    ],
)
def test_sync_grads_misuse_raises_on_every_rank(ranks: Ranks, case: str, expect: str) -> None:
    out = ranks(2, sync_misuse, case, timeout=WAIT_S)
    assert len(set(out)) == 1, out
    assert expect in out[0], out[0]


def test_every_rank_raises_mid_forward_then_a_fresh_mesh_trains_on(ranks: Ranks) -> None:
    """Refused though valid no more: when every rank raised the same error mid-forward, the
    message names the way on (a new mesh object over the same group) and training goes on."""
    out = ranks(2, every_rank_raises_then_fresh_mesh, timeout=WAIT_S)
    assert out[0] == out[1], out


@pytest.mark.parametrize("doubled", [False, True])
def test_two_models_on_one_mesh(ranks: Ranks, doubled: bool) -> None:
    """Actor and critic synced one after the other are no doubled sync (the record of the
    first model's gradients is not the second's); a real doubled sync still raises."""
    out = ranks(2, two_models_one_mesh, doubled, timeout=WAIT_S)
    assert len(set(out)) == 1, out
    expect = "called again with no backward()" if doubled else "no error"
    assert expect in out[0], out[0]


def test_sync_grads_on_the_dp_mesh_raises(ranks: Ranks) -> None:
    out = ranks(4, sync_on_dp_mesh, timeout=WAIT_S)
    assert all("not the data-parallel one" in m for m in out), out


@pytest.mark.parametrize("where", ["sync", "prepare"])
def test_a_parameter_frozen_on_one_rank_raises_everywhere(ranks: Ranks, where: str) -> None:
    out = ranks(2, frozen_on_one_rank, where, timeout=WAIT_S)
    assert len(set(out)) == 1, out
    assert "frozen" in out[0] or "trainable" in out[0], out[0]


def test_check_consistency_on_some_ranks_only(ranks: Ranks) -> None:
    out = ranks(3, check_consistency_on_some_ranks, timeout=WAIT_S)
    assert len(set(out)) == 1 and "check_consistency" in out[0], out


@pytest.mark.parametrize("what", ["dtype", "heads"])
def test_attention_that_differs_on_one_rank(ranks: Ranks, what: str) -> None:
    out = ranks(2, attention_differs, what, timeout=WAIT_S)
    assert len(set(out)) == 1 and "dtypes, head counts" in out[0], out


def test_a_mesh_without_this_rank(ranks: Ranks) -> None:
    out = ranks(3, mesh_without_this_rank, timeout=WAIT_S)
    assert out[0] == out[1] and out[0].startswith("sharded"), out
    assert "does not contain this rank" in out[2], out[2]


@pytest.mark.parametrize("where", ["first_attention_call", "after_forward"])
def test_later_prepares_work_after_every_rank_raised(ranks: Ranks, where: str) -> None:
    cp = ranks(2, every_rank_raised, where, timeout=WAIT_S)
    (one,) = ranks(1, every_rank_raised, where, timeout=WAIT_S)
    assert cp[0] == pytest.approx(one, rel=1e-5) and cp[1] == pytest.approx(one, rel=1e-5)


def test_long_and_bool_attention_masks_with_equal_values(ranks: Ranks) -> None:
    out = ranks(2, mask_dtypes_differ, timeout=WAIT_S)
    assert len(out) == 2


def test_seq_dim_spelled_differently_across_ranks(ranks: Ranks) -> None:
    out = ranks(2, seq_dim_spelled_differently, timeout=WAIT_S)
    assert out[0] == out[1]


@pytest.mark.parametrize("world", [2, 3])
def test_position_ids_of_two_sections_are_not_mrope(ranks: Ranks, world: int) -> None:
    out = ranks(world, position_ids_of_two_sections, timeout=WAIT_S)
    assert len(set(out)) == 1 and "first dim must be 3" in out[0], out


def test_a_window_first_met_under_fullgraph_compile(ranks: Ranks) -> None:
    out = ranks(2, window_first_met_compiled, "all_gather", timeout=WAIT_S)
    assert len(set(out)) == 1 and "first met inside a torch.compile'd region" in out[0], out
    assert "for_method(method, causal, window, device)" in out[0], out[0]
    # the default, attention="auto": choosing the method is host work too
    out = ranks(2, window_first_met_compiled, "auto", timeout=WAIT_S)
    assert len(set(out)) == 1 and "first met inside a torch.compile'd region" in out[0], out
    assert "('auto')" in out[0] and "pass an explicit method" in out[0], out[0]
