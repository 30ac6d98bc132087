"""Collectives asserted, not only timed: every method's per-layer collectives and bytes, the token
verbs' and the batch check's, counted through ``cpshard._comm.CommRecorder`` at cp=2..4."""

from __future__ import annotations

import pytest
import torch
from _collective_fns import (
    HEADER_BYTES,
    attention_collectives,
    gather_backward,
    gather_mismatch,
    verb_collectives,
)

from _ranks import Ranks
from cpshard.guards.step import HEADER_SIZE, PAYLOAD_SIZE
from cpshard.layouts.closed_form import RoundRobinLayout
from cpshard.sharding.consistency import FIELDS

pytestmark = pytest.mark.multirank

F32 = 4


@pytest.mark.parametrize("world", [2, 3, 4])
@pytest.mark.parametrize("method", ["all_gather", "ring", "ulysses"])
def test_attention_collectives_per_layer(ranks: Ranks, world: int, method: str) -> None:
    for r, got in enumerate(ranks(world, attention_collectives, method)):
        b, hq, hkv, n, d = got["shape"]
        kv = b * hkv * n * d * F32  # one of k or v, local
        fwd, bwd = got["fwd"], got["bwd"]
        if method == "all_gather":
            assert fwd == {"all_gather": (1, 2 * kv)}, r
            # the fp32 dK/dV of the whole stream, reduce-scattered back to their owners
            assert bwd == {"reduce_scatter": (1, world * 2 * kv)}, r
        elif method == "ring":
            hops = world - 1
            assert fwd == {"send": (2 * hops, 2 * hops * kv), "recv": (2 * hops, 0)}, r
            # K/V travel again (C-1 hops) with their fp32 gradient accumulators (C hops)
            assert bwd == {"send": (2 * hops + 2 * world, (2 * hops + 2 * world) * kv),
                           "recv": (2 * hops + 2 * world, 0)}, r  # fmt: skip
        else:
            qkv = b * (hq + 2 * hkv) * n * d * F32
            o = b * hq * n * d * F32
            assert fwd == {"all_to_all": (2, qkv + o)}, r
            assert bwd == {"all_to_all": (2, o + qkv)}, r


@pytest.mark.parametrize("world", [2, 3, 4])
def test_verbs_and_batch_check_collectives(ranks: Ranks, world: int) -> None:
    for r, got in enumerate(ranks(world, verb_collectives)):
        # one all-gather: the step header (guards/step.py: every rank starts the same phase) with
        # the batch fingerprint riding in its payload slots
        assert len(FIELDS) <= PAYLOAD_SIZE
        fingerprint = {"all_gather": (1, (HEADER_SIZE + PAYLOAD_SIZE) * 8)}
        assert got["check_on"] == fingerprint, r
        # check_consistency=False skips the hashing, not the collective (ranks that disagree on
        # the flag must not mismatch collectives)
        assert got["check_off"] == fingerprint, r
        assert got["shard"] == {}, r
        rows, local = got["local"]
        seed = rows * local * F32  # the slot seeded at shard time: one fp32 per local token
        g = got["gathers"]
        # [B, L] fp32: exactly the seeded slot, one collective of payload + header
        assert g["seeded"] == ({"all_gather": (1, HEADER_BYTES + seed)}, seed), r
        assert g["again"] == ({"all_gather": (1, HEADER_BYTES + seed)}, seed), r
        # a larger payload: the header (with the old slot), then one exact all-gather; the slot
        # grows, so the same shape again is one collective
        wide = 3 * seed
        assert g["wider"] == ({"all_gather": (2, HEADER_BYTES + seed + wide)}, wide), r
        assert g["wider again"] == ({"all_gather": (1, HEADER_BYTES + wide)}, wide), r
        # a smaller payload rides in the agreed slot: still one collective
        assert g["narrower"] == ({"all_gather": (1, HEADER_BYTES + wide)}, seed // 2), r
        assert got["unchecked"] == {"all_gather": (1, seed)}, r  # check off: the payload alone


@pytest.mark.parametrize("world", [2, 3])
def test_gather_mismatch_same_error_everywhere_one_collective(ranks: Ranks, world: int) -> None:
    res = ranks(world, gather_mismatch)
    messages = {m for m, _ in res}
    assert len(messages) == 1, messages
    (message,) = messages
    assert "different tensors or arguments" in message and "shape" in message
    for _, summary in res:
        assert summary["all_gather"][0] == 1


@pytest.mark.parametrize("grad", ["sum", "replicated"])
def test_gather_payload_backward(ranks: Ranks, grad: str) -> None:
    """The one-collective gather is differentiable like the exact all-gather it replaces."""
    world = 2
    res = ranks(world, gather_backward, grad)
    rmap = RoundRobinLayout().rank_map(world, 24)
    weights = torch.arange(4 * 24, dtype=torch.float32).view(4, 24)
    for r, g in enumerate(res):
        want = weights.index_select(1, rmap[r])
        torch.testing.assert_close(g, want * (world if grad == "sum" else 1))
