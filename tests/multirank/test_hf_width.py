"""Attention sinks and Llama 4 chunked attention under CP: exact forward and backward (fp64)."""

from __future__ import annotations

import pytest
from _hf_width_fns import chunk_without_rule_differs, sinks_case

from _ranks import Ranks
from cpshard.names import METHOD_NAMES

pytestmark = pytest.mark.multirank


@pytest.mark.parametrize("method", METHOD_NAMES)
@pytest.mark.parametrize(
    ("world", "layout"), [(2, "round_robin"), (3, "random"), (1, "contiguous")]
)
def test_sinks_exact_every_method(ranks: Ranks, world: int, layout: str, method: str) -> None:
    if method == "ulysses" and world == 3:
        pytest.skip("ulysses needs heads divisible by the CP size (4 heads, 2 kv heads)")
    ranks(world, sinks_case, method, layout, None)


@pytest.mark.parametrize("method", METHOD_NAMES)
@pytest.mark.parametrize(
    ("world", "layout"), [(2, "round_robin"), (2, "random"), (3, "contiguous")]
)
def test_chunks_with_sinks_exact_every_method(
    ranks: Ranks, world: int, layout: str, method: str
) -> None:
    if method == "ulysses" and world == 3:
        pytest.skip("ulysses needs heads divisible by the CP size (4 heads, 2 kv heads)")
    ranks(world, sinks_case, method, layout, 4)


def test_chunk_rule_changes_the_result(ranks: Ranks) -> None:
    assert min(ranks(2, chunk_without_rule_differs)) > 1e-2
