"""The batch fingerprint covers every value of the batch, and its opt-out keeps the collective."""

from __future__ import annotations

import pytest
from _fingerprint_fns import (
    cost_models_differ,
    divergent_content,
    opt_out_everywhere_reads_no_values,
    opt_out_on_some_ranks,
    sharders_differ,
)

from _ranks import Ranks

pytestmark = pytest.mark.multirank


@pytest.mark.parametrize("variant", ["embeds_late_row", "crafted", "numpy", "list", "sparse"])
def test_divergence_the_old_fingerprint_missed_raises_everywhere(
    ranks: Ranks, variant: str
) -> None:
    msgs = ranks(2, divergent_content, variant, False)
    assert len(set(msgs)) == 1


@pytest.mark.parametrize("variant", ["embeds_late_row", "numpy"])
def test_divergence_through_prepare_cp_forward_on_three_ranks(ranks: Ranks, variant: str) -> None:
    msgs = ranks(3, divergent_content, variant, True)
    assert len(set(msgs)) == 1


@pytest.mark.parametrize(("world", "with_model"), [(2, False), (3, True)])
def test_opt_out_on_some_ranks_is_a_clear_error_everywhere(
    ranks: Ranks, world: int, with_model: bool
) -> None:
    msgs = ranks(world, opt_out_on_some_ranks, with_model)
    assert len(set(msgs)) == 1 and "ranks [0] pass False" in msgs[0]


def test_opt_out_everywhere_still_shards(ranks: Ranks) -> None:
    assert len(set(ranks(2, opt_out_everywhere_reads_no_values))) == 1


@pytest.mark.parametrize("world", [2, 3])
def test_ranks_with_other_cost_models_raise_everywhere(ranks: Ranks, world: int) -> None:
    assert len(set(ranks(world, cost_models_differ))) == 1


def test_ranks_given_different_sharders_raise_everywhere(ranks: Ranks) -> None:
    assert len(set(ranks(3, sharders_differ))) == 1
