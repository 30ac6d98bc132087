"""A 4-D attention mask with documents is refused (never reduced to padding), at every CP size."""

from __future__ import annotations

import pytest
from _mask4d_fns import four_d_documents_refused

from _ranks import Ranks

pytestmark = pytest.mark.multirank


@pytest.mark.parametrize(("world", "kind"), [(1, "bool"), (2, "additive"), (3, "bool")])
def test_four_d_document_mask_refused_on_every_rank(ranks: Ranks, world: int, kind: str) -> None:
    msgs = ranks(world, four_d_documents_refused, kind)
    assert len(set(msgs)) == 1
