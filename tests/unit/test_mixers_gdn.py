"""The native Gated DeltaNet path: which modules it serves, the verdict, the shard test."""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch

from _mixer_models import native_served, tiny_hybrid
from cpshard.mixers import CPMixerWarning, check_token_mixers, find_token_mixers
from cpshard.mixers.gdn import _FORMS, _HELPERS, gdn_form, serves_native_gdn
from cpshard.sharding.meta import TokenMeta

pytest.importorskip("transformers")


def _mixer(arch: str) -> Any:
    return find_token_mixers(tiny_hybrid(arch))[0].module


def _verified_sources() -> bool:
    """Whether the installed transformers has the helper functions the native path was verified
    against (older releases, e.g. 5.17, structure their Gated DeltaNet otherwise)."""
    import importlib

    return all(
        hasattr(importlib.import_module(file_name), h)
        for file_name, _, _ in _FORMS.values()
        for h in _HELPERS
    )


def test_served_forms_are_recognised_by_their_source() -> None:
    if _verified_sources():
        assert gdn_form(_mixer("qwen3_next")) == "fused"
        assert gdn_form(_mixer("qwen3_5")) == "split"
    else:  # another transformers' source: not served natively (the generic exact path)
        assert gdn_form(_mixer("qwen3_next")) is None
        assert gdn_form(_mixer("qwen3_5")) is None
    assert gdn_form(_mixer("mamba2")) is None  # another mixer altogether


def test_a_changed_forward_is_not_served() -> None:
    module = _mixer("qwen3_next")

    class Edited(type(module)):  # type: ignore[misc]
        def forward(self, hidden_states: torch.Tensor, **kwargs: Any) -> torch.Tensor:
            return super().forward(hidden_states, **kwargs) * 2

    module.__class__ = Edited
    assert gdn_form(module) is None


def test_olmo_hybrid_variant_takes_the_generic_path() -> None:
    import transformers as tf

    if not hasattr(tf, "OlmoHybridConfig"):
        pytest.skip("no OLMo hybrid in this transformers")
    from transformers.models.olmo_hybrid.modeling_olmo_hybrid import OlmoHybridGatedDeltaNet

    cfg = tf.OlmoHybridConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2,
    )  # fmt: skip
    assert gdn_form(OlmoHybridGatedDeltaNet(cfg, 0)) is None  # b/a after the conv, neg. eigval


def test_verdict_serves_gdn_natively_on_in_order_shards() -> None:
    model = tiny_hybrid("qwen3_next")
    if not native_served("qwen3_next"):  # this transformers' GDN source is not the verified one
        with pytest.raises(ValueError, match="strict=True") as refused:
            check_token_mixers(model, 2, strict=True, packed=False)
        assert "natively" not in str(refused.value)  # no native path to point at
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            plan = check_token_mixers(model, 2, strict=False, packed=False)
        assert not plan.native and [w.category for w in caught] == [CPMixerWarning]
        return
    with warnings.catch_warnings():
        warnings.simplefilter("error", CPMixerWarning)  # native: no generic cost to warn about
        plan = check_token_mixers(model, 2, strict=True, packed=False)
    assert [s.name for s in plan.gdn] == ["model.layers.0.linear_attn"]
    assert plan.native == plan.gdn and plan.layout == "contiguous"
    with pytest.raises(ValueError, match="Gated DeltaNet mixers natively"):
        check_token_mixers(model, 2, strict=True, packed=False, layout="round_robin")
    with pytest.raises(ValueError, match="strict=True"):
        check_token_mixers(model, 2, strict=True, packed=True)  # packed: generic, refused
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        plan = check_token_mixers(model, 2, strict=False, packed=True)
    assert plan.layout == "auto" and [w.category for w in caught] == [CPMixerWarning]


def test_shards_of_one_token_are_not_served() -> None:
    module = _mixer("qwen3_next")  # conv width 4: 3 halo tokens

    def meta(world: int, stream: int) -> TokenMeta:
        pos = torch.arange(stream)[None]
        return TokenMeta(1, world, pos, torch.zeros_like(pos))

    assert serves_native_gdn(meta(2, 8), module)
    assert not serves_native_gdn(meta(2, 4), module)  # 2 local tokens < 3 halo tokens
    module.conv1d.kernel_size = (2,)  # 1 halo token: only the decode-branch rule is left
    assert serves_native_gdn(meta(2, 4), module)
    assert not serves_native_gdn(meta(4, 4), module)  # 1 token: the decode branch, no halo read


@pytest.mark.parametrize("arch", ["qwen3_next", "qwen3_5"])
def test_head_channels_are_the_heads_q_k_v_channels(arch: str) -> None:
    """Each key head's convolution channels (q | k | v, head-major in each; ``r`` value heads
    per key head) taken by slices equal the index of those channels."""
    from cpshard.mixers.gdn import _head_channels

    m = _mixer(arch)
    dk, dv = m.head_k_dim, m.head_v_dim
    r = m.num_v_heads // m.num_k_heads
    conv_dim = m.conv1d.weight.shape[0]
    assert conv_dim == 2 * m.key_dim + m.num_v_heads * dv
    ext = torch.randn(2, conv_dim, 7)
    seen = []
    for head in range(m.num_k_heads):
        idx = torch.cat([
            torch.arange(head * dk, (head + 1) * dk),
            torch.arange(m.key_dim + head * dk, m.key_dim + (head + 1) * dk),
            torch.arange(2 * m.key_dim + head * r * dv, 2 * m.key_dim + (head + 1) * r * dv),
        ])  # fmt: skip
        assert torch.equal(_head_channels(m, head, ext, 1), ext[:, idx])
        assert torch.equal(_head_channels(m, head, m.conv1d.weight.squeeze(1), 0),
                           m.conv1d.weight.squeeze(1)[idx])  # fmt: skip
        seen.append(idx)
    assert torch.equal(torch.cat(seen).sort().values, torch.arange(conv_dim))  # every channel
