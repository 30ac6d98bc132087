"""Hybrid HF models (token mixers outside attention) under CP: exact, or refused before any
collective.

By default a representative subset runs (every installed hybrid family once at cp=2, packed
and cp=3 on a few); ``pytest -m mixers_matrix`` runs every family x layout x CP size.
"""

from __future__ import annotations

import pytest
from _mixer_fns import (
    gdn_module_alone,
    hybrid_checkpointed,
    hybrid_dense,
    hybrid_packed,
    hybrid_refusals,
    mamba2_module_alone,
    mamba_without_prepare,
    native_saved_bytes,
)

from _mixer_models import HYBRIDS, native_served
from _ranks import Ranks

pytestmark = pytest.mark.multirank
pytest.importorskip("transformers")

_DEFAULT = [
    ("mamba", 2, "round_robin", "ring"),
    ("mamba2", 3, "contiguous", "all_gather"),
    ("qwen3_next", 2, "round_robin", "all_gather"),
    ("jamba", 2, "contiguous", "ring"),
    ("falcon_h1", 2, "round_robin", "all_gather"),
    ("lfm2", 3, "round_robin", "all_gather"),
    ("granitemoehybrid", 2, "contiguous", "all_gather"),
    ("mamba2", 2, "contiguous", "ring"),
    ("nemotron_h", 3, "contiguous", "all_gather"),
    ("nemotron_h", 2, "round_robin", "ulysses"),
    # the generic path hands per-token arguments over in its gathered layout: position_ids
    # (RecurrentGemma's RG-LRU resets at position 0), Zamba's transformer_hidden_states
    ("recurrent_gemma", 2, "round_robin", "ring"),
    ("zamba", 3, "round_robin", "all_gather"),
]


@pytest.mark.parametrize(("arch", "world", "layout", "method"), _DEFAULT)
def test_hybrid_dense_exact(ranks: Ranks, arch: str, world: int, layout: str, method: str) -> None:
    ranks(world, hybrid_dense, arch, layout, method)


@pytest.mark.parametrize(
    ("arch", "world", "seq"),
    [("qwen3_next", 1, 13), ("qwen3_next", 2, 13), ("qwen3_next", 3, 200), ("qwen3_next", 4, 13),
     ("qwen3_5", 3, 13), ("qwen3_5", 4, 150)],
)  # fmt: skip
def test_gdn_module_native_exact(ranks: Ranks, arch: str, world: int, seq: int) -> None:
    """One Gated DeltaNet alone, native on contiguous shards (seq 150 / 200: several chunks of
    64 per rank and a partial one)."""
    ranks(world, gdn_module_alone, arch, seq)


@pytest.mark.parametrize(("world", "seq"), [(2, 512), (3, 480)])
def test_mamba2_native_matches_the_generic_paths_rounding(
    ranks: Ranks, world: int, seq: int
) -> None:
    """One fp32 Mamba2 module, a rank's decays summing to ~1e3 before a long-memory tail:
    native CP's relative error (output, input gradient, each parameter gradient) against one
    process is at the generic path's level (the generic path runs the very same scan; both
    differ from one process only by fp32 rounding). A state summary taking differences of
    cumulative decay sums over a whole rank was 8e-6 (input gradient) here, 70x the generic
    path's 1.1e-7; chunk-wise as transformers' scan sums: 7e-8."""
    if not native_served("mamba2"):
        pytest.skip("this transformers' Mamba2 is not served natively")
    errors = ranks(world, mamba2_module_alone, seq, 16)[0]
    for what in [k.removeprefix("native ") for k in errors if k.startswith("native ")]:
        native, generic = errors[f"native {what}"], errors[f"generic {what}"]
        assert native <= max(3.0 * generic, 3e-7), (what, native, generic, errors)


@pytest.mark.parametrize(
    ("arch", "world", "seq"),
    [("mamba2", 2, 1024), ("mamba2", 3, 960), ("qwen3_next", 2, 1024), ("qwen3_next", 3, 960),
     ("qwen3_5", 2, 1024)],
)  # fmt: skip
def test_native_rank_keeps_its_share_of_the_activations(
    ranks: Ranks, arch: str, world: int, seq: int
) -> None:
    """What autograd keeps for the backward of one natively served mixer (deterministic, not a
    measured peak): each rank <= 1/C of one process + 4% (the module's own activations for its
    tokens; the state summary keeps only its inputs). Kept with its graph, the summary made it
    0.59x (Mamba2) and 0.92x (Gated DeltaNet) at cp=2. The peak itself: bench_mixers.py
    --measure memory."""
    if not native_served(arch):
        pytest.skip(f"this transformers' {arch} mixer is not served natively")
    for one, mine in ranks(world, native_saved_bytes, arch, seq):
        assert mine <= (1 / world + 0.04) * one, (arch, world, mine / one)


@pytest.mark.parametrize(
    ("arch", "world", "layout", "method"),
    [("qwen3_next", 3, "contiguous", "all_gather"), ("qwen3_next", 4, "auto", "ring"),
     ("qwen3_5", 2, "auto", "all_gather"), ("qwen3_5", 3, "contiguous", "ring"),
     ("qwen3_5", 4, "contiguous", "all_gather")],
)  # fmt: skip
def test_gdn_model_native_exact(
    ranks: Ranks, arch: str, world: int, layout: str, method: str
) -> None:
    """A tiny hybrid Qwen3-Next / Qwen3.5 LM through prepare_cp_forward: GDN layers native."""
    ranks(world, hybrid_dense, arch, layout, method)


@pytest.mark.parametrize(
    ("arch", "world", "layout"),
    [
        ("qwen3_next", 2, "balanced"),
        ("qwen3_5", 3, "packed"),
        ("mamba2", 3, "packed"),
        ("lfm2", 1, "packed"),
        ("recurrent_gemma", 3, "packed"),
        ("zamba", 2, "balanced"),
    ],
)
def test_hybrid_packed_exact(ranks: Ranks, arch: str, world: int, layout: str) -> None:
    ranks(world, hybrid_packed, arch, layout)


@pytest.mark.parametrize("layout", ["round_robin", "contiguous"])
def test_gradient_checkpointing_recomputes_mixers_exactly(ranks: Ranks, layout: str) -> None:
    ranks(2, hybrid_checkpointed, "qwen3_next", layout)


def test_make_cp_batch_and_ctx_with_a_model(ranks: Ranks) -> None:
    ranks(3, mamba_without_prepare)


@pytest.mark.parametrize("world", [1, 2])
def test_strict_refuses_on_every_rank(ranks: Ranks, world: int) -> None:
    messages = ranks(world, hybrid_refusals, "qwen3_next")
    # the hint to use contiguous shards only where the product serves this transformers' GDN
    hint = world > 1 and native_served("qwen3_next")
    for per_rank in messages:
        assert per_rank == messages[0]  # the same error on every rank
        (text,) = per_rank
        assert "Qwen3NextGatedDeltaNet" in text and "strict=False" in text
        assert ("packed" in text) == (world == 1)
        assert ("Gated DeltaNet mixers natively" in text) == hint


@pytest.fixture
def matrix_only(request: pytest.FixtureRequest) -> None:
    """The matrix runs only when selected: ``pytest -m mixers_matrix``."""
    if "mixers_matrix" not in (request.config.getoption("markexpr") or ""):
        pytest.skip("the full hybrid matrix runs with -m mixers_matrix")


_DENSE = [("round_robin", "ring"), ("contiguous", "all_gather"), ("round_robin", "ulysses")]


@pytest.mark.mixers_matrix
@pytest.mark.parametrize("arch", HYBRIDS)
@pytest.mark.parametrize("world", [1, 2, 3])
@pytest.mark.parametrize(("layout", "method"), _DENSE)
def test_hybrid_matrix_dense(
    ranks: Ranks, matrix_only: None, arch: str, world: int, layout: str, method: str
) -> None:
    if method == "ulysses" and world == 3:
        pytest.skip("the tiny models have 2 KV heads")
    ranks(world, hybrid_dense, arch, layout, method, timeout=600)


@pytest.mark.mixers_matrix
@pytest.mark.parametrize("arch", HYBRIDS)
@pytest.mark.parametrize("world", [1, 2, 3])
@pytest.mark.parametrize("layout", ["packed", "balanced"])
def test_hybrid_matrix_packed(
    ranks: Ranks, matrix_only: None, arch: str, world: int, layout: str
) -> None:
    ranks(world, hybrid_packed, arch, layout, timeout=600)
