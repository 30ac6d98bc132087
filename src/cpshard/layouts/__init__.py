"""Layouts: which tokens of the padded global stream each CP rank owns, as exact index maps.

Owns the closed-form layouts (``none``, ``contiguous``, ``round_robin``; :mod:`.closed_form`),
the document structure of packed batches (:class:`~cpshard.layouts.documents.PackSpec`), the
layouts of packed streams (``packed``; :mod:`.packed`) and our ``balanced`` solver
(:mod:`.balanced`), plus the index helpers they share (:mod:`.index`: padded lengths, rank-map
checks, inverse permutations, runs), the one map between the caller's coordinates and the
padded stream (:mod:`.coordinates`) and the :class:`~cpshard.layouts.placement.Placement` every
layout ends in (:mod:`.placement`).

Import rules: the rows of ``RULES`` in tests/unit/test_architecture.py that cover this module.
"""

from cpshard.layouts.closed_form import (
    ClosedFormLayout,
    ContiguousLayout,
    NoneLayout,
    RoundRobinLayout,
    contiguous_local_indices,
    round_robin_local_indices,
)
from cpshard.layouts.documents import PackSpec
from cpshard.layouts.index import (
    check_rank_map,
    consecutive_runs,
    inverse_permutation,
    padded_length,
)
from cpshard.layouts.placement import Placement

__all__ = [
    "ClosedFormLayout",
    "ContiguousLayout",
    "NoneLayout",
    "PackSpec",
    "Placement",
    "RoundRobinLayout",
    "check_rank_map",
    "consecutive_runs",
    "contiguous_local_indices",
    "inverse_permutation",
    "padded_length",
    "round_robin_local_indices",
]
