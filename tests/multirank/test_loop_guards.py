"""Real training loops stay exact for many steps, and their silent mistakes raise on every rank
(``cpshard.guards.step``): the step record is the CP group's (``mesh["cp"]`` written inline
shares it), a forgotten sync shows as weights that differ across the CP ranks (compared through
the prepare's step header), so FSDP2 over dp x cp and a hand-written all-reduce pass; a module
shared by two synced models is summed once; ``sync_grads`` on gradients no CP forward made
raises. Loops run 3 optimizer steps against one process without CP.
"""

from __future__ import annotations

import pytest
from _loop_guard_fns import (
    ODD_RANK,
    STEPS,
    compare,
    convert_after_sync,
    forgotten_sync_under_fsdp,
    fsdp_gradient_checks,
    mistakes_after_conversion,
    no_cp_backward,
    one_process,
    own_all_reduce,
    record_of_the_group,
    shared_module,
    shared_module_synced_twice,
    shared_module_touched_on_one_rank,
    weights_differ,
    weights_differ_later,
)

from _ranks import Ranks

pytestmark = pytest.mark.multirank


@pytest.mark.parametrize("world", [2, 3])
def test_own_all_reduce_instead_of_sync_grads_matches_one_process(ranks: Ranks, world: int) -> None:
    want = one_process(own_all_reduce)
    for got in ranks(world, own_all_reduce):
        compare(got, want)


@pytest.mark.parametrize("backward", ["separate", "joint"])
@pytest.mark.parametrize("world", [2, 3])
def test_two_models_sharing_a_module_each_synced_match_one_process(
    ranks: Ranks, world: int, backward: str
) -> None:
    """The shared trunk's gradient is summed once per step, not once per sync_grads."""
    want = one_process(shared_module, backward)
    for got in ranks(world, shared_module, backward):
        compare(got, want)


def test_a_shared_module_synced_twice_is_still_a_doubled_sync(ranks: Ranks) -> None:
    out = ranks(2, shared_module_synced_twice)
    assert len(set(out)) == 1 and "called again with no backward()" in out[0], out


@pytest.mark.parametrize("world", [2, 3])
def test_a_shared_gradient_changed_on_one_rank_raises_on_every_rank(
    ranks: Ranks, world: int
) -> None:
    out = ranks(world, shared_module_touched_on_one_rank)
    assert len(set(out)) == 1 and "'body.norm.weight'" in out[0], out
    assert "some CP ranks but not on others" in out[0], out[0]


@pytest.mark.parametrize("world", [2, 3])
def test_a_verdict_of_one_rank_alone_raises_on_every_rank(ranks: Ranks, world: int) -> None:
    out = ranks(world, shared_module_touched_on_one_rank, False)
    assert len(set(out)) == 1 and "already summed" in out[0], out
    assert f"(ranks [{ODD_RANK}])" in out[0], out[0]


def test_every_slice_of_one_mesh_shares_the_step_record(ranks: Ranks) -> None:
    ranks(4, record_of_the_group)


@pytest.mark.parametrize(
    ("case", "names"),
    [("manual_seed(rank)", "parameter embed.weight"), ("persistent_buffer", "buffer running")],
)
@pytest.mark.parametrize("world", [2, 3])
def test_weights_that_differ_across_cp_ranks_raise_at_the_first_prepare(
    ranks: Ranks, world: int, case: str, names: str
) -> None:
    out = ranks(world, weights_differ, case)
    assert len(set(out)) == 1, out  # the same error on every rank
    assert "weights differ across the CP ranks" in out[0] and names in out[0], out[0]
    assert "manual_seed(rank)" in out[0], out[0]  # the likely cause, and its fix


@pytest.mark.parametrize(
    ("case", "world"), [("in place", 2), ("new storage", 3), ("new parameter", 2), ("frozen", 2)]
)
def test_weights_that_change_on_one_rank_after_kept_prepares_raise_on_every_rank(
    ranks: Ranks, case: str, world: int
) -> None:
    out = ranks(world, weights_differ_later, case)
    assert len(set(out)) == 1 and out[0].startswith("step 2: "), out  # every rank, at once
    if case == "frozen":
        assert "the model's parameters and buffers" in out[0], out[0]
    else:
        assert "weights differ across the CP ranks" in out[0], out[0]
        assert "parameter embed.weight" in out[0], out[0]


@pytest.mark.parametrize("case", ["non_persistent_buffer", "check_consistency=False"])
def test_caches_and_the_opt_out_are_not_compared(ranks: Ranks, case: str) -> None:
    assert ranks(2, weights_differ, case) == ["no error"] * 2


@pytest.mark.parametrize("case", ["fsdp2", "swap flag"])
def test_a_model_converted_in_place_after_synced_steps_goes_on(ranks: Ranks, case: str) -> None:
    assert ranks(2, convert_after_sync, case) == ["ok", "ok"]


@pytest.mark.parametrize(
    ("case", "message"),
    [("sync again", "called again with no backward"), ("no CP forward", "no CP forward produced")],
)
def test_sync_mistakes_after_a_conversion_still_raise(
    ranks: Ranks, case: str, message: str
) -> None:
    out = ranks(2, mistakes_after_conversion, case)
    assert len(set(out)) == 1 and message in out[0], out


@pytest.mark.parametrize(
    ("set_to_none", "micro", "mistake", "message"),
    [
        (False, 1, "", "ok"),  # zeroed in place: a false "accumulated" before
        (False, 2, "", "ok"),
        (True, 2, "", "ok"),
        (False, 2, "per micro-batch", "still hold the gradients the last sync_grads"),
        (False, 1, "twice", "called again with no backward"),
    ],
)
def test_sync_grads_reads_fsdp2_gradients_right(
    ranks: Ranks, set_to_none: bool, micro: int, mistake: str, message: str
) -> None:
    out = ranks(4, fsdp_gradient_checks, set_to_none, micro, mistake)
    assert len(set(out)) == 1 and message in out[0], out


def test_a_forgotten_sync_under_fsdp_over_dp_raises_at_the_next_prepare(ranks: Ranks) -> None:
    out = ranks(4, forgotten_sync_under_fsdp)
    assert out[0] == out[1] and out[2] == out[3], out  # the same error on each CP group's ranks
    for message in out:
        assert message.startswith("step 1: "), message
        assert "sync_grads(model, cp_mesh) was not called" in message, message


@pytest.mark.parametrize(
    ("case", "step"),
    [("forward_outside_ctx", 0), ("never_prepared", 0), ("second_step_outside_ctx", 1)],
)
@pytest.mark.parametrize("world", [2, 3])
def test_sync_grads_on_gradients_no_cp_forward_made_raises(
    ranks: Ranks, world: int, case: str, step: int
) -> None:
    out = ranks(world, no_cp_backward, case)
    assert len(set(out)) == 1, out
    assert out[0].startswith(f"step {step}: ") and "no CP forward produced" in out[0], out[0]


@pytest.mark.parametrize("case", ["ctx_without_model", "compiled_forward"])
def test_sync_grads_after_a_legal_cp_forward(ranks: Ranks, case: str) -> None:
    """make_cp_batch_and_ctx without a model, a torch.compile'd forward (whose CP calls are
    not tracked): their ctx() is what the sync reads."""
    assert ranks(2, no_cp_backward, case) == ["no error"] * 2
    assert STEPS >= 3
