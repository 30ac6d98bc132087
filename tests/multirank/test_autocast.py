"""A plain training loop under ``torch.autocast(bf16)`` with CP == one process under autocast.

3 SGD steps of a tiny HF Llama, forward and backward inside CPU autocast (its SDPA calls get
mixed fp32/bf16 q, k, v), every attention method, cp=2 and cp=3; tolerances and why in
``_autocast_fns.py``. Before the fix every rank raised "q, k, v must share a dtype".
"""

from __future__ import annotations

import pytest
from _autocast_fns import autocast_loop

from _ranks import Ranks
from cpshard.names import METHOD_NAMES

pytestmark = pytest.mark.multirank


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("attention", METHOD_NAMES)
def test_autocast_bf16_loop_matches_one_process(ranks: Ranks, world: int, attention: str) -> None:
    pytest.importorskip("transformers")
    ranks(world, autocast_loop, attention)
