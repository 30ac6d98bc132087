"""PackSpec parsing, derived per-token facts, and document-aware label shifting."""

from __future__ import annotations

import random

import pytest
import torch

from cpshard.layouts.documents import PackSpec
from cpshard.sharding.labels import shift_labels_packed


def random_spec(rng: random.Random, rows: int, row_len: int) -> PackSpec:
    """Random rows: documents of 1..row_len tokens (many 1-token ones), some rows padded."""
    out = []
    for _ in range(rows):
        left = row_len - rng.choice([0, 0, rng.randint(0, row_len)])
        row = []
        while left > 0:
            n = min(left, rng.choice([1, 1, 2, rng.randint(1, row_len)]))
            row.append(n)
            left -= n
        out.append(row)
    return PackSpec.from_seq_lens(out, row_len)


def test_seq_lens_derived_facts() -> None:
    spec = PackSpec.from_seq_lens([[3, 2], [6, 1]], 7)
    assert spec.num_rows == 2
    assert spec.num_docs == 4
    assert spec.real_tokens == 12
    assert spec.row_pad == (2, 0)
    assert spec.document_ids().tolist() == [[0, 0, 0, 1, 1, -1, -1], [2, 2, 2, 2, 2, 2, 3]]
    assert spec.position_ids().tolist() == [[0, 1, 2, 0, 1, 2, 3], [0, 1, 2, 3, 4, 5, 0]]
    assert spec.padding_mask().tolist()[0] == [False] * 5 + [True] * 2
    assert spec.cu_seqlens().tolist() == [0, 3, 5, 11, 12]
    assert spec.cu_seqlens().dtype == torch.int32


def test_all_pad_row_and_tensor_input() -> None:
    spec = PackSpec.from_seq_lens([[2, 2], []], 4)
    assert spec.document_ids().tolist() == [[0, 0, 1, 1], [-1, -1, -1, -1]]
    assert spec.position_ids()[1].tolist() == [0, 1, 2, 3]
    assert PackSpec.from_seq_lens(torch.tensor([[1, 3], [2, 2]]), 4).doc_lens == ((1, 3), (2, 2))
    assert PackSpec.from_seq_lens([1, 3], 5).doc_lens == ((1, 3),)  # flat: one row
    assert PackSpec.from_seq_lens(torch.tensor([2, 2]), 4).doc_lens == ((2, 2),)


def test_cu_seqlens() -> None:
    spec = PackSpec.from_cu_seqlens(torch.tensor([0, 4, 12], dtype=torch.int32), 12)
    assert spec.doc_lens == ((4, 8),)
    assert spec.row_len == 12


@pytest.mark.parametrize(
    ("cu", "total", "match"),
    [
        ([1, 4, 12], 12, r"cu_seqlens: must start at 0; got \[1, 4, 12\]"),
        ([0, 4, 4, 12], 12, r"strictly increasing.*cu\[1\]=4 >= cu\[2\]=4"),
        ([0, 6, 4, 12], 12, r"strictly increasing.*cu\[1\]=6 >= cu\[2\]=4"),
        ([0, 4, 10], 12, r"must end at the stream length T=12; got cu\[-1\]=10"),
        ([0, 4, 14], 12, r"must end at the stream length T=12; got cu\[-1\]=14"),
    ],
)
def test_cu_seqlens_errors(cu: list[int], total: int, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        PackSpec.from_cu_seqlens(torch.tensor(cu), total)


def test_cu_seqlens_must_be_1d() -> None:
    with pytest.raises(ValueError, match=r"must be a 1-D tensor"):
        PackSpec.from_cu_seqlens(torch.tensor([[0, 4]]), 4)


@pytest.mark.parametrize(
    ("seq_lens", "row_len", "match"),
    [
        ([[3, -2]], 8, r"must be >= 1 \(negative lengths.*-2 in \[3, -2\].*Fix: drop sentinel"),
        ([[3, 0]], 8, r"empty documents are not allowed"),
        ([[3, 4], [5, 4]], 8, r"seq_lens of row 1: must sum to <= the row length S=8.*sum 9"),
        ([[1]], -1, r"row_len: must be >= 0"),
    ],
)
def test_seq_lens_errors(seq_lens: list[list[int]], row_len: int, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        PackSpec.from_seq_lens(seq_lens, row_len)


def test_position_ids_with_padding_mask() -> None:
    pos = torch.tensor([[0, 1, 2, 0, 1, 9, 9], [0, 0, 1, 2, 3, 4, 5]])
    pad = torch.tensor([[0, 0, 0, 0, 0, 1, 1], [0] * 7], dtype=torch.bool)
    assert PackSpec.from_position_ids(pos, pad).doc_lens == ((3, 2), (1, 6))
    # without a mask every token is real: the jump to 9 and the repeated 9 start documents
    assert PackSpec.from_position_ids(pos).doc_lens == ((3, 2, 1, 1), (1, 6))


@pytest.mark.parametrize(
    ("pos", "lens"),
    [
        ([[1, 2, 3]], ((3,),)),  # one document whose positions start at 1
        ([[0, 1, 3, 4]], ((2, 2),)),  # a gap
        ([[0, 1, 1, 2]], ((2, 2),)),  # a repeat
        ([[3, 4, 0, 1, 2]], ((2, 3),)),  # a 0 mid-row
        ([[2, 0, 0, 5]], ((1, 1, 1, 1),)),
    ],
)
def test_position_ids_start_a_document_at_every_step_but_plus_one(
    pos: list[list[int]], lens: tuple[tuple[int, ...], ...]
) -> None:
    assert PackSpec.from_position_ids(torch.tensor(pos)).doc_lens == lens


def test_position_ids_read_as_transformers_reads_them() -> None:
    """Random rows (gaps, repeats, restarts at 0 anywhere, arbitrary values): the documents are
    the sequences transformers' masks find (``find_packed_sequence_indices``), no refusal."""
    masking_utils = pytest.importorskip("transformers.masking_utils")
    gen = torch.Generator().manual_seed(0)
    for _ in range(400):
        rows, seq = (
            int(torch.randint(1, 4, (1,), generator=gen)),
            int(torch.randint(1, 12, (1,), generator=gen)),
        )
        steps = torch.randint(-3, 4, (rows, seq), generator=gen)
        steps[torch.rand(rows, seq, generator=gen) < 0.6] = 1  # mostly runs of +1
        pos = (steps.cumsum(1) + torch.randint(0, 5, (rows, 1), generator=gen)).clamp(min=0)
        pos[torch.rand(rows, seq, generator=gen) < 0.1] = 0  # restarts at 0, mid-row too
        hf = masking_utils.find_packed_sequence_indices(pos)
        hf = torch.zeros_like(pos) if hf is None else hf
        doc = PackSpec.from_position_ids(pos).document_ids()
        first = doc - doc[:, :1]  # per-row document index, as transformers numbers them
        assert torch.equal(first, hf), pos


@pytest.mark.parametrize(
    ("pos", "pad", "match"),
    [
        ([[0, 1, 2]], [[1, 0, 0]], r"padding_mask row 0: must mark a suffix"),
        ([[0, 1, 2]], [[0, 0]], r"must match position_ids' shape"),
        ([0, 1, 2], None, r"position_ids: must be \[B, S\]"),
    ],
)
def test_position_ids_errors(pos: list[list[int]], pad: list[list[int]] | None, match: str) -> None:
    mask = None if pad is None else torch.tensor(pad, dtype=torch.bool)
    with pytest.raises(ValueError, match=match):
        PackSpec.from_position_ids(torch.tensor(pos), mask)


@pytest.mark.parametrize("seed", range(6))
def test_spellings_agree(seed: int) -> None:
    rng = random.Random(seed)
    spec = random_spec(rng, rows=rng.randint(1, 4), row_len=rng.randint(1, 40))
    back = PackSpec.from_position_ids(spec.position_ids(), spec.padding_mask())
    assert back == spec
    ids = spec.document_ids()
    for b, row in enumerate(spec.doc_lens):
        assert [int((ids[b] == d).sum()) for d in ids[b].unique().tolist() if d >= 0] == list(row)
    one_row = PackSpec.from_seq_lens([spec.lengths().tolist()], spec.real_tokens)
    assert PackSpec.from_cu_seqlens(one_row.cu_seqlens(), spec.real_tokens) == one_row


def test_shift_labels_example() -> None:
    spec = PackSpec.from_seq_lens([[3, 2, 1], [4]], 7)
    ids = torch.arange(14).view(2, 7)
    out = shift_labels_packed(ids, spec)
    assert out.tolist() == [
        [1, 2, -100, 4, -100, -100, -100],
        [8, 9, 10, -100, -100, -100, -100],
    ]
    assert ids.tolist()[0] == list(range(7))  # not modified


@pytest.mark.parametrize("seed", range(4))
def test_shift_labels_matches_a_per_document_loop(seed: int) -> None:
    rng = random.Random(seed)
    spec = random_spec(rng, rows=3, row_len=17)
    labels = torch.randint(0, 50, (3, 17))
    expect = torch.full_like(labels, -7)
    for b, row in enumerate(spec.doc_lens):
        start = 0
        for n in row:
            expect[b, start : start + n - 1] = labels[b, start + 1 : start + n]
            start += n
    assert torch.equal(shift_labels_packed(labels, spec, ignore_index=-7), expect)


def test_shift_labels_shape_error() -> None:
    spec = PackSpec.from_seq_lens([[3]], 4)
    with pytest.raises(ValueError, match=r"labels: must be \[B, S\] = \[1, 4\]"):
        shift_labels_packed(torch.zeros(1, 5), spec)


def test_seq_lens_spellings_numpy_and_tensor_items() -> None:
    import numpy as np

    want = ((3, 5),)
    assert PackSpec.from_seq_lens([np.int64(3), np.int64(5)], 8).doc_lens == want
    assert PackSpec.from_seq_lens([torch.tensor(3), torch.tensor(5)], 8).doc_lens == want
    assert PackSpec.from_seq_lens(np.array([3, 5]), 8).doc_lens == want
    assert PackSpec.from_seq_lens([torch.tensor([3, 5]), [2]], 8).doc_lens == (*want, (2,))
    assert PackSpec.from_seq_lens(torch.tensor([[3.0, 5.0]]), 8).doc_lens == want


def test_fractional_lengths_raise_instead_of_truncating() -> None:
    with pytest.raises(ValueError, match=r"seq_lens row 0: must be whole numbers; got 2.5"):
        PackSpec.from_seq_lens([[2.5, 3]], 8)  # type: ignore[list-item]
    with pytest.raises(ValueError, match=r"cu_seqlens: must be whole numbers; got 4.5"):
        PackSpec.from_cu_seqlens(torch.tensor([0.0, 4.5, 8.0]), 8)


def test_shift_labels_takes_the_documents_as_the_batch_does() -> None:
    """seq_lens (lists, flat list, tensor), cu_seqlens (list, int32 tensor) and restarting
    position_ids give the same labels as the PackSpec they describe."""
    ids = torch.arange(20).view(2, 10) + 5
    spec = PackSpec.from_seq_lens([[3, 5], [10]], 10)
    want = shift_labels_packed(ids, spec)
    assert torch.equal(shift_labels_packed(ids, [[3, 5], [10]]), want)
    assert torch.equal(shift_labels_packed(ids, seq_lens=[[3, 5], [10]]), want)
    assert torch.equal(shift_labels_packed(ids, seq_lens=spec.doc_lens), want)
    assert torch.equal(shift_labels_packed(ids, position_ids=spec.position_ids(),
                                           padding_mask=spec.padding_mask()), want)  # fmt: skip
    one = ids[:1]
    want1 = shift_labels_packed(one, PackSpec.from_seq_lens([[4, 6]], 10))
    assert want1.tolist() == [[6, 7, 8, -100, 10, 11, 12, 13, 14, -100]]
    for docs in ([4, 6], [[4, 6]], torch.tensor([4, 6]), torch.tensor([[4, 6]])):
        assert torch.equal(shift_labels_packed(one, docs), want1)
    for cu in ([0, 4, 10], torch.tensor([0, 4, 10], dtype=torch.int32)):
        assert torch.equal(shift_labels_packed(one, cu_seqlens=cu), want1)
    assert torch.equal(shift_labels_packed(one, ignore_index=-1, seq_lens=[4, 6]),
                       want1.masked_fill(want1 == -100, -1))  # fmt: skip


def test_shift_labels_bad_documents_say_what_and_how_to_fix() -> None:
    ids = torch.zeros(2, 10, dtype=torch.long)
    with pytest.raises(ValueError, match="exactly one of a PackSpec, seq_lens, cu_seqlens"):
        shift_labels_packed(ids)
    with pytest.raises(ValueError, match="exactly one"):
        shift_labels_packed(ids[:1], [4, 6], cu_seqlens=[0, 4, 10])
    with pytest.raises(ValueError, match="seq_lens given twice"):
        shift_labels_packed(ids, [[4], [6]], seq_lens=[[4], [6]])
    with pytest.raises(ValueError, match="looks like offsets.*cu_seqlens="):
        shift_labels_packed(ids[:1], [0, 4, 10])
    with pytest.raises(ValueError, match=r"cu_seqlens: describes one \[1, T\] stream.*B=2"):
        shift_labels_packed(ids, cu_seqlens=[0, 4, 10])
    with pytest.raises(ValueError, match=r"must describe the batch's \[B, S\] = \[2, 10\]"):
        shift_labels_packed(ids, [[4, 6]])  # one row for a batch of two
    with pytest.raises(ValueError, match="must sum to <= the row length S=10"):
        shift_labels_packed(ids, [[4, 7], [1]])
    with pytest.raises(ValueError, match="must end at the stream length T=10"):
        shift_labels_packed(ids[:1], cu_seqlens=[0, 4, 9])
    with pytest.raises(ValueError, match="padding_mask: is read only with position_ids"):
        shift_labels_packed(ids, [[4], [6]], padding_mask=torch.zeros(2, 10, dtype=torch.bool))
    with pytest.raises(ValueError, match=r"labels: must be \[B, S\]"):
        shift_labels_packed(ids[0], [4, 6])
