"""One rank's CP attention call differs (dtype, head count): a clear error on every rank.

Routes: ``cp_attention`` called directly (outside ``ctx()``, inside it, and inside the
``ctx()`` of a model-owned shard, which brings its own context), the SDPA interception of a plain
PyTorch model in ``ctx()``, and the HF ``"cpshard"`` attention of a prepared transformers model.
Rank 1 alone runs in bf16 (its tensors, or an autocast region) or splits the same weights into
another number of heads. Before the fix a direct call aborted rank 1 in gloo (SIGABRT: a K/V
all-gather of another size) and its peers failed with it; now every rank raises the same
``ValueError`` naming each rank's call, and the same ranks then run the call
correctly (exact against one process).
"""

from __future__ import annotations

import pytest
from _agree_fns import DIFFS, ROUTES, TRACKED, UNTRACKED, one_rank_differs

from _ranks import Ranks
from cpshard.attention.agree import AGREE_SIZE
from cpshard.guards.step import HEADER_SIZE, PAYLOAD_SIZE

pytestmark = pytest.mark.multirank


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("diff", DIFFS)
@pytest.mark.parametrize("route", ROUTES)
def test_one_rank_differs_raises_on_every_rank(
    ranks: Ranks, world: int, route: str, diff: str
) -> None:
    if route == "hf":
        pytest.importorskip("transformers")
    msgs = ranks(world, one_rank_differs, route, diff)
    assert len(set(msgs)) == 1, msgs  # every rank raised the same error
    msg = msgs[0]
    if route in ("direct", "model_owned"):  # untracked: cpshard.attention.agree names each call
        assert UNTRACKED in msg, msg
        odd = "bfloat16 [2, 2, " if diff == "dtype" else "float32 [2, 4, "
        assert f"rank 1: q {odd}" in msg and "rank 0: q float32 [2, 2, " in msg, msg
        if world == 3:
            assert "rank 2: q float32 [2, 2, " in msg, msg
    else:  # inside a tracked ctx(): the forward's step header
        assert TRACKED in msg and "ranks [1]" in msg, msg


def test_agree_exchange_has_the_size_of_a_step_header() -> None:
    # a rank meeting a step header there (or the reverse) sees a wrong magic, not a size mismatch
    assert AGREE_SIZE == HEADER_SIZE + PAYLOAD_SIZE
