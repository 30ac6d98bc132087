"""Real text without downloads: CPython's documentation topics as byte-level tokens.

``pydoc_data.topics`` ships with CPython: 79 documents, about 466 KB of English, 202 B to 62 KB
each. Tokens are bytes (0-255) plus three specials, so any tiny model with ``vocab_size >= 259``
can train on it.

Import rules: the rows of ``RULES`` in tests/unit/test_architecture.py that cover this module.
"""

from __future__ import annotations

import torch

__all__ = [
    "BOS_ID",
    "EOS_ID",
    "PAD_ID",
    "VOCAB_SIZE",
    "dense_batch",
    "document_lengths",
    "documents",
    "packed_batch",
]

PAD_ID = 256
BOS_ID = 257
EOS_ID = 258
VOCAB_SIZE = 259


def documents() -> list[bytes]:
    """The corpus documents as UTF-8 bytes, in a fixed (sorted-by-title) order."""
    from pydoc_data.topics import topics

    return [topics[k].encode() for k in sorted(topics)]


def document_lengths() -> list[int]:
    """Byte length of every corpus document (the corpus's real document-length distribution)."""
    return [len(d) for d in documents()]


def _tokens(doc: bytes) -> torch.Tensor:
    body = torch.frombuffer(bytearray(doc), dtype=torch.uint8).long()
    return torch.cat([torch.tensor([BOS_ID]), body, torch.tensor([EOS_ID])])


def dense_batch(batch_size: int, seq_len: int, *, seed: int = 0) -> dict[str, torch.Tensor]:
    """Rows of one document each (a random window), right-padded to ``seq_len``.

    Args:
        batch_size: Rows ``B``.
        seq_len: Row length ``S``; a row holds between ``S // 2`` and ``S`` real tokens.
        seed: Sampling seed (the same seed gives the same batch on every rank).

    Returns:
        ``input_ids`` ``[B, S]`` (pads = :data:`PAD_ID`), ``attention_mask`` ``[B, S]`` (1 = real)
        and ``labels`` ``[B, S]`` (next token, ``-100`` on the last real token and pads).
    """
    if batch_size < 1 or seq_len < 2:
        raise ValueError(
            f"need batch_size >= 1 and seq_len >= 2, got batch_size={batch_size}, seq_len={seq_len}"
        )
    gen = torch.Generator().manual_seed(seed)
    docs = documents()
    ids = torch.full((batch_size, seq_len), PAD_ID, dtype=torch.long)
    mask = torch.zeros(batch_size, seq_len, dtype=torch.long)
    for b in range(batch_size):
        toks = _tokens(docs[int(torch.randint(len(docs), (1,), generator=gen))])
        n = min(len(toks), int(torch.randint(seq_len // 2, seq_len + 1, (1,), generator=gen)))
        start = int(torch.randint(0, len(toks) - n + 1, (1,), generator=gen))
        ids[b, :n] = toks[start : start + n]
        mask[b, :n] = 1
    labels = torch.full_like(ids, -100)
    labels[:, :-1] = torch.where(mask[:, 1:].bool(), ids[:, 1:], -100)
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def packed_batch(
    total_tokens: int, *, max_doc_len: int | None = None, seed: int = 0
) -> tuple[torch.Tensor, list[int]]:
    """One ``[1, T]`` row packing whole corpus documents (cut to ``max_doc_len``), end-padded.

    Args:
        total_tokens: Row length ``T``.
        max_doc_len: Cut longer documents (random window) to this many tokens.
        seed: Sampling seed.

    Returns:
        ``(input_ids [1, T], seq_lens)``: the document lengths in order; ``T - sum(seq_lens)``
        trailing slots are :data:`PAD_ID`.
    """
    gen = torch.Generator().manual_seed(seed)
    docs = documents()
    pieces: list[torch.Tensor] = []
    used = 0
    while used < total_tokens:
        toks = _tokens(docs[int(torch.randint(len(docs), (1,), generator=gen))])
        cap = min(len(toks), max_doc_len or len(toks), total_tokens - used)
        start = int(torch.randint(0, len(toks) - cap + 1, (1,), generator=gen))
        pieces.append(toks[start : start + cap])
        used += cap
        if cap < 2:  # keep a little tail padding rather than 1-token scraps
            pieces.pop()
            break
    ids = torch.full((1, total_tokens), PAD_ID, dtype=torch.long)
    flat = torch.cat(pieces) if pieces else torch.empty(0, dtype=torch.long)
    ids[0, : flat.numel()] = flat
    return ids, [int(p.numel()) for p in pieces]
