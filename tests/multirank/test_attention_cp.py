"""CP attention (all_gather / ring / ulysses) against one process on the full sequence."""

from __future__ import annotations

import pytest
import torch
from _attention_fns import cp_attention_case, cp_attention_error, cp_attention_given

from _attention_common import (
    LAYOUTS,
    WINDOW_LAYOUTS,
    inputs,
    make_case,
    reference_with_grads,
    te_packed_case,
)
from _ranks import Ranks
from cpshard.names import METHOD_NAMES as METHODS

pytestmark = pytest.mark.multirank

TOL = {"fp64": {}, "fp32": {"atol": 2e-5, "rtol": 2e-5}, "bf16": {"atol": 3e-2, "rtol": 3e-2}}


def _heads(world: int) -> tuple[int, int]:
    """GQA heads that ulysses can split at this world size: Hq = 2 * Hkv."""
    hkv = max(world, 2)
    return 2 * hkv, hkv


def _check(
    ranks: Ranks,
    world: int,
    method: str,
    layout: str,
    causal: bool = True,
    dtype: str = "fp64",
    meta_batch: int = 1,
    grads: bool = True,
    backend: str = "auto",
    window: int | None = None,
    seq_len: int | None = None,
    n_docs: int = 3,
    softcap: float | None = None,
    value_dim: int | None = None,
) -> None:
    seq_len = 8 * world - 3 if seq_len is None else seq_len  # odd: the layout pads it
    heads = _heads(world)
    res = ranks(
        world, cp_attention_case, method, layout, seq_len, heads, causal, dtype, meta_batch,
        n_docs, 0, backend, window, softcap, value_dim,
    )  # fmt: skip
    rmap, docs = make_case(layout, world, seq_len, 2, n_docs, 0, meta_batch)
    q, k, v, go = inputs(2, heads[0], heads[1], rmap.numel(), 8, 0)
    if value_dim is not None:
        _, _, v, go = inputs(2, heads[0], heads[1], rmap.numel(), value_dim, 7)
    ref = reference_with_grads(q, k, v, go, docs, causal, window=window, softcap=softcap)
    names = ("out", "dq", "dk", "dv") if grads else ("out",)
    for r, got in enumerate(res):
        assert torch.equal(got["idx"], rmap[r])
        for name, want in zip(names, ref, strict=False):
            torch.testing.assert_close(
                got[name].double(), want.index_select(2, rmap[r]), **TOL[dtype],
                msg=lambda m, r=r, name=name: f"rank {r} {name}: {m}",
            )  # fmt: skip


def _compare(
    res: list[dict[str, torch.Tensor]], rmap: torch.Tensor, ref: tuple[torch.Tensor, ...]
) -> None:
    for r, got in enumerate(res):
        assert torch.equal(got["idx"], rmap[r])
        for name, want in zip(("out", "dq", "dk", "dv"), ref, strict=True):
            torch.testing.assert_close(
                got[name].double(), want.index_select(2, rmap[r]),
                msg=lambda m, r=r, name=name: f"rank {r} {name}: {m}",
            )  # fmt: skip


def _te_packed(world: int) -> tuple[torch.Tensor, torch.Tensor]:
    """TE's ``packed`` layout of short documents: each cut into ``2C`` chunks of a few tokens."""
    return te_packed_case([13, 30, 7, 22, 40, 9, 17, 25, 31, 11], world)


def test_selective_reads_chunked_documents_in_stream_order_by_its_rule(ranks: Ranks) -> None:
    """TE's ``packed`` layout at C=4 on short documents: rank 0 receives 6 chunks of every
    document as 6 runs, which stream order joins into one; the others' runs join less than 4x.
    Ranks with and without the order exchange with each other; output and gradients equal one
    process's."""
    from _attention_common import make_meta
    from cpshard.attention.selective_plan import selective_plan

    rmap, docs = _te_packed(4)
    cpu = torch.device("cpu")
    plans = [selective_plan(make_meta(rmap, docs, r), True, None, cpu) for r in range(4)]
    assert [p.recv_order is not None for p in plans] == [True, False, False, False]
    heads = _heads(4)
    res = ranks(4, cp_attention_given, "selective", rmap, docs, heads, True, "fp64")
    q, k, v, go = inputs(2, heads[0], heads[1], rmap.numel(), 8, 0)
    _compare(res, rmap, reference_with_grads(q, k, v, go, docs, True))


@pytest.mark.parametrize("case", ["te_packed", *LAYOUTS])
@pytest.mark.parametrize("world", [2, 3, 4])
def test_selective_with_every_received_key_in_stream_order_fp64(
    ranks: Ranks, world: int, case: str
) -> None:
    """The received keys put in stream order wherever they have two runs or more (the rule
    forced in the ranks): the same output and gradients as one process, causal and with a
    window."""
    if case == "te_packed":
        rmap, docs = _te_packed(world)
    else:
        rmap, docs = make_case(case, world, 8 * world - 3, 2, 3, 0, 1)
    heads = _heads(world)
    q, k, v, go = inputs(2, heads[0], heads[1], rmap.numel(), 8, 0)
    for window in (None, 5):
        res = ranks(
            world, cp_attention_given, "selective", rmap, docs, heads, True, "fp64", 0, "auto",
            window, None, None, True,
        )  # fmt: skip
        _compare(res, rmap, reference_with_grads(q, k, v, go, docs, True, window=window))


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_causal_documents_fp64(ranks: Ranks, world: int, method: str, layout: str) -> None:
    _check(ranks, world, method, layout)


# MLA (DeepSeek-V2/V3, Kimi-K2, MiniCPM3): a value head dim narrower or wider than q/k's
@pytest.mark.parametrize("value_dim", [5, 12])
@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("world", [2, 3])
def test_value_head_dim_other_than_qk_fp64(
    ranks: Ranks, world: int, method: str, value_dim: int
) -> None:
    _check(ranks, world, method, "round_robin", value_dim=value_dim)
    _check(ranks, world, method, "round_robin", value_dim=value_dim, window=5, seq_len=40)


# windows across rank boundaries (WINDOW_LAYOUTS says why contiguous is left out)
@pytest.mark.parametrize("layout", WINDOW_LAYOUTS)
@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("world", [2, 3, 4])
def test_sliding_window_fp64(ranks: Ranks, world: int, method: str, layout: str) -> None:
    """Windows of 1 (a token sees itself), 5 and 70 over documents of ~40 tokens."""
    for window in (1, 5, 70):
        _check(ranks, world, method, layout, window=window, seq_len=120 - world, n_docs=3)


@pytest.mark.parametrize("method", METHODS)
def test_softcap_with_window_fp64(ranks: Ranks, method: str) -> None:
    _check(ranks, 2, method, "random", window=6, softcap=0.8, seq_len=45)


def test_sliding_window_per_row_meta_fp64(ranks: Ranks) -> None:
    _check(ranks, 2, "ring", "round_robin", meta_batch=2, window=4, seq_len=61)


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("world", [2, 3])
def test_bidirectional_fp64(ranks: Ranks, world: int, method: str) -> None:
    _check(ranks, world, method, "random", causal=False)


@pytest.mark.parametrize("method", METHODS)
def test_per_row_meta_fp64(ranks: Ranks, method: str) -> None:
    _check(ranks, 2, method, "round_robin", meta_batch=2)


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("world", [2, 4])
def test_fp32(ranks: Ranks, world: int, method: str) -> None:
    _check(ranks, world, method, "round_robin", dtype="fp32")


@pytest.mark.parametrize("method", METHODS)
def test_math_backend_fp64(ranks: Ranks, method: str) -> None:
    """The device-agnostic fp32/fp64 math kernel (used off CPU) under real CP."""
    _check(ranks, 3, method, "round_robin", backend="math")


@pytest.mark.parametrize("method", METHODS)
def test_bf16_forward_smoke(ranks: Ranks, method: str) -> None:
    _check(ranks, 2, method, "round_robin", dtype="bf16", grads=False)


@pytest.mark.parametrize(("heads", "which"), [((3, 1), "query heads"), ((4, 1), "key/value heads")])
def test_ulysses_heads_not_divisible_raises_on_every_rank(
    ranks: Ranks, heads: tuple[int, int], which: str
) -> None:
    msgs = ranks(2, cp_attention_error, "ulysses", heads, 12)
    assert all(f"number of {which} divisible by the CP size" in m for m in msgs), msgs


@pytest.mark.parametrize(
    ("window", "softcap", "match"),
    [(0, None, "sliding_window must be a positive int"),
     (None, -2.0, "softcap must be a positive finite number")],
)  # fmt: skip
def test_bad_window_or_softcap_raises_on_every_rank(
    ranks: Ranks, window: int | None, softcap: float | None, match: str
) -> None:
    msgs = ranks(3, cp_attention_error, "ring", (2, 2), 12, window, softcap)
    assert all(match in m for m in msgs), msgs


def test_unknown_method_raises_on_every_rank(ranks: Ranks) -> None:
    msgs = ranks(2, cp_attention_error, "zigzag", (2, 2), 12)
    assert all("valid methods are all_gather, ring, ulysses" in m for m in msgs), msgs
