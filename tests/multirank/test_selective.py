"""The selective exchange on real ranks: bytes moved = bytes needed; ``auto`` agrees on every rank.

Exactness of selective (forward and backward, every layout, windows, GQA, bidirectional, cp=1..4)
runs in ``test_attention_cp.py`` and ``test_packed_sharder.py``, which take every method of
``cpshard.names``.
"""

from __future__ import annotations

import numpy as np
import pytest
from _selective_fns import auto_choice, exchanged_bytes

from _ranks import Ranks
from cpshard.names import METHOD_NAMES

pytestmark = pytest.mark.multirank


def _seq_lens(seed: int, rows: int, row_len: int) -> list[list[int]]:
    """Documents of 1..70 tokens (many cut by the layouts), the last row ending in padding."""
    rng = np.random.default_rng(seed)
    out = []
    for b in range(rows):
        budget = row_len - (5 if b == rows - 1 else 0)
        lens: list[int] = []
        while sum(lens) < budget:
            lens.append(min(int(rng.integers(1, 71)), budget - sum(lens)))
        out.append(lens)
    return out


def _needed_slots(pos: np.ndarray, doc: np.ndarray, rank: int, n: int, window: int | None) -> int:
    """Remote key slots some query of ``rank`` sees, from the mask rule on the dense stream."""
    vis = (doc[:, None] == doc[None, :]) & (pos[:, None] >= pos[None, :])
    if window is not None:
        vis &= pos[:, None] - pos[None, :] < window
    need = vis[rank * n : (rank + 1) * n].any(axis=0)
    need[rank * n : (rank + 1) * n] = False
    return int(need.sum())


@pytest.mark.parametrize("world", [2, 3, 4])
@pytest.mark.parametrize(
    ("layout", "window"), [("balanced", None), ("packed", None), ("balanced", 9)]
)
def test_bytes_moved_equal_bytes_needed(
    ranks: Ranks, world: int, layout: str, window: int | None
) -> None:
    """Forward K/V and backward dK/dV: one all-to-all each, payload = what the queries see (no
    header: the split sizes come from the plan every rank derives)."""
    seq_lens = _seq_lens(world, 1, 96 * world)
    res = ranks(world, exchanged_bytes, seq_lens, 96 * world, layout, window)
    pos = res[0]["positions"][0].numpy()
    doc = res[0]["document_ids"][0].numpy()
    n = pos.size // world
    # each rank's exchange sends what the others need of it: over the group, moved vs needed
    needed = sum(_needed_slots(pos, doc, r, n, window) for r in range(world)) * res[0]["slot_bytes"]
    assert all(len(got["calls"]) == 2 for got in res)  # one all-to-all forward, one backward
    moved_fwd = sum(got["calls"][0] for got in res)
    moved_bwd = sum(got["calls"][1] for got in res)  # dK/dV in fp64 here: as many bytes as K/V
    assert needed > 0
    assert moved_fwd == needed and moved_bwd == needed, (moved_fwd, moved_bwd, needed)


@pytest.mark.parametrize("world", [2, 3])
def test_auto_is_the_same_on_every_rank(ranks: Ranks, world: int) -> None:
    seq_lens = _seq_lens(5 + world, 2, 64 * world)
    res = ranks(world, auto_choice, seq_lens, 64 * world)
    choices = {c for c, _ in res}
    assert len(choices) == 1 and choices <= set(METHOD_NAMES), res
    assert all(costs == res[0][1] for _, costs in res)
    (best,) = choices
    assert res[0][1][best] == min(v for k, v in res[0][1].items() if k != "ulysses")
