"""The pad id rule: ``padding_token_id`` is a usable token id, never silently invented.

CP pads every sequence to a length the layout can split, and the pad slots of ``input_ids`` need
a token id. Any valid id works (pad slots are masked out of attention and get label ``-100``), but
``None`` (what Llama tokenizers give as ``pad_token_id``), a negative or an out-of-vocabulary id
would fail only on the ranks that hold pad slots, leaving the others in a collective.

Import rules: the rows of ``RULES`` in tests/unit/test_architecture.py that cover this module.
"""

from __future__ import annotations

from collections.abc import Mapping

from torch import nn

__all__ = ["check_padding_token_id", "model_vocab_size"]


def check_padding_token_id(
    padding_token_id: object, batch: object, vocab_size: int | None = None
) -> None:
    """Raise unless ``padding_token_id`` is a usable pad id for ``input_ids``.

    Rule: a non-negative ``int`` (``bool`` is not an int here), below the model's vocabulary size
    when it is known. Any valid id works: CP pad slots are masked out of attention and carry label
    ``-100``. ``None`` is accepted only for batches without ``input_ids`` (``inputs_embeds``).

    Raises:
        ValueError: ``None`` with ``input_ids``, a negative, non-integer or out-of-vocabulary id.
    """
    has_ids = isinstance(batch, Mapping) and batch.get("input_ids") is not None
    if padding_token_id is None:
        if not has_ids:
            return
        raise ValueError(
            "padding_token_id=None, but the batch has input_ids and CP padding needs a token id "
            "for the pad slots (they are masked out of attention and get label -100, so any "
            "valid id works); pass tokenizer.pad_token_id, or tokenizer.eos_token_id when the "
            "tokenizer has no pad token (e.g. Llama)"
        )
    if isinstance(padding_token_id, bool) or not isinstance(padding_token_id, int):
        raise ValueError(
            f"padding_token_id must be a non-negative int, got {padding_token_id!r} "
            f"({type(padding_token_id).__name__}); pass int(tokenizer.pad_token_id)"
        )
    if padding_token_id < 0:
        raise ValueError(
            f"padding_token_id must be a non-negative token id, got {padding_token_id}; pass "
            "tokenizer.pad_token_id or tokenizer.eos_token_id"
        )
    if vocab_size is not None and padding_token_id >= vocab_size:
        raise ValueError(
            f"padding_token_id={padding_token_id} is outside the model's vocabulary of "
            f"{vocab_size} ids (the embedding would fail on the ranks that hold pad slots); "
            "pass tokenizer.pad_token_id or tokenizer.eos_token_id"
        )


def model_vocab_size(model: nn.Module) -> int | None:
    """The model's input vocabulary size when it is known (``config`` / ``cfg`` or embedding)."""
    for name in ("config", "cfg"):
        size = getattr(getattr(model, name, None), "vocab_size", None)
        if isinstance(size, int) and not isinstance(size, bool):
            return size
    getter = getattr(model, "get_input_embeddings", None)
    emb = getter() if callable(getter) else None
    if isinstance(emb, nn.Embedding):
        return int(emb.num_embeddings)
    return None
