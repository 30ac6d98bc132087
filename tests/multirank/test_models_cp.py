"""The shipped model-owned models train under CP exactly like one process (cp=1..4)."""

from __future__ import annotations

import pytest
from _models_fns import model_owned_parity, vlm_fsdp2_dp_cp, vlm_packed_matches_cp1

from _ranks import Ranks

pytestmark = pytest.mark.multirank


@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("which", ["vlm", "global_prefix"])
def test_model_owned_models_match_one_process(ranks: Ranks, world: int, which: str) -> None:
    ranks(world, model_owned_parity, which, "ring" if world == 3 else "all_gather")


def test_vlm_under_fsdp2_dp2_cp2_matches_one_process(ranks: Ranks) -> None:
    ranks(4, vlm_fsdp2_dp_cp)


@pytest.mark.parametrize("world", [2, 3])
def test_vlm_on_packed_rows_matches_cp1(ranks: Ranks, world: int) -> None:
    ranks(world, vlm_packed_matches_cp1)
