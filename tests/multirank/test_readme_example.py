"""The README's main example, executed as written on gloo ranks, equals one process."""

from __future__ import annotations

import pytest
from _readme_example_fns import readme_example_matches_one_process

from _ranks import Ranks

pytestmark = pytest.mark.multirank


@pytest.mark.parametrize("world", [1, 2, 3])
def test_readme_example_matches_one_process(ranks: Ranks, world: int) -> None:
    ranks(world, readme_example_matches_one_process)
