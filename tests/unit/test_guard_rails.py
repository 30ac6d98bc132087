"""Guard rails without a process group: fingerprint, pad id, strict parsing, no aliasing."""

from __future__ import annotations

import subprocess
import sys
import warnings
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

import cpshard
from _wrappers import Forwarding
from cpshard.models import TinyDecoder, TinyDecoderConfig
from cpshard.sharding.consistency import FIELDS, batch_fingerprint, mismatch_message


def _fp(batch: Any, **kw: Any) -> torch.Tensor:
    args = {"layout": "auto", "attention": "all_gather", "padding_token_id": 0, **kw}
    return batch_fingerprint(batch, **args)


def _batch() -> dict[str, Any]:
    ids = torch.randint(0, 100, (3, 16), generator=torch.Generator().manual_seed(0))
    return {"input_ids": ids, "labels": cpshard.shift_labels(ids)}


def _changed(a: torch.Tensor, b: torch.Tensor) -> set[str]:
    return {FIELDS[i] for i in range(len(FIELDS)) if a[i] != b[i]}


def _differs(a: dict[str, Any], b: dict[str, Any]) -> set[str]:
    return _changed(_fp(a), _fp(b))


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


def _reference_hash(values: list[int], block: int = 1 << 15) -> int:
    """The content hash in plain Python integers: ``n + sum_i (2i + 1) K S_i`` mod 2**64 over
    blocks of ``block`` elements; ``S_i`` sums the block's elements, each re-read from its two
    32-bit lanes ``l`` (low half, high half) mapped to ``l (l + v_j)`` mod 2**32,
    ``v_j = (2j + 1) * 0x9E3779B9`` for lane ``j`` of the block; K = 0xD6E8FEB86659FD93."""
    m64, m32 = (1 << 64) - 1, (1 << 32) - 1
    total = len(values)
    for i in range(0, len(values), block):
        s = 0
        for e, v in enumerate(values[i : i + block]):
            lanes = [(v & m64) & m32, (v & m64) >> 32]
            y = [(lane * (lane + (2 * (2 * e + h) + 1) * 0x9E3779B9)) & m32 for h, lane in
                 enumerate(lanes)]  # fmt: skip
            s += y[0] | (y[1] << 32)
        total += (2 * (i // block) + 1) * 0xD6E8FEB86659FD93 * s
    return total & m64


@pytest.mark.parametrize("block", [None, 4, 5, 64])
@pytest.mark.parametrize("shape", [(7, 13), (1, 5), (3, 1), (2, 3, 4), (17,)])
def test_lane_hash_is_a_nonlinear_sum_over_every_element(
    shape: tuple[int, ...], block: int | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Checked against plain Python integers, in one block or in blocks of any size (the last
    one short): every block's lanes have the same keys, and its sum its own weight."""
    from cpshard.sharding import consistency

    if block is not None:
        monkeypatch.setattr(consistency, "_BLOCK", block)
    x = torch.randint(-(2**62), 2**62, shape, generator=torch.Generator().manual_seed(1))
    x.view(-1)[0] = -(2**63)  # the extremes wrap like the int64 arithmetic
    x.view(-1)[-1] = 2**63 - 1
    m = (1 << 64) - 1
    want = _reference_hash(x.reshape(-1).tolist(), block or consistency._BLOCK)
    assert int(consistency._lane_hash(x)) & m == want


@pytest.mark.parametrize(
    "dtype", [torch.bool, torch.uint8, torch.int32, torch.float16, torch.float32, torch.float64]
)
def test_lane_hash_of_other_dtypes_widens_values_and_float_bits(
    dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Integers and bools by value (widened to int64), floats by their bits (sign-extended from
    the same-size integer), also when the widening buffer holds several blocks."""
    from cpshard.sharding import consistency

    monkeypatch.setattr(consistency, "_BLOCK", 6)
    monkeypatch.setattr(consistency, "_CHUNK_BLOCKS_CPU", 2)
    g = torch.Generator().manual_seed(2)
    x = (torch.randn(3, 11, generator=g) * 50).to(dtype)
    bits = {torch.float16: torch.int16, torch.float32: torch.int32, torch.float64: torch.int64}
    values = (x.view(bits[dtype]) if dtype in bits else x).to(torch.long).reshape(-1).tolist()
    m = (1 << 64) - 1
    assert int(consistency._lane_hash(x)) & m == _reference_hash(values, 6)
    strided = x[:, ::2].contiguous().view(bits[dtype]) if dtype in bits else x[:, ::2]
    want = _reference_hash(strided.to(torch.long).reshape(-1).tolist(), 6)
    assert int(consistency._lane_hash(x[:, ::2])) & m == want


@pytest.mark.parametrize("per", [2, 3, 100])
def test_lane_hash_of_several_blocks_a_pass_equals_one_a_pass(
    per: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The value does not depend on how many blocks one pass takes (one on the CPU, 32 on an
    accelerator): the tiled keys and the per-block sums of a wide pass give the same hash,
    the last pass short or not."""
    from cpshard.sharding import consistency

    monkeypatch.setattr(consistency, "_BLOCK", 7)
    x = torch.randn(5, 7, 3)
    ids = torch.randint(0, 1000, (9, 31))
    one = [int(consistency._lane_hash(t)) for t in (x, ids, ids[:, :14])]
    monkeypatch.setattr(consistency, "_CHUNK_BLOCKS_CPU", per)
    scratch: dict = {}
    assert [int(consistency._lane_hash(t, scratch)) for t in (x, ids, ids[:, :14])] == one


@pytest.mark.parametrize("which", ["_host_hash", "_lane_hash"])
def test_content_hash_catches_swaps_compensations_shifts_and_sign_bits(
    which: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Changes a weighted or plain sum cannot see: swapped values (next to each other, across
    rows, across chunks), compensating +d / -d pairs, a row shifted by one, the top bit of an
    int64 and the sign of a float64 (its top bit): each changes the hash, the CPU's and the
    accelerator's (run here on the CPU)."""
    from cpshard.sharding import consistency

    hash_of = getattr(consistency, which)

    monkeypatch.setattr(consistency, "_BLOCK", 16)
    g = torch.Generator().manual_seed(4)
    ids = torch.randint(0, 32000, (4, 40), generator=g)
    h = int(hash_of(ids))
    changed = []
    swap = ids.clone()
    swap[0, [3, 4]] = swap[0, [4, 3]]
    changed.append(swap)
    rows = ids.clone()
    rows[[1, 2]] = rows[[2, 1]]
    changed.append(rows)
    far = ids.clone()  # positions 5 and 5 + 16: the same slot of two chunks
    far.view(-1)[[5, 21]] = far.view(-1)[[21, 5]]
    changed.append(far)
    for d in (1, 3, 1000):
        comp = ids.clone()
        comp[2, 7] += d
        comp[2, 30] -= d
        changed.append(comp)
        comp2 = ids.clone()
        comp2[0, 0] += d
        comp2[3, 39] -= d
        changed.append(comp2)
    changed.append(torch.roll(ids, 1, dims=1))
    top = ids.clone()
    top[1, 1] ^= -(2**63)
    changed.append(top)
    for _ in range(300):  # random swaps of two different values, random +d / -d pairs
        i, j = torch.randint(0, ids.numel(), (2,), generator=g).tolist()
        d = int(torch.randint(1, 1 << 20, (1,), generator=g))
        pair = ids.clone().view(-1)
        if i != j and pair[i] != pair[j]:
            pair[[i, j]] = pair[[j, i]]
            changed.append(pair.view_as(ids).clone())
            pair[[i, j]] = pair[[j, i]]
        if i != j:
            pair[i] += d
            pair[j] -= d
            changed.append(pair.view_as(ids))
    for c in changed:
        assert not torch.equal(c, ids)
        assert int(hash_of(c)) != h
    emb = torch.randn(2, 9, 3, dtype=torch.float64, generator=g)
    flipped = emb.clone()
    flipped[1, 4, 2] = -flipped[1, 4, 2]
    assert int(hash_of(flipped)) != int(hash_of(emb))
    zero = torch.zeros(5)
    negzero = zero.clone()
    negzero[2] = -0.0
    assert int(hash_of(negzero)) != int(hash_of(zero))


def test_host_hash_is_xxh3_of_the_canonical_bytes() -> None:
    """On the CPU: XXH3-64 of the row-major bytes, integers and bools widened to int64 (equal
    values hash alike whatever their integer dtype, strided or not), floats by their own bits;
    every element counts (each one changed in turn changes the hash)."""
    import xxhash

    from cpshard.sharding import consistency

    g = torch.Generator().manual_seed(5)
    ids = torch.randint(-(2**62), 2**62, (3, 7), generator=g)
    raw = xxhash.xxh3_64_intdigest(ids.numpy().tobytes())
    assert int(consistency._content_hash(ids)) & ((1 << 64) - 1) == raw
    small = torch.randint(0, 100, (4, 9), generator=g)
    want = int(consistency._content_hash(small))
    for dtype in (torch.int32, torch.int16, torch.uint8, torch.int8):
        assert int(consistency._content_hash(small.to(dtype))) == want, dtype
    mask = small > 50
    assert int(consistency._content_hash(mask)) == int(consistency._content_hash(mask.long()))
    assert int(consistency._content_hash(small.t())) == int(
        consistency._content_hash(small.t().contiguous())
    )
    for dtype in (torch.bfloat16, torch.float16, torch.float32, torch.float64):
        x = torch.randn(5, 3, generator=g).to(dtype)
        bits = {2: torch.int16, 4: torch.int32, 8: torch.int64}[x.element_size()]
        assert int(consistency._content_hash(x)) & ((1 << 64) - 1) == xxhash.xxh3_64_intdigest(
            x.view(bits).numpy().tobytes()
        )
    z = torch.randn(4, dtype=torch.complex64, generator=g)
    assert int(consistency._content_hash(z.conj())) == int(
        consistency._content_hash(z.conj().resolve_conj())
    )
    assert int(consistency._content_hash(z.conj())) != int(consistency._content_hash(z))
    for k in range(small.numel()):
        one = small.clone()
        one.view(-1)[k] += 1
        assert int(consistency._content_hash(one)) != want, k
    assert int(consistency._content_hash(torch.zeros(0, 3))) == 0


def test_fingerprint_of_sparse_quantized_and_nested_tensors_never_raises() -> None:
    """Tensors that are not plain strided ones are hashed by their parts (a sparse tensor's
    coalesced indices and values, a quantized one's integers and quantizer, a nested one's
    components): equal ones alike, a changed value, scale or component not; their layout is in
    the description. None of them raises (a rank raising alone before the exchange would leave
    the others waiting in it)."""

    def fp(value: object) -> torch.Tensor:
        batch = {"input_ids": torch.zeros(1, 4, dtype=torch.long), "x": value}
        return batch_fingerprint(batch, layout="auto", attention="auto", padding_token_id=0)

    eye = torch.eye(5)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # nested tensors are a prototype
        pairs = {
            "coo": (lambda: eye.to_sparse(), lambda: (eye * 3).to_sparse()),
            "csr": (lambda: eye.to_sparse_csr(), lambda: eye.flip(0).to_sparse_csr()),
            "per tensor": (
                lambda: torch.quantize_per_tensor(torch.arange(5.0), 0.5, 0, torch.quint8),
                lambda: torch.quantize_per_tensor(torch.arange(5.0), 0.25, 0, torch.quint8),
            ),
            "per channel": (
                lambda: torch.quantize_per_channel(
                    torch.ones(2, 3), torch.tensor([0.1, 0.2]), torch.tensor([0, 0]), 0,
                    torch.qint8,
                ),
                lambda: torch.quantize_per_channel(
                    torch.ones(2, 3), torch.tensor([0.1, 0.4]), torch.tensor([0, 0]), 0,
                    torch.qint8,
                ),
            ),
            "nested": (
                lambda: torch.nested.nested_tensor([torch.ones(2), torch.ones(3)]),
                lambda: torch.nested.nested_tensor([torch.ones(2), torch.ones(3) * 2]),
            ),
        }  # fmt: skip
        for name, (make, other) in pairs.items():
            assert torch.equal(fp(make()), fp(make())), name
            assert not torch.equal(fp(make()), fp(other())), name
        assert not torch.equal(fp(eye.to_sparse()), fp(eye))  # the layout is described


def test_fingerprint_of_every_dtype_never_raises() -> None:
    """Every dtype torch can hold a tensor of, the sub-byte and bits ones included (no conversion
    reaches them: their raw bytes are hashed), fingerprints without raising; raw bytes still
    tell values apart."""

    def fp(value: torch.Tensor) -> torch.Tensor:
        batch = {"input_ids": torch.zeros(1, 4, dtype=torch.long), "x": value}
        return batch_fingerprint(batch, layout="auto", attention="auto", padding_token_id=0)

    raw = torch.tensor([1, 2, 3, 4], dtype=torch.uint8)
    dtypes = {getattr(torch, n) for n in dir(torch) if isinstance(getattr(torch, n), torch.dtype)}
    tried = 0
    for dtype in sorted(dtypes, key=str):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # complex32 and quantized dtypes warn when made
            try:
                value = raw.view(dtype) if torch.empty(0, dtype=dtype).element_size() == 1 else None
                value = torch.zeros(4, dtype=dtype) if value is None else value
            except (RuntimeError, TypeError, NotImplementedError):
                continue  # no tensor of it can be made here
            fp(value)
        tried += 1
    assert tried >= 30
    assert not torch.equal(fp(raw.view(torch.bits8)), fp((raw + 1).view(torch.bits8)))
    assert torch.equal(fp(raw.view(torch.bits8)), fp(raw.clone().view(torch.bits8)))


def test_fingerprint_compares_a_cost_model_and_dataclass_entries_by_their_fields() -> None:
    """Two ``attention_cost`` models with other rates (or call shape) under ``"auto"`` could make
    the ranks choose different methods: they fingerprint apart, equal ones alike; a dataclass
    entry of the batch counts by its fields too."""
    from dataclasses import dataclass, replace

    from cpshard.attention.cost import CostModel

    ids = {"input_ids": torch.zeros(1, 4, dtype=torch.long)}

    def fp(batch: dict, cost: object) -> torch.Tensor:
        opts = {"attention_cost": cost}
        return batch_fingerprint(batch, layout="auto", attention="auto", padding_token_id=0,
                                 options=opts)  # fmt: skip

    base = fp(ids, CostModel())
    assert torch.equal(base, fp(ids, CostModel()))
    for other in (CostModel.cpu_gloo(), replace(CostModel(), link_bandwidth=5e10),
                  replace(CostModel(), q_heads=16), None):  # fmt: skip
        assert not torch.equal(base, fp(ids, other)), other

    @dataclass
    class Meta:
        step: int
        weights: torch.Tensor

    one = fp({**ids, "meta": Meta(3, torch.ones(2))}, None)
    assert torch.equal(one, fp({**ids, "meta": Meta(3, torch.ones(2))}, None))
    assert not torch.equal(one, fp({**ids, "meta": Meta(4, torch.ones(2))}, None))
    assert not torch.equal(one, fp({**ids, "meta": Meta(3, torch.zeros(2))}, None))


def test_fingerprint_catches_what_the_old_sample_and_linear_hash_missed() -> None:
    """Issue 17: float values outside a 4096-value sample, crafted collisions of a weighted sum,
    numpy / list / string entries: each changes the fingerprint."""
    from cpshard.sharding.consistency import _content_hash

    emb = torch.randn(2, 4096, 8, generator=torch.Generator().manual_seed(0))
    later = emb.clone()
    later[1, 4000, 5] += 1e-3  # one value of a late token row
    assert _differs({"inputs_embeds": emb}, {"inputs_embeds": later}) == {"inputs_embeds"}
    # the old hash was sum_k x_k (2k+1): +3 at k=0 and -1 at k=1 left it unchanged
    ids = torch.tensor([[10, 20, 30, 40]])
    crafted = ids.clone()
    crafted[0, 0] += 3
    crafted[0, 1] -= 1
    flat, flat2 = ids.reshape(-1), crafted.reshape(-1)
    w = torch.arange(4) * 2 + 1
    assert int((flat * w).sum()) == int((flat2 * w).sum())  # a collision of the old hash
    assert int(_content_hash(ids)) != int(_content_hash(crafted))
    assert _differs({"input_ids": ids}, {"input_ids": crafted}) == {"input_ids"}
    swapped = ids[:, [1, 0, 2, 3]]
    assert int(_content_hash(ids)) != int(_content_hash(swapped))
    # non-tensor entries, by content
    base = {"input_ids": ids, "note": "a", "rows": [1, 2], "arr": np.arange(4), "f": 0.5}
    for key, value in (
        ("note", "b"), ("rows", [2, 1]), ("arr", np.array([0, 1, 2, 4])), ("f", 0.25),
        ("arr", np.arange(4.0)), ("rows", [[1, 2], "x"]),
    ):  # fmt: skip
        assert _differs(base, {**base, key: value}), (key, value)
    assert not _differs(base, {**base, "arr": np.arange(4), "rows": [1, 2]})
    # the key's name counts: two extra keys cannot swap their values unnoticed
    two = {"input_ids": ids, "a": torch.ones(3), "b": torch.zeros(3)}
    assert _differs(two, {**two, "a": torch.zeros(3), "b": torch.ones(3)})


def test_fingerprint_of_lists_holding_tensors_never_overflows() -> None:
    """seq_lens as a list of per-row tensors (mixed Python ints and int64 tensors)."""
    lens = [torch.tensor([3, 5]), torch.tensor([8])]
    batch = {"input_ids": torch.ones(2, 8, dtype=torch.long), "seq_lens": lens, "x": [lens, "a"]}
    other = {**batch, "seq_lens": [torch.tensor([4, 4]), torch.tensor([8])]}
    assert _differs(batch, other) == {"seq_lens"}


def test_opted_out_fingerprint_reads_no_value_but_keeps_its_shape() -> None:
    ids = torch.tensor([[1, 2, 3]])
    a = _fp({"input_ids": ids}, hashed=False)
    b = _fp({"input_ids": ids + 1}, hashed=False)
    assert torch.equal(a, b)  # no content read
    assert not torch.equal(a, _fp({"input_ids": ids}))  # the flag itself is compared
    msg = mismatch_message(torch.stack([_fp({"input_ids": ids}), a]))
    assert msg is not None and "disagree on check_consistency" in msg and "[0]" in msg


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


def test_fingerprint_of_lists_mixing_tensors_and_large_ints() -> None:
    """A list entry holding tensors beside other items (e.g. per-document lengths as 0-d
    tensors) hashes without overflowing int64, the same way twice, and sees every item."""
    from cpshard.sharding.consistency import batch_fingerprint

    ids = torch.arange(12).reshape(1, 12)

    def fp(extra: object) -> torch.Tensor:
        batch = {"input_ids": ids, "extra": extra}
        return batch_fingerprint(batch, layout="packed", attention="ring", padding_token_id=0)

    mixed = [torch.tensor(5), 2**62, "doc", torch.tensor(7)]
    assert torch.equal(fp(mixed), fp(list(mixed)))
    assert not torch.equal(fp(mixed), fp([torch.tensor(5), 2**62, "doc", torch.tensor(8)]))
    assert not torch.equal(fp(mixed), fp([torch.tensor(5), 2**62 + 1, "doc", torch.tensor(7)]))


def test_batch_fingerprint_fits_the_step_header_payload() -> None:
    """The dispatcher sends the fingerprint in the step header's payload slots (one collective)."""
    from cpshard.guards.step import PAYLOAD_SIZE
    from cpshard.sharding.consistency import FIELDS, batch_fingerprint

    fp = batch_fingerprint({"input_ids": torch.ones(2, 8, dtype=torch.long)}, layout="auto",
                           attention="auto", padding_token_id=0)  # fmt: skip
    assert fp.shape == (len(FIELDS),) and len(FIELDS) <= PAYLOAD_SIZE


def test_an_entrys_value_hash_does_not_depend_on_the_entries_before_it() -> None:
    """The weight check compares each parameter / buffer's hash across the CP ranks (DTensor
    shards only between ranks holding the same shard). An uneven FSDP2 shard is empty or shorter
    on some ranks: the entries after it must hash alike there, or every rank raises falsely."""
    from cpshard.guards.step import model_fingerprint

    def module(first: int) -> torch.nn.Module:
        m = torch.nn.Module()
        m.a = torch.nn.Parameter(torch.ones(first))
        m.b = torch.nn.Parameter(torch.arange(200, dtype=torch.float32))
        m.register_buffer("c", torch.linspace(0, 1, 7))
        return m

    long, short = (model_fingerprint(module(n), read_values=True) for n in (100, 3))
    assert long.names == short.names == ["parameter a", "parameter b", "buffer c"]
    assert long.values[0] != short.values[0]
    assert torch.equal(long.values[1:], short.values[1:])


def test_model_fingerprint_values_over_mixed_dtypes_equal_the_per_entry_samples() -> None:
    """Samples are converted to float64 once per (device, dtype) group: each entry's value is
    still the sum over its own strided sample of its float64 bits times ``2 * place + 1``, for
    fp32, bf16, int64, bool and complex entries interleaved, a transposed parameter and a
    buffer at a storage offset (the sample of the values in flat order, wherever they lie)."""
    from cpshard.guards.step import PARAM_SAMPLE, model_fingerprint

    g = torch.Generator().manual_seed(3)
    m = torch.nn.Module()
    m.a = torch.nn.Parameter(torch.randn(3000, generator=g))
    m.b = torch.nn.Parameter(torch.randn(5, 7, generator=g).to(torch.bfloat16))
    m.register_buffer("c", torch.arange(40))
    m.register_buffer("d", torch.rand(9, generator=g) > 0.5)
    m.e = torch.nn.Parameter(torch.randn(2, 3, generator=g))
    m.register_buffer("f", torch.randn(4, dtype=torch.complex64, generator=g))
    m.t = torch.nn.Parameter(torch.randn(70, 50, generator=g).t())  # not contiguous
    m.register_buffer("o", torch.arange(1000.0)[300:900])  # contiguous, at a storage offset
    fp = model_fingerprint(m, read_values=True)
    entries = [("a", m.a), ("b", m.b), ("c", m.c), ("d", m.d), ("e", m.e), ("f", m.f)]
    for name, t in [*entries, ("t", m.t), ("o", m.o)]:
        flat = t.detach().reshape(-1)
        sample = flat[:: max(1, flat.numel() // PARAM_SAMPLE)][:PARAM_SAMPLE]
        if sample.is_complex():
            sample = torch.view_as_real(sample).reshape(-1)
        bits = sample.to(torch.float64).view(torch.int64)
        want = int((bits * (2 * torch.arange(bits.numel()) + 1)).sum())
        kind = "parameter" if isinstance(t, torch.nn.Parameter) else "buffer"
        assert int(fp.values[fp.names.index(f"{kind} {name}")]) == want, name


def test_fingerprint_of_per_row_seq_lens_sees_every_length_and_the_nesting() -> None:
    """Per-row seq_lens (lists of int lists) hash as one tensor: a changed length, a document
    moved to the next row, swapped rows, an empty row, and a flat list with the same encoding
    each change the seq_lens slot (the small ones their description too); huge ints fall back to
    the item-by-item digest."""
    from cpshard.sharding.consistency import _nested_ints

    nested = _nested_ints([[3, 5], [8]])
    assert nested is not None and nested.tolist() == [2, 2, 1, 3, 5, 8]  # the one-tensor path
    assert _nested_ints([[3, 5], [2**70]]) is None and _nested_ints([[3], "x"]) is None
    ids = torch.ones(2, 8, dtype=torch.long)
    base = {"input_ids": ids, "seq_lens": [[3, 5], [8]]}
    for other in (
        [[3, 5], [7, 1]],
        [[3], [5, 8]],
        [[8], [3, 5]],
        [[3, 5], [8], []],
        [2, 2, 1, 3, 5, 8],  # flat: the nested encoding's own values
        [[3, 5], [2**70]],
    ):
        assert "seq_lens" in _differs(base, {**base, "seq_lens": other}), other
    assert not _differs(base, {**base, "seq_lens": [[3, 5], [8]]})
    assert _differs(base, {**base, "seq_lens": ([3, 5], [8])})  # a tuple: its description
    assert not _differs({**base, "seq_lens": [[2**70]]}, {**base, "seq_lens": [[2**70]]})
    many = [[int(v) for v in torch.randint(1, 50, (500,))] for _ in range(8)]
    changed = [row[:] for row in many]
    changed[5][321] += 1
    changed[5][322] -= 1
    assert "seq_lens" in _differs({**base, "seq_lens": many}, {**base, "seq_lens": changed})


def test_model_entries_list_parameters_as_named_parameters_then_persistent_buffers() -> None:
    """The weights fingerprint's one walk lists what ``named_parameters()`` lists (a tied
    parameter once, at its first name; ``None`` skipped), then the persistent buffers (a shared
    one once, non-persistent ones left out)."""
    from cpshard.guards.step import _entries

    class _Block(nn.Module):
        def __init__(self, shared: nn.Linear) -> None:
            super().__init__()
            self.proj = nn.Linear(3, 3)
            self.shared = shared
            self.register_parameter("absent", None)
            self.register_buffer("steps", torch.zeros(2))
            self.register_buffer("cache", torch.zeros(2), persistent=False)

    shared = nn.Linear(3, 3)
    model = nn.Sequential(_Block(shared), _Block(shared), nn.Embedding(5, 3))
    model[2].weight = model[0].proj.weight  # tied
    model[1].register_buffer("steps_too", model[0].steps)  # one buffer under two names
    got = [(name, id(t), is_param) for name, t, is_param in _entries(model)]
    want = [(f"parameter {n}", id(p), True) for n, p in model.named_parameters()]
    persistent = {"steps", "steps_too"}
    seen: set[int] = set()
    for n, b in model.named_buffers(remove_duplicate=False):
        if n.rsplit(".", 1)[-1] in persistent and id(b) not in seen:
            seen.add(id(b))
            want.append((f"buffer {n}", id(b), False))
    assert got == want


def test_checkpointing_flag_reads_as_getattr_does() -> None:
    """The guard's read of ``gradient_checkpointing`` (no ``nn.Module.__getattr__`` miss path)
    answers as ``getattr(module, "gradient_checkpointing", False)``: an instance value, a class
    value, a wrapper whose own ``__getattr__`` forwards, and absent."""
    from cpshard.guards.model import _checkpointing_flag

    class _Cls(nn.Module):
        gradient_checkpointing = False

    on = _Cls()
    on.gradient_checkpointing = True
    answers: dict[type, bool] = {}  # one walk's answers per class, shared by its modules
    modules = (_Cls(), on, Forwarding(on), Forwarding(nn.Linear(2, 2)), nn.Linear(2, 2))
    for module in (*modules, *modules):
        want = getattr(module, "gradient_checkpointing", False)
        assert _checkpointing_flag(module, answers) is want, module
