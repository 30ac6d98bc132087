"""CP attention inside real models: a plain SDPA module and tiny HF Llama / Qwen2."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from _attention_fns import (
    hf_case,
    hf_public_case,
    hf_public_reference,
    hf_tokens,
    tiny_hf_model,
    tiny_module_case,
)

from _attention_common import make_case
from _ranks import Ranks

pytestmark = pytest.mark.multirank


@pytest.mark.parametrize(
    ("world", "method", "layout"),
    [(2, "ring", "round_robin"), (3, "all_gather", "random"), (2, "ulysses", "contiguous")],
)
def test_plain_module_sdpa_is_routed(ranks: Ranks, world: int, method: str, layout: str) -> None:
    seq_len = 6 * world
    res = ranks(world, tiny_module_case, method, layout, seq_len)
    # reference: the same module, one process, full sequence, plain SDPA (no context)
    full_y, _, full_grads = tiny_module_case(None, method, "contiguous", seq_len, False)
    for y, idx, _grads in res:
        torch.testing.assert_close(y, full_y.index_select(1, idx))
    for name, g in full_grads.items():
        total = sum(grads[name] for _, _, grads in res)
        torch.testing.assert_close(total, g, msg=lambda m, n=name: f"{n}: {m}")


def _hf_reference(arch: str, seq_len: int, padded: int) -> tuple[torch.Tensor, float, dict]:
    model = tiny_hf_model(arch)
    if arch == "gemma2":  # HF's default for Gemma 2 differs by release (5.17's sdpa drops softcap)
        model.set_attn_implementation("eager")
    ids, labels = hf_tokens(seq_len, padded)
    logits = model(input_ids=ids[:, :seq_len]).logits
    n = int((labels != -100).sum())
    loss = F.cross_entropy(logits[0], labels[0, :seq_len], ignore_index=-100, reduction="sum") / n
    loss.backward()
    grads = {k: p.grad for k, p in model.named_parameters() if p.grad is not None}
    return logits.detach(), float(loss.detach()), grads


@pytest.mark.parametrize(
    ("arch", "world", "method", "layout"),
    [
        ("llama", 2, "ring", "round_robin"),
        ("llama", 3, "all_gather", "random"),
        ("qwen2", 2, "ulysses", "round_robin"),
        ("qwen2", 4, "ring", "contiguous"),
        ("llama", 1, "all_gather", "round_robin"),
        # sliding windows (per layer as HF passes them) and Gemma 2's soft-capped scores
        ("mistral", 2, "ring", "round_robin"),
        ("qwen2_sw", 3, "all_gather", "random"),
        ("qwen3_sw", 2, "ulysses", "round_robin"),
        ("gemma2", 2, "ring", "random"),
        ("gemma2", 2, "ulysses", "contiguous"),
    ],
)
def test_hf_model_matches_one_process(
    ranks: Ranks, arch: str, world: int, method: str, layout: str
) -> None:
    pytest.importorskip("transformers")
    seq_len = 8 * world - 1  # odd: padded by the layout
    rmap, _ = make_case(layout, world, seq_len, 1, 1, 0, 1)
    ref_logits, ref_loss, ref_grads = _hf_reference(arch, seq_len, rmap.numel())
    res = ranks(world, hf_case, arch, method, layout, seq_len)
    # Gemma 2's reference is HF's eager attention, whose softmax runs in fp32 even for fp64
    # inputs: compare at fp32 precision there, at fp64 precision everywhere else.
    rel, tol = (1e-6, {"rtol": 1e-5, "atol": 1e-6}) if arch == "gemma2" else (1e-12, {})
    for got in res:
        real = got["idx"] < seq_len
        torch.testing.assert_close(got["logits"][0, real], ref_logits[0, got["idx"][real]], **tol)
        assert got["loss"] == pytest.approx(ref_loss, rel=rel)
    assert ref_grads.keys() == res[0]["grads"].keys()
    for name, g in ref_grads.items():
        torch.testing.assert_close(
            res[0]["grads"][name], g, **tol, msg=lambda m, n=name: f"{n}: {m}"
        )


@pytest.mark.parametrize(
    ("arch", "world", "method", "padding", "call"),
    [
        ("llama", 1, "all_gather", "left", "explicit"),
        ("llama", 2, "ring", "right", "explicit"),
        ("llama", 2, "all_gather", "left", "kwargs"),
        ("qwen2", 3, "all_gather", "mixed", "explicit"),
        ("qwen2", 2, "ulysses", "left", "kwargs"),
        ("llama", 3, "ring", "left", "kwargs"),
    ],
)
def test_hf_public_path_with_attention_mask(
    ranks: Ranks, arch: str, world: int, method: str, padding: str, call: str
) -> None:
    """prepare_cp_forward(model, mesh, batch with attention_mask), then the model under ctx():
    the same logits (real tokens), loss and gradients as one process with HF's sdpa and mask."""
    pytest.importorskip("transformers")
    ref = hf_public_reference(arch, padding)
    real = ref["mask"].bool()
    res = ranks(world, hf_public_case, arch, method, padding, call)
    for got in res:
        torch.testing.assert_close(got["logits"][real], ref["logits"][real])
        assert got["loss"] == pytest.approx(ref["loss"], rel=1e-12)
    assert ref["grads"].keys() == res[0]["grads"].keys()
    for name, g in ref["grads"].items():
        torch.testing.assert_close(res[0]["grads"][name], g, msg=lambda m, n=name: f"{n}: {m}")
