"""HF models CP cannot run exactly are refused with the reason; the ones it can are exact (cp=1).

At cp=1 the same checks run as at cp=N (one process, no process group): the static ones at
``prepare_cp_forward``, the backstops inside ``ctx()``.
"""

from __future__ import annotations

import pytest

import _hf_sweep
from _hf_sweep import sweep_case

pytest.importorskip("transformers")


@pytest.mark.parametrize(
    ("arch", "special", "reason"),
    [
        ("bloom", {}, "BloomAttention computes attention itself instead of through"),
        ("falcon", {"alibi": True}, "FalconConfig enables alibi"),
        ("deepseek_v32", {}, "DeepseekV32Attention reads the attention mask itself"),
        ("doge", {}, "DogeAttention computed its own attention mask"),
        # at cp=1 a dense row is numbered right by a local arange: a packed one is not
        ("bart", {}, "BartLearnedPositionalEmbedding (a learned position table)"),
    ],
)
def test_refused_with_the_module_and_the_reason(
    monkeypatch: pytest.MonkeyPatch, arch: str, special: dict, reason: str
) -> None:
    monkeypatch.setitem(_hf_sweep._SPECIAL, arch, special)
    layout = "balanced" if arch == "bart" else "round_robin"
    out = sweep_case(None, arch, "ring", layout)  # type: ignore[arg-type]
    assert out.kind == "refused", out
    assert reason in out.detail


@pytest.mark.parametrize("arch", ["biogpt", "gpt2", "falcon"])
def test_exact_where_the_model_goes_through_the_interface(arch: str) -> None:
    out = sweep_case(None, arch, "all_gather", "balanced")  # type: ignore[arg-type]
    assert out.kind == "exact", out
