"""Every collective cpshard issues works on an NCCL-only group (tensors on the group's device).

A group made with the plain ``"nccl"`` backend takes no CPU tensor; gloo takes them, so these tests
run cpshard's public surface over gloo groups that refuse CPU tensors as NCCL does
(``tests/_nccl_like.py``): prepare_cp_forward with its batch fingerprint, the three attention
methods forward and backward, the token verbs with their checks, the rank-map gather of a sharder
without captured maps, sync_grads, the loss counts and logging, the parity tool's CP side and the
torchrun runner's gathers, all through the local-rank launcher. Results must equal plain gloo's.
"""

from __future__ import annotations

import pytest
from _nccl_like_fns import (
    existing,
    losses_and_counts,
    parity_rows,
    refuses_cpu_tensor,
    verbs_and_prepare,
)

from _ranks import Ranks

pytestmark = pytest.mark.multirank


def test_the_view_refuses_a_cpu_tensor(ranks: Ranks) -> None:
    for msg in ranks(2, refuses_cpu_tensor):
        assert "No backend type associated with device type cpu" in msg


@pytest.mark.parametrize("world", [2, 3])
def test_losses_counts_and_sync_grads(ranks: Ranks, world: int) -> None:
    for seen in ranks(world, losses_and_counts):
        assert seen.get("all_reduce", 0) >= 4, seen


def test_prepare_attention_and_verbs(ranks: Ranks) -> None:
    for seen in ranks(2, verbs_and_prepare):
        gathers = {"all_gather_single", "all_gather_into_tensor"}  # torch >= 2.13 / older
        assert gathers & set(seen) and {"P2POp", "all_to_all_single"} <= set(seen), seen


def test_parity_rows_and_launcher_gathers(ranks: Ranks) -> None:
    for seen in ranks(2, parity_rows):
        assert seen.get("all_reduce", 0) > 0, seen


@pytest.mark.parametrize(
    ("module", "name", "args"),
    [
        ("_sharder_fns", "third_party_sharders", ()),  # the rank-map gather
        ("_sharder_fns", "grads", ("replicated", True)),
        ("_guard_fns", "same_batch_passes", (True,)),  # the packed fingerprint
        ("_guard_fns", "divergent_batch", ("content", False, True)),  # prepare_cp_forward's
        ("_guard_fns", "divergent_gather", ("dtype",)),  # the verb check
        ("_packed_fns", "packed_keys_verbs_grads", ("balanced",)),
        ("_readme_fns", "readme_grpo_step", ()),
    ],
)
def test_existing_rank_functions(
    ranks: Ranks, module: str, name: str, args: tuple[object, ...]
) -> None:
    for seen in ranks(2, existing, module, name, *args):
        assert sum(seen.values()) > 0, seen
