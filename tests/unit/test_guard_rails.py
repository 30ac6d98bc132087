"""Guard rails without a process group: fingerprint, pad id, strict parsing, no aliasing."""

from __future__ import annotations

import subprocess
import sys
from typing import Any

import pytest
import torch

import cpshard
from cpshard.guards.consistency import FIELDS, batch_fingerprint, mismatch_message
from cpshard.models import TinyDecoder, TinyDecoderConfig


def _fp(batch: Any, **kw: Any) -> torch.Tensor:
    args = {"layout": "auto", "attention": "all_gather", "padding_token_id": 0, **kw}
    return batch_fingerprint(batch, **args)


def _batch() -> dict[str, Any]:
    ids = torch.randint(0, 100, (3, 16), generator=torch.Generator().manual_seed(0))
    return {"input_ids": ids, "labels": cpshard.shift_labels(ids)}


def _changed(a: torch.Tensor, b: torch.Tensor) -> set[str]:
    return {FIELDS[i] for i in range(len(FIELDS)) if a[i] != b[i]}


def test_fingerprint_is_fixed_size_and_sensitive() -> None:
    base = _batch()
    fp = _fp(base)
    assert fp.shape == (len(FIELDS),) and fp.dtype == torch.long
    assert torch.equal(fp, _fp(_batch()))  # deterministic
    big = {"input_ids": torch.zeros(8, 4096, dtype=torch.long)}
    assert _fp(big).shape == fp.shape  # size never depends on the batch
    one = dict(base, input_ids=base["input_ids"].clone())
    one["input_ids"][2, 7] += 1
    assert _changed(fp, _fp(one)) == {"input_ids"}
    swapped = dict(base, input_ids=base["input_ids"][:, [1, 0, *range(2, 16)]])
    assert "input_ids" in _changed(fp, _fp(swapped))
    assert _changed(fp, _fp(base, attention="ring")) == {"attention"}
    assert _changed(fp, _fp(base, padding_token_id=None)) == {"padding_token_id"}
    emb = {"inputs_embeds": torch.randn(2, 8, 4)}
    emb2 = {"inputs_embeds": emb["inputs_embeds"].clone()}
    emb2["inputs_embeds"][1, 3, 2] += 1.0
    assert "inputs_embeds" in _changed(_fp(emb), _fp(emb2))
    # seq_lens as lists or as a tensor: the same content hash
    lists = dict(base, seq_lens=[[8, 8], [16], [4, 12]])
    ragged = dict(base, seq_lens=[[8, 8], [16], [4, 12]])
    assert torch.equal(_fp(lists), _fp(ragged))
    assert "seq_lens" in _changed(_fp(lists), _fp(dict(base, seq_lens=[[8, 8], [16], [5, 11]])))


def test_fingerprint_never_raises_on_malformed_batches() -> None:
    for bad in ([1, 2], None, {"input_ids": "x"}, {"input_ids": torch.zeros(0)}, {3: object()}):
        assert _fp(bad).shape == (len(FIELDS),)
    meta = {"input_ids": torch.zeros(2, 4, dtype=torch.long, device="meta")}
    assert _fp(meta).shape == (len(FIELDS),)


def test_mismatch_message_names_fields_and_ranks() -> None:
    a, b = _fp(_batch()), _fp(dict(_batch(), input_ids=torch.zeros(3, 12, dtype=torch.long)))
    msg = mismatch_message(torch.stack([a, a, b]))
    assert msg is not None
    assert "S (rank 0: 16, rank 1: 16, rank 2: 12)" in msg
    assert "input_ids (ranks [0, 1] vs ranks [2])" in msg
    assert "check_consistency=False" in msg
    assert mismatch_message(torch.stack([a, a])) is None


@pytest.mark.parametrize(
    ("pad", "match"),
    [
        (None, r"padding_token_id=None.*tokenizer.pad_token_id, or tokenizer.eos_token_id"),
        (-1, "must be a non-negative token id, got -1"),
        (True, "must be a non-negative int, got True"),
        (2.0, "must be a non-negative int, got 2.0"),
    ],
)
def test_padding_token_id_rules(pad: Any, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        cpshard.make_cp_batch_and_ctx(None, _batch(), padding_token_id=pad)


def test_padding_token_id_checked_against_vocab() -> None:
    model = TinyDecoder(TinyDecoderConfig(vocab_size=64))
    with pytest.raises(ValueError, match="outside the model's vocabulary of 64 ids"):
        cpshard.prepare_cp_forward(model, None, {"input_ids": torch.ones(1, 4).long()},
                                   padding_token_id=64)  # fmt: skip
    emb = {"inputs_embeds": torch.randn(1, 4, 8)}
    cpshard.make_cp_batch_and_ctx(None, emb, padding_token_id=None)  # nothing to pad with ids


@pytest.mark.parametrize(
    ("batch", "match"),
    [
        ({"input_ids": torch.ones(2, 0).long()}, r"B >= 1 rows of S >= 1 tokens"),
        ({"input_ids": torch.ones(0, 5).long()}, r"B >= 1 rows of S >= 1 tokens"),
        ({"input_ids": torch.ones(1, 8).long(), "seq_lens": True}, "seq_lens: must be per-row"),
        ({"input_ids": torch.ones(1, 8).long(), "seq_lens": "8"}, "seq_lens: must be per-row"),
        ({"input_ids": torch.ones(1, 8).long(), "seq_lens": [[True, 7]]}, "not bool, str"),
        ({"input_ids": torch.ones(1, 8).long(), "seq_lens": [["8"]]}, "not bool, str"),
        (
            {"input_ids": torch.ones(1, 8).long(), "attention_mask": torch.ones(1, 1, 8, 8)},
            "looks like a 0/1 keep mask",
        ),
        (
            {
                "input_ids": torch.ones(1, 8).long(),
                "attention_mask": torch.full((1, 8), float("-inf")),
            },
            "a 2-D attention_mask must be a keep mask",
        ),
        (
            {
                "input_ids": torch.ones(1, 8).long(),
                "attention_mask": torch.ones(1, 1, 8, 8, dtype=torch.long),
            },
            "must be bool .* or floating-point additive",
        ),
        (
            {"input_ids": torch.ones(1, 8, dtype=torch.long, device="meta")},
            "meta-device tensor",
        ),
        (
            {"input_ids": torch.ones(1, 8).long(), "seq_lens": [[8]], "seq_lens_padded": [[8]]},
            "padded document lengths.*Fix: drop the separator slots",
        ),
    ],
)
def test_strict_parsing(batch: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        cpshard.make_cp_batch_and_ctx(None, batch)


def test_verbs_reject_non_tensors_and_meta() -> None:
    _, _, sharder = cpshard.make_cp_batch_and_ctx(None, _batch())
    with pytest.raises(TypeError, match="shard_token_tensor needs a torch.Tensor, got list"):
        sharder.shard_token_tensor([[1.0] * 16] * 3)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="gather_token_tensor needs a torch.Tensor"):
        sharder.gather_token_tensor(None)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="meta device"):
        sharder.gather_token_tensor(torch.zeros(3, 16, device="meta"))


# one layout of each kind: the identity, a closed-form map, a packed plan
@pytest.mark.parametrize("layout", ["none", "contiguous", "balanced"])
def test_no_aliasing_at_cp1(layout: str) -> None:
    batch = _batch()
    if layout == "balanced":
        batch["seq_lens"] = [[16]] * 3
    ctx, local, sharder = cpshard.make_cp_batch_and_ctx(None, batch, layout=layout)  # type: ignore[arg-type]
    for key, value in local.items():
        if isinstance(value, torch.Tensor) and key in batch:
            assert not _shares(value, batch[key]), key
    adv = torch.randn(3, 16)
    shard = sharder.shard_token_tensor(adv, fill=0.0)
    assert not _shares(shard, adv)
    full = sharder.gather_token_tensor(shard, trim=True, fill=0.0)
    assert not _shares(full, shard) and torch.equal(full, adv)
    shard.mul_(2)  # in-place edits never reach the caller
    assert torch.equal(full, adv)


def _shares(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


def test_ctx_works_with_and_without_call() -> None:
    from cpshard.attention.context import cp_context_active

    ctx, _, _ = cpshard.make_cp_batch_and_ctx(None, _batch())
    with ctx:
        assert cp_context_active()
    assert not cp_context_active()
    with ctx():
        assert cp_context_active()
    assert not cp_context_active()


def test_import_cpshard_is_enough() -> None:
    code = (
        "import cpshard; cpshard.attention.cp_attention; cpshard.attention.suspend; "
        "cpshard.loss.cp_cross_entropy; cpshard.loss.count_tokens; cpshard.shift_labels"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_hf_mask_under_cp_raises_without_the_model_guard() -> None:
    """use_cp_attention + a hand-made context (no prepare_cp_forward): the mask still raises."""
    transformers = pytest.importorskip("transformers")
    from cpshard.attention import cp_attention_context, use_cp_attention

    cfg = transformers.LlamaConfig(
        vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=2, use_cache=False,
    )  # fmt: skip
    model = transformers.LlamaForCausalLM(cfg)
    use_cp_attention(model)
    ctx, local, sharder = cpshard.make_cp_batch_and_ctx(None, _batch())
    assert sharder.token_meta is not None
    ids = torch.randint(0, 32, (3, 16))
    with cp_attention_context(None, sharder.token_meta, "all_gather"):
        padded = torch.ones(3, 16, dtype=torch.long)
        padded[:, -2:] = 0
        with pytest.raises(ValueError, match="got an attention_mask .* inside a CP context"):
            model(input_ids=ids, attention_mask=padded)
        model(input_ids=ids)
        # an all-ones keep-mask masks nothing (BioGPT builds one itself): the same as none
        model(input_ids=ids, attention_mask=torch.ones(3, 16, dtype=torch.long))


@pytest.mark.parametrize("shape", [(7, 13), (1, 5), (3, 1), (2, 3, 4), (17,)])
def test_content_hash_is_the_weighted_sum_mod_2_64(shape: tuple[int, ...]) -> None:
    from cpshard.guards.consistency import _content_hash

    x = torch.randint(-(2**62), 2**62, shape, generator=torch.Generator().manual_seed(1))
    flat = x.reshape(-1)
    direct = (flat * (torch.arange(flat.numel()) * 2 + 1)).sum() + flat.numel()  # wraps
    assert int(_content_hash(x)) == int(direct)


def test_custom_shard_batch_ctx_supports_with_statement() -> None:
    import contextlib

    def shard(cp_mesh: Any, tp_mesh: Any, batch: Any, **kw: Any) -> Any:
        return contextlib.nullcontext, dict(batch)

    sharder = cpshard.CPSharder(shard_batch=shard, local_token_global_indices=None)
    ctx, _, _ = cpshard.make_cp_batch_and_ctx(None, _batch(), cp_sharder=sharder)
    with ctx:
        pass
    with ctx():
        pass
