"""Rank functions that run the README's "Example" block as written, against one process."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.testing import assert_close

from _readme import README, fenced_block

PAD_ID = 0


def readme_example_code() -> str:
    """The first ```python block of the README's "## Example" section."""
    return fenced_block(README.read_text(), "## Example")


def _model() -> Any:
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, use_cache=False,
        attn_implementation="sdpa",
    )  # fmt: skip
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg).double()


def _inputs() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(11)
    ids = torch.randint(1, 64, (2, 23), generator=gen)
    mask = torch.ones_like(ids)
    mask[0, 17:] = 0  # right padding
    mask[1, :4] = 0  # left padding
    ids = ids.masked_fill(mask == 0, PAD_ID)
    advantages = torch.randn(2, 23, generator=gen, dtype=torch.float64)
    return {"ids": ids, "mask": mask, "advantages": advantages}


def _reference(inputs: dict[str, torch.Tensor]) -> dict[str, Any]:
    """One process, the model's own sdpa attention with the tokenizer mask; loss over real pairs."""
    model = _model()
    ids, mask = inputs["ids"], inputs["mask"]
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    logits = model(input_ids=ids, attention_mask=mask, position_ids=pos).logits
    target = ids[:, 1:]
    real = (mask[:, :-1] == 1) & (mask[:, 1:] == 1)
    logp_all = torch.log_softmax(logits.float(), -1)
    tok = logp_all[:, :-1].gather(-1, target[..., None])[..., 0]
    loss = -(tok * real).sum() / real.sum()
    loss.backward()
    grads = {k: p.grad.detach().clone() for k, p in model.named_parameters()}
    return {"loss": loss.detach(), "grads": grads, "logp": tok.detach(), "real": real}


def readme_example_matches_one_process(cp_mesh: DeviceMesh) -> None:
    """Exec the README example as written on this CP group; compare with one process."""
    inputs = _inputs()
    want = _reference(inputs)
    model = _model()
    scope: dict[str, Any] = {
        "model": model,
        "cp_mesh": cp_mesh,
        "ids": inputs["ids"].clone(),
        "mask": inputs["mask"].clone(),
        "advantages": inputs["advantages"].clone(),
        "tokenizer": SimpleNamespace(pad_token_id=PAD_ID),
    }
    exec(compile(readme_example_code(), str(README), "exec"), scope)
    assert torch.equal(scope["ids"], inputs["ids"])  # the caller's tensors are untouched
    # The README's loss is this rank's share of the global mean: their sum is the global loss.
    total = scope["loss"].detach().clone()
    if cp_mesh is not None:
        from cpshard.loss import reduce_for_logging

        total = reduce_for_logging(scope["loss"], cp_mesh)
    # The example's loss runs in float32 (logits.float()), so float32 tolerances.
    assert_close(total.double(), want["loss"].double(), rtol=1e-6, atol=1e-7)
    for name, p in model.named_parameters():
        assert_close(p.grad, want["grads"][name], rtol=1e-5, atol=1e-7, msg=name)
    real = want["real"]
    assert_close(scope["logp_full"][:, :-1][real].double(), want["logp"][real].double())
    adv = scope["adv"]
    assert adv.shape == scope["local"]["input_ids"].shape  # this rank's tokens
    back = scope["sharder"].gather_token_tensor(adv, trim=True)
    assert_close(back, inputs["advantages"], rtol=0, atol=0)  # caller coordinates round trip
