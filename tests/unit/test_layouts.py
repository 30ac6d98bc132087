"""Closed-form layout index math: worked examples, bijections, torch's head-tail balancer."""

from __future__ import annotations

import pytest
import torch

from cpshard.layouts.closed_form import (
    ContiguousLayout,
    NoneLayout,
    RoundRobinLayout,
    contiguous_local_indices,
    round_robin_local_indices,
)
from cpshard.layouts.index import check_rank_map, inverse_permutation, padded_length


def test_round_robin_worked_examples() -> None:
    assert round_robin_local_indices(0, 2, 8).tolist() == [0, 1, 6, 7]
    assert round_robin_local_indices(1, 2, 8).tolist() == [2, 3, 4, 5]
    assert round_robin_local_indices(0, 4, 24).tolist() == [0, 1, 2, 21, 22, 23]
    assert round_robin_local_indices(1, 4, 24).tolist() == [3, 4, 5, 18, 19, 20]
    assert round_robin_local_indices(3, 4, 24).tolist() == list(range(9, 15))
    assert round_robin_local_indices(0, 2, 4).tolist() == [0, 3]
    assert round_robin_local_indices(5, 128, 256).tolist() == [5, 250]


def test_contiguous_worked_examples() -> None:
    assert contiguous_local_indices(1, 2, 8).tolist() == [4, 5, 6, 7]
    lay = ContiguousLayout(pad_multiple=4)
    assert lay.padded_length(6, 2) == 8
    assert ContiguousLayout().padded_length(5, 3) == 6  # C * max(1, 2)


@pytest.mark.parametrize("world", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("seq_len", [1, 7, 24, 33])
@pytest.mark.parametrize(
    "layout", [RoundRobinLayout(), ContiguousLayout(), ContiguousLayout(3)], ids=repr
)
def test_layouts_are_bijections(world: int, seq_len: int, layout: object) -> None:
    assert isinstance(layout, (RoundRobinLayout, ContiguousLayout))
    padded = layout.padded_length(seq_len, world)
    assert padded % layout.divisor(world) == 0 and padded - seq_len < layout.divisor(world)
    rank_map = layout.rank_map(world, padded)
    assert rank_map.shape == (world, padded // world)
    check_rank_map(rank_map, padded)
    order = rank_map.reshape(-1)
    inv = inverse_permutation(order)
    assert torch.equal(order[inv], torch.arange(padded))


def test_none_layout_is_identity_and_only_for_one_rank() -> None:
    assert NoneLayout().rank_map(1, 5).tolist() == [[0, 1, 2, 3, 4]]
    with pytest.raises(ValueError, match="cp_size == 1"):
        NoneLayout().local_indices(0, 2, 4)


@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("seq_len", [8, 24, 48])
def test_round_robin_equals_torch_head_tail_balancer(world: int, seq_len: int) -> None:
    lb_mod = pytest.importorskip(
        "torch.distributed.tensor.experimental._context_parallel._load_balancer"
    )
    if seq_len % (2 * world):
        pytest.skip("torch needs 2*C | S")
    balancer = lb_mod._HeadTailLoadBalancer(seq_len, world, torch.device("cpu"))
    theirs = balancer._generate_indices().reshape(-1)
    ours = RoundRobinLayout().rank_map(world, seq_len).reshape(-1)
    assert torch.equal(ours, theirs)


def test_layout_errors_name_rule_value_and_fix() -> None:
    with pytest.raises(ValueError, match=r"divisible by 4, got padded_seq_len=6; pad .* to 8"):
        round_robin_local_indices(0, 2, 6)
    with pytest.raises(ValueError, match=r"divisible by 3, got padded_seq_len=7"):
        contiguous_local_indices(0, 3, 7)
    with pytest.raises(ValueError, match=r"rank must be in \[0, world_size=2\), got rank=2"):
        round_robin_local_indices(2, 2, 8)
    with pytest.raises(ValueError, match="world_size must be >= 1"):
        round_robin_local_indices(0, 0, 8)
    with pytest.raises(ValueError, match="pad_multiple must be >= 1"):
        ContiguousLayout(0)
    with pytest.raises(ValueError, match="seq_len must be >= 0"):
        padded_length(-1, 2)
    with pytest.raises(ValueError, match="divisor must be >= 1"):
        padded_length(3, 0)


def test_check_rank_map_rejects_non_bijections() -> None:
    with pytest.raises(ValueError, match="exactly once; position 2 appears 2 times"):
        check_rank_map(torch.tensor([[0, 1], [2, 2]]), 4)
    with pytest.raises(ValueError, match="outside"):
        check_rank_map(torch.tensor([[0, 1], [2, 9]]), 4)
    with pytest.raises(ValueError, match=r"\[C, L\]"):
        check_rank_map(torch.tensor([0, 1, 2, 3]), 4)
    with pytest.raises(ValueError, match="exactly once; position 1 appears 0 times"):
        check_rank_map(torch.tensor([[0, 2], [2, 3]]), 4)
    with pytest.raises(ValueError, match=r"outside \[0, 4\): min=-1, max=3"):
        check_rank_map(torch.tensor([[0, -1], [2, 3]]), 4)
    check_rank_map(torch.empty(2, 0, dtype=torch.long), 0)


@pytest.mark.parametrize("seed", range(4))
def test_check_rank_map_catches_any_non_bijection(seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    for _ in range(50):
        c = int(torch.randint(1, 6, (1,), generator=gen))
        p = c * int(torch.randint(1, 9, (1,), generator=gen))
        perm = torch.randperm(p, generator=gen)
        check_rank_map(perm.view(c, -1), p)
        broken = perm.clone()
        i, j = (int(v) for v in torch.randint(0, p, (2,), generator=gen))
        broken[i] = perm[j]
        if i == j:
            continue
        counts = torch.bincount(broken, minlength=p)
        bad = int((counts != 1).nonzero()[0])
        with pytest.raises(ValueError, match=f"position {bad} appears {int(counts[bad])} times"):
            check_rank_map(broken.view(c, -1), p)
