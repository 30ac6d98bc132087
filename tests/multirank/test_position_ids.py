"""Dense rows with any position_ids run under CP exactly as the HF model in one process.

Issue 24 part 6: rows whose position_ids have gaps or repeats, or a 0 mid-row, without an
attention_mask were refused (transformers reads them as packed sequences, and so does cpshard
now); with a mask they are RoPE positions of one causal row.
"""

from __future__ import annotations

import pytest
from _position_ids_fns import FAMILIES, MASKS, positions_match_one_process

from _ranks import Ranks

pytestmark = pytest.mark.multirank

EXAMPLES = 2 * len(FAMILIES) * len(MASKS)  # every family with every mask kind, twice


@pytest.mark.parametrize("world", [2, 3])
def test_random_position_ids_match_one_process(ranks: Ranks, world: int) -> None:
    ran = ranks(world, positions_match_one_process, list(range(EXAMPLES)))[0]
    assert sum(ran.values()) == EXAMPLES
    assert set(ran) == {f"{f}/{m}" for f in FAMILIES for m in MASKS}
