"""Batch conventions without a process group: normalisation, masks, errors, label shift."""

from __future__ import annotations

import warnings

import pytest
import torch

import cpshard
from cpshard.sharding.batch import TokenKey, attention_mask_to_padding_mask, normalize_batch


def _ids(b: int = 2, s: int = 5) -> torch.Tensor:
    return torch.arange(b * s).reshape(b, s) + 1


def test_position_ids_created_global_and_mask_converted() -> None:
    am = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]])
    out, dims, primary = normalize_batch({"input_ids": _ids(), "attention_mask": am})
    assert primary == "input_ids"
    assert out["position_ids"].tolist() == [list(range(5))] * 2
    assert out["padding_mask"].tolist() == [[False] * 3 + [True] * 2, [False] * 5]
    assert "attention_mask" not in out
    assert dims == {"input_ids": 1, "padding_mask": 1, "position_ids": 1}


@pytest.mark.parametrize("kind", ["bool2d", "int2d", "bool4d", "additive4d"])
def test_attention_mask_forms(kind: str) -> None:
    keep = torch.tensor([[True, True, False], [False, True, True]])
    if kind == "bool2d":
        mask = keep
    elif kind == "int2d":
        mask = keep.long()
    else:
        causal = torch.tril(torch.ones(3, 3, dtype=torch.bool))
        m4 = causal & keep[:, None, :] & keep[:, :, None]
        m4 = m4 | torch.eye(3, dtype=torch.bool) & keep[:, :, None]
        m4 = m4[:, None]
        if kind == "bool4d":
            mask = m4
        else:
            mask = torch.zeros(m4.shape).masked_fill(~m4, float("-inf"))
    assert torch.equal(attention_mask_to_padding_mask(mask), ~keep)


def test_bad_attention_mask_rank() -> None:
    with pytest.raises(ValueError, match=r"2-D \[B, S\] or 4-D"):
        attention_mask_to_padding_mask(torch.ones(2, 3, 3))


def test_extra_keys_and_mrope_dims() -> None:
    pos3 = torch.arange(5).expand(3, 2, 5)
    adv = torch.randn(2, 5)
    logits_like = torch.randn(2, 7, 5)
    out, dims, _ = normalize_batch(
        {"input_ids": _ids(), "position_ids": pos3, "adv": adv, "feat": logits_like, "meta": "x"},
        extra_token_keys={"adv": TokenKey(1, 0.0), "feat": TokenKey(-1, 0.0)},
    )
    assert dims["position_ids"] == 2 and dims["adv"] == 1 and dims["feat"] == 2
    assert out["meta"] == "x"


def test_inputs_embeds_primary() -> None:
    emb = torch.randn(2, 5, 4)
    out, dims, primary = normalize_batch({"inputs_embeds": emb})
    assert primary == "inputs_embeds" and out["inputs_embeds"] is emb


@pytest.mark.parametrize(
    ("batch", "match"),
    [
        ({}, "exactly one of 'input_ids'.*got neither"),
        ({"input_ids": _ids(), "inputs_embeds": torch.randn(2, 5, 3)}, "got both"),
        ({"input_ids": torch.arange(5)}, r"must be a 2-D tensor, got \(5,\)"),
        (
            {"input_ids": _ids(), "labels": _ids(2, 4)},
            r"batch\['labels'\] has length 4 .*seq_len=5",
        ),
        ({"input_ids": _ids(), "labels": _ids(3, 5)}, "batch size 3"),
        (
            {
                "input_ids": _ids(),
                "attention_mask": torch.ones(2, 5),
                "padding_mask": torch.ones(2, 5),
            },
            "both 'attention_mask' and 'padding_mask'",
        ),
        ({"input_ids": _ids(), "labels": [1, 2]}, "must be a tensor, got list"),
    ],
)
def test_bad_batches(batch: dict[str, object], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        normalize_batch(batch)


def test_bad_extra_keys() -> None:
    with pytest.raises(ValueError, match="already has a built-in convention"):
        normalize_batch({"input_ids": _ids()}, extra_token_keys={"labels": TokenKey()})
    with pytest.raises(ValueError, match="'nope', which is not in the batch"):
        normalize_batch({"input_ids": _ids()}, extra_token_keys={"nope": TokenKey()})
    with pytest.raises(ValueError, match="given both in the batch and as an argument"):
        normalize_batch(
            {"input_ids": _ids(), "loss_mask": torch.ones(2, 5)}, loss_mask=torch.ones(2, 5)
        )


def test_normalize_does_not_mutate_caller() -> None:
    am = torch.ones(2, 5, dtype=torch.long)
    batch = {"input_ids": _ids(), "attention_mask": am}
    before = dict(batch)
    normalize_batch(batch)
    assert batch == before and batch["attention_mask"] is am


def test_shift_labels() -> None:
    ids = torch.tensor([[5, 6, 7, 8], [1, 2, 3, 4]])
    assert cpshard.shift_labels(ids).tolist() == [[6, 7, 8, -100], [2, 3, 4, -100]]
    pad = torch.tensor([[False, False, True, True], [False] * 4])
    out = cpshard.shift_labels(ids, padding_mask=pad, ignore_index=-1)
    assert out.tolist() == [[6, -1, -1, -1], [2, 3, 4, -1]]
    assert ids.tolist() == [[5, 6, 7, 8], [1, 2, 3, 4]]
    with pytest.raises(ValueError, match=r"expects \[B, S\]"):
        cpshard.shift_labels(torch.arange(4))
    with pytest.raises(ValueError, match="padding_mask shape"):
        cpshard.shift_labels(ids, padding_mask=pad[:, :3])


@pytest.mark.parametrize(
    ("batch", "extra", "match"),
    [
        (
            {"input_ids": _ids(), "position_ids": torch.arange(5)},
            None,
            r"batch\['position_ids'\] is 1-D with shape \(5,\).*\[B\|1, S\] or mRoPE \[3, B, S\]",
        ),
        (
            {"input_ids": _ids(), "labels": torch.arange(5)},
            None,
            r"batch\['labels'\] is 1-D with shape \(5,\).*sequence dim 1",
        ),
        (
            {"input_ids": _ids(), "adv": torch.zeros(2, 5)},
            {"adv": TokenKey(seq_dim=5)},
            r"extra_token_keys\['adv'\].seq_dim=5 is out of range for a 2-D tensor",
        ),
        (
            {"input_ids": _ids(), "adv": torch.zeros(2, 5)},
            {"adv": TokenKey(seq_dim=-3)},
            r"seq_dim=-3 is out of range",
        ),
        (
            {"input_ids": _ids(), "adv": [0.0] * 5},
            {"adv": TokenKey()},
            r"batch\['adv'\] must be a tensor, got list",
        ),
        (
            {"input_ids": _ids(), "adv": torch.zeros(2, 5, dtype=torch.long)},
            {"adv": TokenKey(pad=0.5)},
            r"pad=0.5, .*integer tensor batch\['adv'\] \(torch.int64\)",
        ),
    ],
)
def test_bad_token_tensors_raise_value_errors(
    batch: dict[str, object], extra: dict[str, TokenKey] | None, match: str
) -> None:
    with pytest.raises(ValueError, match=match):
        normalize_batch(batch, extra_token_keys=extra)


def test_none_values_mean_absent() -> None:
    """HF-style batches carry ``None`` for absent inputs; they are not token tensors."""
    emb = torch.randn(2, 5, 3)
    out, dims, primary = normalize_batch(
        {"input_ids": None, "inputs_embeds": emb, "attention_mask": None, "labels": None}
    )
    assert primary == "inputs_embeds" and out["inputs_embeds"] is emb
    assert "padding_mask" not in out and set(dims) == {"inputs_embeds", "position_ids"}
    with pytest.raises(ValueError, match="got neither"):
        normalize_batch({"input_ids": None, "inputs_embeds": None})


def test_batch_must_be_a_mapping() -> None:
    with pytest.raises(TypeError, match=r"batch must be a dict.*got list"):
        cpshard.make_cp_batch_and_ctx(None, [_ids()])  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"batch must be a dict.*got tuple"):
        cpshard.prepare_cp_forward(torch.nn.Linear(2, 2), None, (_ids(),))  # type: ignore[arg-type]


def _block_causal(lens: list[int]) -> torch.Tensor:
    """BoolTensor [S, S]: causal attention within each document."""
    doc = torch.repeat_interleave(torch.arange(len(lens)), torch.tensor(lens))
    ar = torch.arange(len(doc))
    return (doc[:, None] == doc[None, :]) & (ar[None, :] <= ar[:, None])


@pytest.mark.parametrize("kind", ["bool", "additive"])
def test_four_d_document_mask_is_refused_with_its_seq_lens(kind: str) -> None:
    """Issue 17: a block-diagonal 4-D mask was reduced to padding (documents dropped)."""
    m = torch.stack([_block_causal([3, 5]), _block_causal([8])])[:, None]
    mask = m if kind == "bool" else torch.zeros(m.shape).masked_fill(~m, torch.finfo().min)
    with pytest.raises(ValueError, match=r"seq_lens=\[\[3, 5\], \[8\]\]"):
        attention_mask_to_padding_mask(mask)


@pytest.mark.parametrize("kind", ["bidirectional", "bias"])
def test_four_d_mask_that_is_not_causal_padding_is_refused(kind: str) -> None:
    causal = torch.tril(torch.ones(4, 4, dtype=torch.bool))[None, None]
    if kind == "bidirectional":
        mask = torch.ones(1, 1, 4, 4, dtype=torch.bool)
    else:  # an additive bias (ALiBi-like) that padding cannot carry
        mask = torch.zeros(1, 1, 4, 4).masked_fill(~causal, float("-inf"))
        mask[0, 0, 3, 0] = -0.5
    with pytest.raises(ValueError, match="honoured only as causal padding"):
        attention_mask_to_padding_mask(mask)


def test_restarting_position_ids_are_documents() -> None:
    """Padding-free packing without seq_lens (position_ids restarting at 0 inside a row and no
    mask, as TRL's collator emits and as HF's masks read it): the batch is packed (documents
    kept apart), exactly as with seq_lens; a dense layout refuses it; 0..n-1 rows and rows with
    an attention_mask (HF keeps those dense too) stay dense."""
    ids = torch.arange(1, 11).reshape(1, 10)
    restart = torch.tensor([[0, 1, 2, 3, 0, 1, 2, 0, 1, 2]])
    _, by_pos, sh_pos = cpshard.make_cp_batch_and_ctx(
        None, {"input_ids": ids, "position_ids": restart}
    )
    _, by_len, sh_len = cpshard.make_cp_batch_and_ctx(
        None, {"input_ids": ids, "seq_lens": [[4, 3, 3]]}
    )
    assert sh_pos.layout == sh_len.layout == "balanced"
    assert torch.equal(by_pos["position_ids"], by_len["position_ids"])
    with pytest.raises(ValueError, match="do not step by \\+1 inside a row.*attention_mask"):
        cpshard.make_cp_batch_and_ctx(
            None, {"input_ids": ids, "position_ids": restart}, layout="round_robin"
        )
    left = {
        "input_ids": ids,
        "position_ids": torch.tensor([[1, 1, 1, 0, 1, 2, 3, 4, 5, 6]]),
        "attention_mask": torch.tensor([[0, 0, 0, 1, 1, 1, 1, 1, 1, 1]]),
    }
    _, _, sh_left = cpshard.make_cp_batch_and_ctx(None, left)
    plain = {"input_ids": ids, "position_ids": torch.arange(10).reshape(1, 10)}
    _, _, sh_plain = cpshard.make_cp_batch_and_ctx(None, plain)
    assert sh_left.layout == sh_plain.layout == "none"


def test_documents_from_positions_warn_when_the_model_builds_a_cache() -> None:
    """transformers reads non-+1 position steps as documents only without a KV cache: a model
    whose config builds one (use_cache=True) would read the row as one causal sequence, so the
    documents reading is named with its fixes; not with a mask, seq_lens or use_cache=False."""
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(
        vocab_size=16, hidden_size=8, intermediate_size=16, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, use_cache=True,
    )  # fmt: skip
    model = transformers.LlamaForCausalLM(cfg)
    ids = torch.arange(1, 7).reshape(1, 6)
    gaps = {"input_ids": ids, "position_ids": torch.tensor([[0, 1, 2, 5, 6, 7]])}
    with pytest.warns(RuntimeWarning, match="use_cache=True.*attention_mask of ones"):
        cpshard.prepare_cp_forward(model, None, gaps)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        cpshard.prepare_cp_forward(model, None, {**gaps, "attention_mask": torch.ones(1, 6)})
        cpshard.prepare_cp_forward(model, None, {"input_ids": ids, "seq_lens": [[3, 3]]})
        model.config.use_cache = False
        cpshard.prepare_cp_forward(model, None, gaps)
