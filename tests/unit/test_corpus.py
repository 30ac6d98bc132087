"""The shipped corpus: real documents, deterministic batches, consistent labels."""

from __future__ import annotations

import pytest
import torch

from cpshard.tools.corpus import PAD_ID, VOCAB_SIZE, dense_batch, document_lengths, packed_batch


def test_corpus_is_the_cpython_topics() -> None:
    lens = document_lengths()
    assert len(lens) >= 70
    assert min(lens) >= 150 and max(lens) >= 30_000


def test_dense_batch_is_deterministic_and_labels_are_next_tokens() -> None:
    a, b = dense_batch(3, 64, seed=5), dense_batch(3, 64, seed=5)
    assert all(torch.equal(a[k], b[k]) for k in a)
    ids, mask, labels = a["input_ids"], a["attention_mask"], a["labels"]
    assert int(ids.max()) < VOCAB_SIZE
    assert bool((ids[mask == 0] == PAD_ID).all())
    real_next = mask[:, 1:].bool()
    assert torch.equal(labels[:, :-1][real_next], ids[:, 1:][real_next])
    assert bool((labels[:, :-1][~real_next] == -100).all())
    assert bool((labels[:, -1] == -100).all())
    assert not torch.equal(dense_batch(3, 64, seed=6)["input_ids"], ids)


def test_packed_batch_lengths_fit_the_row() -> None:
    ids, lens = packed_batch(2048, max_doc_len=300, seed=1)
    assert ids.shape == (1, 2048)
    assert sum(lens) <= 2048 and max(lens) <= 300 and min(lens) >= 2
    assert bool((ids[0, sum(lens) :] == PAD_ID).all())


def test_bad_sizes() -> None:
    with pytest.raises(ValueError, match="seq_len >= 2"):
        dense_batch(1, 1)
