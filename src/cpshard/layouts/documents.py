"""Packed batches: which tokens of a ``[B, S]`` batch belong to which document.

A *packed* batch holds several documents per row. :class:`PackSpec` records, per row, the
lengths of its documents in order, followed by the row's trailing padding::

    row 0   d0 d0 d0 d1 d1 .  .      doc_lens[0] = (3, 2), pad 2      (S = 7)
    row 1   d2 d2 d2 d2 d2 d2 d3     doc_lens[1] = (6, 1), pad 0

Documents are numbered row-major (``d0, d1`` in row 0, then ``d2, d3``): these are the *global
document ids* used by CP attention masks. Three spellings parse into a spec:

* :meth:`PackSpec.from_seq_lens`: per row, the document lengths; the rest of the row is padding.
* :meth:`PackSpec.from_cu_seqlens`: flash-attn / TransformerEngine offsets of one ``[1, T]``
  stream; must start at 0, increase strictly (no empty documents) and end at ``T`` exactly.
* :meth:`PackSpec.from_position_ids`: a document starts wherever the position does not
  continue the previous one by +1 (a restart at 0, a gap, a repeat), as transformers reads them.
  Padding is never inferred from token values (a pad id can be real content); pass an explicit
  ``padding_mask`` (``True`` = pad), which must mark a suffix of each row.

Documents have length ``>= 1``; a row may hold no document at all (all padding).

Owns :class:`PackSpec` (parsing and validating the document structure).

Import rules: the rows of ``RULES`` in tests/unit/test_architecture.py that cover this module.
"""

from __future__ import annotations

import itertools
import numbers
import operator
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

__all__ = ["PackSpec"]


def _fix(what: str, rule: str, value: object, fix: str) -> ValueError:
    return ValueError(f"{what}: {rule}; got {value}. Fix: {fix}")


def _is_scalar(n: object) -> bool:
    """A single number: Python / numpy scalars and 0-d tensors or arrays."""
    if isinstance(n, torch.Tensor | np.ndarray):
        return n.ndim == 0
    return isinstance(n, numbers.Number)


def _as_int(n: Any, what: str) -> int:
    """``n`` as an ``int``; a non-integral value (``2.5``) raises instead of truncating.

    ``bool`` (``True``), strings (``"8"``) and non-scalars are rejected: they are never lengths.
    """
    is_bool = isinstance(n, bool | np.bool_) or (
        isinstance(n, torch.Tensor | np.ndarray) and n.dtype in (torch.bool, np.bool_)
    )
    if is_bool or isinstance(n, str | bytes) or not _is_scalar(n):
        raise _fix(what, "must be integers (not bool, str or a nested sequence)", repr(n),
                   "pass int lengths / offsets, e.g. [3, 5]")  # fmt: skip
    try:
        return operator.index(n)  # ints, numpy ints, 0-d integer tensors
    except TypeError:
        value = float(n)
    if not value.is_integer():
        raise _fix(what, "must be whole numbers", n, "pass integer lengths / offsets")
    return int(value)


@dataclass(frozen=True)
class PackSpec:
    """Document structure of a packed ``[B, S]`` batch.

    Attributes:
        row_len: ``S``, the length of every row.
        doc_lens: Per row, the lengths (each ``>= 1``) of its documents in order. Row ``b`` holds
            ``sum(doc_lens[b]) <= S`` real tokens followed by ``S - sum(doc_lens[b])`` pads.
    """

    row_len: int
    doc_lens: tuple[tuple[int, ...], ...]

    def __post_init__(self) -> None:
        if self.row_len < 0:
            raise _fix("row_len", "must be >= 0", self.row_len, "pass the row length S")
        for b, row in enumerate(self.doc_lens):
            for n in row:
                if n < 0:
                    raise _fix(
                        f"document length in row {b}",
                        "must be >= 1 (negative lengths are not allowed)",
                        f"{n} in {list(row)}",
                        "drop sentinel entries such as -1000 before building the spec",
                    )
                if n == 0:
                    raise _fix(
                        f"document length in row {b}",
                        "must be >= 1 (empty documents are not allowed)",
                        f"0 in {list(row)}",
                        "drop empty documents",
                    )
            if sum(row) > self.row_len:
                raise _fix(
                    f"seq_lens of row {b}",
                    f"must sum to <= the row length S={self.row_len}",
                    f"{list(row)} (sum {sum(row)})",
                    f"split the documents over more rows or use rows of length >= {sum(row)}",
                )

    # ------------------------------------------------------------------ parsing
    @classmethod
    def from_seq_lens(
        cls, seq_lens: Sequence[Sequence[int]] | Sequence[int] | torch.Tensor, row_len: int
    ) -> PackSpec:
        """Spec from per-row document lengths.

        Args:
            seq_lens: One sequence of document lengths per row (or an int tensor ``[B, n]``
                without sentinels); a flat sequence of ints (or 1-D tensor) is one row.
                Row ``b`` must sum to ``<= row_len``.
            row_len: ``S``.

        Raises:
            ValueError: negative or zero lengths, or a row that does not fit in ``S``.
        """
        if isinstance(seq_lens, str | bytes) or _is_scalar(seq_lens):
            raise _fix(
                "seq_lens",
                "must be per-row sequences of document lengths (or an int tensor [B, n])",
                repr(seq_lens),
                "pass e.g. [[3, 5], [8]]",
            )
        if isinstance(seq_lens, torch.Tensor) and seq_lens.device.type == "meta":
            raise _fix("seq_lens", "must hold values", "a meta-device tensor", "pass real lengths")
        items: list[Any] = (
            seq_lens.tolist() if isinstance(seq_lens, torch.Tensor | np.ndarray) else list(seq_lens)
        )
        if items and all(_is_scalar(n) for n in items):  # a flat list: one row
            items = [items]
        rows = tuple(
            tuple(_as_int(n, f"seq_lens row {b}") for n in row) for b, row in enumerate(items)
        )
        return cls(int(row_len), rows)

    @classmethod
    def from_cu_seqlens(cls, cu_seqlens: torch.Tensor, total_len: int) -> PackSpec:
        """Spec of one ``[1, T]`` stream from document offsets.

        Args:
            cu_seqlens: Int tensor ``[D + 1]``: ``0 = cu[0] < cu[1] < ... < cu[D] = T``.
            total_len: ``T``, the stream length (``input_ids.shape[-1]``).

        Raises:
            ValueError: not 1-D, not starting at 0, not strictly increasing, or not ending at
                ``total_len``.
        """
        if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 1:
            raise _fix(
                "cu_seqlens",
                "must be a 1-D tensor [D + 1] of document offsets",
                f"shape {tuple(cu_seqlens.shape)}",
                "pass [0, len0, len0 + len1, ...]",
            )
        cu = [_as_int(v, "cu_seqlens") for v in cu_seqlens.tolist()]
        if cu[0] != 0:
            raise _fix("cu_seqlens", "must start at 0", cu[:4], "prepend 0")
        diffs = [b - a for a, b in itertools.pairwise(cu)]
        if any(d <= 0 for d in diffs):
            i = next(i for i, d in enumerate(diffs) if d <= 0)
            raise _fix(
                "cu_seqlens",
                "must be strictly increasing (every document has >= 1 token)",
                f"cu[{i}]={cu[i]} >= cu[{i + 1}]={cu[i + 1]}",
                "drop empty documents and sort the offsets",
            )
        if cu[-1] != total_len:
            raise _fix(
                "cu_seqlens",
                f"must end at the stream length T={total_len}",
                f"cu[-1]={cu[-1]}",
                "append the trailing padding as its own document or use from_seq_lens, "
                "which allows row-end padding",
            )
        return cls(int(total_len), (tuple(diffs),))

    @classmethod
    def from_position_ids(
        cls, position_ids: torch.Tensor, padding_mask: torch.Tensor | None = None
    ) -> PackSpec:
        """Spec from per-document positions: a document starts wherever the position does not
        continue the previous token's by +1.

        That is transformers' own reading of ``position_ids`` without an attention mask
        (``masking_utils.find_packed_sequence_indices``, used by its eager / sdpa / flex masks):
        a restart at 0 starts a document, and so does a gap (``0, 1, 2, 5, 6``) or a repeat
        (``0, 1, 1, 2``); the positions themselves stay the RoPE positions. So ``0, 1, 2, 0, 1``
        is two documents of 3 and 2 tokens, ``4, 5, 6`` one document.

        Args:
            position_ids: Int tensor ``[B, S]``.
            padding_mask: Bool tensor ``[B, S]`` (``True`` = pad) marking a suffix of each row,
                or ``None`` when there is no padding. Pads are never inferred from values.

        Raises:
            ValueError: wrong shapes, or pads that are not a row suffix.
        """
        if position_ids.dim() != 2:
            raise _fix(
                "position_ids",
                "must be [B, S]",
                f"shape {tuple(position_ids.shape)}",
                "unsqueeze(0) a 1-D stream",
            )
        pos = position_ids.long().cpu()
        n_rows, row_len = pos.shape
        if padding_mask is None:
            pad = torch.zeros_like(pos, dtype=torch.bool)
        else:
            if padding_mask.shape != position_ids.shape:
                raise _fix(
                    "padding_mask",
                    f"must match position_ids' shape {tuple(position_ids.shape)}",
                    f"shape {tuple(padding_mask.shape)}",
                    "pass a [B, S] bool mask (True = pad)",
                )
            pad = padding_mask.bool().cpu()
        n_real = (~pad).sum(dim=1)
        suffix = torch.arange(row_len).unsqueeze(0) >= n_real.unsqueeze(1)
        if not torch.equal(suffix, pad):
            b = int((suffix != pad).any(dim=1).nonzero()[0])
            raise _fix(
                f"padding_mask row {b}",
                "must mark a suffix of the row (padding after the last document)",
                pad[b].int().tolist()[:32],
                "move padding to the row end or split the row",
            )
        start = torch.ones_like(pad)
        start[:, 1:] = pos[:, 1:] != pos[:, :-1] + 1
        rows = []
        for b in range(n_rows):
            n = int(n_real[b])
            starts = [*start[b, :n].nonzero().flatten().tolist(), n]
            rows.append(tuple(e - s for s, e in itertools.pairwise(starts)))
        return cls(int(row_len), tuple(rows))

    @classmethod
    def from_documents(
        cls,
        row_shape: tuple[int, int],
        *,
        spec: PackSpec | None = None,
        seq_lens: Sequence[Sequence[int]] | Sequence[int] | torch.Tensor | None = None,
        cu_seqlens: Sequence[int] | torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        padding_mask: torch.Tensor | None = None,
    ) -> PackSpec:
        """The spec of a ``[B, S]`` batch from whichever spelling the caller holds.

        The same spellings a packed batch accepts (``seq_lens``, ``cu_seqlens`` or
        ``position_ids``), or a ready :class:`PackSpec`; exactly one of them.

        Args:
            row_shape: ``(B, S)`` of the batch the documents describe.
            spec: A :class:`PackSpec` (checked against ``row_shape``).
            seq_lens: Per-row document lengths (lists or an int tensor ``[B, n]``; a flat list
                is one row); the rest of each row is padding.
            cu_seqlens: Offsets ``[D + 1]`` (list or tensor) of one ``[1, T]`` stream.
            position_ids: ``[B, S]`` positions; documents start where they do not step by +1.
            padding_mask: With ``position_ids`` only: ``[B, S]`` bool, ``True`` = pad (suffix).

        Raises:
            ValueError: not exactly one spelling, a spelling that does not fit ``row_shape``,
                or invalid lengths / offsets / positions.
        """
        given = {
            "spec": spec,
            "seq_lens": seq_lens,
            "cu_seqlens": cu_seqlens,
            "position_ids": position_ids,
        }
        named = [k for k, v in given.items() if v is not None]
        if len(named) != 1:
            raise _fix(
                "documents",
                "give exactly one of a PackSpec, seq_lens, cu_seqlens or position_ids",
                named or "none",
                "pass e.g. seq_lens=[[3, 5], [8]] (per row) or cu_seqlens=[0, 3, 8]",
            )
        if padding_mask is not None and position_ids is None:
            raise _fix(
                "padding_mask",
                "is read only with position_ids (seq_lens / cu_seqlens imply the padding)",
                "a padding_mask with " + named[0],
                "drop padding_mask, or pass position_ids",
            )
        bsz, seq_len = row_shape
        if spec is not None:
            if not isinstance(spec, PackSpec):
                raise _fix("spec", "must be a PackSpec", type(spec).__name__, "pass seq_lens=")
            out = spec
        elif seq_lens is not None:
            items = seq_lens.tolist() if isinstance(seq_lens, torch.Tensor) else seq_lens
            flat = isinstance(items, Sequence) and not isinstance(items, str | bytes)
            if flat and len(items) > 1 and all(_is_scalar(n) for n in items) and items[0] == 0:
                raise _fix(
                    "seq_lens",
                    "are document lengths (each >= 1); a list starting at 0 looks like offsets",
                    list(items)[:8],
                    "pass offsets as cu_seqlens=..., or the lengths themselves",
                )
            out = cls.from_seq_lens(seq_lens, seq_len)
        elif cu_seqlens is not None:
            if bsz != 1:
                raise _fix(
                    "cu_seqlens",
                    "describes one [1, T] stream",
                    f"a batch of B={bsz} rows",
                    "flatten the rows to [1, B*S] or pass seq_lens per row",
                )
            out = cls.from_cu_seqlens(torch.as_tensor(cu_seqlens), seq_len)
        else:
            assert position_ids is not None
            out = cls.from_position_ids(position_ids, padding_mask)
        if (out.num_rows, out.row_len) != (bsz, seq_len):
            raise _fix(
                named[0],
                f"must describe the batch's [B, S] = [{bsz}, {seq_len}]",
                f"{out.num_rows} rows of length {out.row_len}",
                "give one entry per row of the unsharded batch",
            )
        return out

    # ------------------------------------------------------------------ derived facts
    @property
    def num_rows(self) -> int:
        """``B``."""
        return len(self.doc_lens)

    @property
    def num_docs(self) -> int:
        """Number of documents ``D`` over all rows."""
        return sum(len(row) for row in self.doc_lens)

    @property
    def real_tokens(self) -> int:
        """Number of non-pad tokens."""
        return sum(sum(row) for row in self.doc_lens)

    @property
    def row_pad(self) -> tuple[int, ...]:
        """Trailing pads per row: ``S - sum(doc_lens[b])``."""
        return tuple(self.row_len - sum(row) for row in self.doc_lens)

    def lengths(self) -> torch.Tensor:
        """LongTensor ``[D]``: document lengths, global document order (row-major)."""
        return torch.tensor([n for row in self.doc_lens for n in row], dtype=torch.long)

    def _segments(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Row-major segments: documents and each row's pad; (lengths, doc id or -1)."""
        lens: list[int] = []
        ids: list[int] = []
        d = 0
        for row, pad in zip(self.doc_lens, self.row_pad, strict=True):
            for n in row:
                lens.append(n)
                ids.append(d)
                d += 1
            if pad:
                lens.append(pad)
                ids.append(-1)
        return torch.tensor(lens, dtype=torch.long), torch.tensor(ids, dtype=torch.long)

    def document_ids(self) -> torch.Tensor:
        """LongTensor ``[B, S]``: global document id of each token, ``-1`` for pads."""
        lens, ids = self._segments()
        return torch.repeat_interleave(ids, lens).view(self.num_rows, self.row_len)

    def position_ids(self) -> torch.Tensor:
        """LongTensor ``[B, S]``: position inside the document; a row's pads continue its last
        document (or count from 0 in an all-pad row)."""
        lens, ids = self._segments()
        starts = torch.cumsum(lens, 0) - lens
        # a pad segment continues the previous segment of the same row
        cont = (ids < 0) & (starts % max(self.row_len, 1) != 0)
        prev_len = torch.cat([torch.zeros(1, dtype=torch.long), lens[:-1]])
        starts = torch.where(cont, starts - prev_len, starts)
        total = self.num_rows * self.row_len
        flat = torch.arange(total) - torch.repeat_interleave(starts, lens)
        return flat.view(self.num_rows, self.row_len)

    def padding_mask(self) -> torch.Tensor:
        """BoolTensor ``[B, S]``: ``True`` = pad."""
        return self.document_ids() < 0

    def cu_seqlens(self, dtype: torch.dtype = torch.int32) -> torch.Tensor:
        """Tensor ``[D + 1]``: offsets of the documents in the pad-free stream."""
        lens = self.lengths()
        return torch.cat([torch.zeros(1, dtype=torch.long), torch.cumsum(lens, 0)]).to(dtype)
