"""HF models keep their own attn_implementation outside ctx(); cpshard's inside it."""

from __future__ import annotations

import pytest
from _hf_scope_fns import configured_implementation_is_kept, generation_between_cp_forwards

from _ranks import Ranks

pytestmark = pytest.mark.multirank
pytest.importorskip("transformers")


@pytest.mark.parametrize("impl", ["sdpa", "eager"])
@pytest.mark.parametrize("world", [1, 2])
def test_generate_outside_ctx_keeps_own_attention(ranks: Ranks, world: int, impl: str) -> None:
    ranks(world, generation_between_cp_forwards, impl)


def test_flex_attention_stays_configured(ranks: Ranks) -> None:
    ranks(2, configured_implementation_is_kept)
