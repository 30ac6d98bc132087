"""HF models CP cannot run exactly are refused with the reason; the ones it can are exact (cp=1).

At cp=1 the same checks run as at cp=N (one process, no process group): the static ones at
``prepare_cp_forward``, the backstops inside ``ctx()``.
"""

from __future__ import annotations

import pytest

import _hf_sweep
from _hf_sweep import sweep_case

pytest.importorskip("transformers")

_OWN_ATTENTION = "computes attention itself instead of through"


def _through_interface(arch: str) -> bool:
    """Whether the installed transformers' ``arch`` attention calls the AttentionInterface.

    Older releases (e.g. 5.17's Falcon) compute attention inline: cpshard then refuses the model
    for that reason first (exact or refused), before any config-specific one.
    """
    import importlib
    import inspect

    module = importlib.import_module(f"transformers.models.{arch}.modeling_{arch}")
    return "ALL_ATTENTION_FUNCTIONS" in inspect.getsource(module)


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
    out = sweep_case(None, arch, "ring", layout)
    assert out.kind == "refused", out
    if arch == "falcon" and not _through_interface(arch):
        reason = f"FalconForCausalLM {_OWN_ATTENTION}"
    assert reason in out.detail


@pytest.mark.parametrize("arch", ["biogpt", "gpt2", "falcon"])
def test_exact_where_the_model_goes_through_the_interface(arch: str) -> None:
    out = sweep_case(None, arch, "all_gather", "balanced")
    if not _through_interface(arch):  # this transformers' attention is inline: refused instead
        assert out.kind == "refused" and _OWN_ATTENTION in out.detail, out
        return
    assert out.kind == "exact", out
