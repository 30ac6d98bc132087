"""Batch conventions and ``shard_batch`` for ordinary ``[B, S]`` batches.

Pad table (CP padding appended at the end of every row):

=================  ====================================================
key                pad value
=================  ====================================================
``input_ids``      ``padding_token_id``
``inputs_embeds``  ``0``
``labels``         ``-100``
``loss_mask``      ``0``
``padding_mask``   ``True`` (``True`` = pad)
``position_ids``   continued (``last + 1, last + 2, ...``), so RoPE stays global
extra keys         the caller's pad value (:class:`TokenKey`)
=================  ====================================================

``attention_mask`` (2-D ``[B, S]`` with 1 = keep, or 4-D ``[B, 1|H, S, S]``, bool or additive)
becomes ``padding_mask``. Non-token keys pass through untouched (the same objects). Nothing of the
caller's is mutated, and no sharded tensor shares memory with the caller's (at ``cp=1`` too):
every sharded tensor is a new tensor made by ``torch.cat`` of the layout's contiguous runs
(:func:`take_runs`), ``index_select`` or ``clone`` (all differentiable, so ``inputs_embeds``
that require grad pass gradients back).

Owns the pad table and the dense ``shard_batch``; it returns the shard's facts and no context
(the dispatcher adds CP attention).

Import rules: the rows of ``RULES`` in tests/unit/test_architecture.py that cover this module.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping
from typing import Any, NamedTuple

import torch
from torch.distributed.device_mesh import DeviceMesh

from cpshard import _comm
from cpshard.layouts.closed_form import ClosedFormLayout
from cpshard.sharding.facts import CPContext, ShardFacts

__all__ = [
    "KNOWN_TOKEN_KEYS",
    "TokenKey",
    "attention_mask_to_padding_mask",
    "check_batch_mapping",
    "normalize_batch",
    "pad_tokens",
    "pad_value",
    "shard_batch_dense",
    "take_runs",
]

KNOWN_TOKEN_KEYS = (
    "input_ids",
    "inputs_embeds",
    "labels",
    "loss_mask",
    "padding_mask",
    "position_ids",
)


class TokenKey(NamedTuple):
    """How to shard a caller-declared per-token key: its sequence dim and its pad value."""

    seq_dim: int = 1
    pad: float | int | bool = 0


def attention_mask_to_padding_mask(mask: torch.Tensor) -> torch.Tensor:
    """Convert an attention mask to a ``[B, S]`` bool padding mask (``True`` = pad).

    Rules (checked, never guessed):

    * 2-D ``[B, S]``: a *keep* mask (HF tokenizers' convention): bool, or numbers that are all
      ``0`` (pad) or ``1`` (token). Other values (e.g. an additive ``0 / -inf`` mask) raise.
    * 4-D ``[B, 1|H, S, S]``: bool (``True`` = attend) or floating-point *additive* (``0`` =
      attend, negative = masked); a token is a pad iff it cannot attend to itself (its diagonal
      entry is masked). A float mask with positive diagonal values (a ``0/1`` keep mask) and an
      integer 4-D mask raise: pass it as bool. Only a *causal padding* mask reduces to padding:
      every real query attends exactly to the real keys at or before it (pad query rows are not
      read). Any other structure (block-diagonal documents, bidirectional attention, additive
      biases) raises, at every CP size: CP attention is causal within documents, so a packed
      batch passes its documents as ``seq_lens`` (the error names the lengths a block-diagonal
      causal mask describes).

    Args:
        mask: ``[B, S]`` or ``[B, 1|H, S, S]``.

    Returns:
        BoolTensor ``[B, S]``.

    Raises:
        ValueError: another rank, or values that fit neither rule.
    """
    if not isinstance(mask, torch.Tensor):
        raise ValueError(
            f"attention_mask must be a tensor [B, S] or [B, 1|H, S, S], got {type(mask).__name__}"
        )
    if mask.dim() == 2:
        if mask.dtype == torch.bool:
            return ~mask
        if _not_zero_one(mask):
            raise ValueError(
                "a 2-D attention_mask must be a keep mask (1 = token, 0 = pad, or bool), got "
                f"values in [{mask.min().item()}, {mask.max().item()}]; convert an additive "
                "mask (0 = attend, -inf = masked) with attention_mask = (mask == 0)"
            )
        return mask == 0
    if mask.dim() == 4:
        diag = torch.diagonal(mask[:, 0], dim1=-2, dim2=-1)
        if diag.dtype == torch.bool:
            _check_causal_padding_mask(mask, diag)
            return ~diag
        if not diag.is_floating_point():
            raise ValueError(
                f"a 4-D attention_mask must be bool (True = attend) or floating-point additive "
                f"(0 = attend, negative = masked), got dtype {mask.dtype}; pass mask.bool() if "
                "1 means attend"
            )
        if bool((diag > 0).any()):
            raise ValueError(
                "a 4-D floating-point attention_mask is read as additive (0 = attend, negative "
                "= masked), but it has positive diagonal values (max "
                f"{diag.max().item()}): it looks like a 0/1 keep mask, which would turn every "
                "token into padding; pass it as bool (mask > 0) or as an additive mask"
            )
        pad = diag != 0
        _check_causal_padding_mask(mask == 0, ~pad)
        return pad
    raise ValueError(
        f"attention_mask must be 2-D [B, S] or 4-D [B, 1|H, S, S], got shape {tuple(mask.shape)}"
    )


def _not_zero_one(mask: torch.Tensor) -> bool:
    """Whether a numeric mask holds a value other than ``0`` and ``1``: for integers one
    min/max reduction (no temporaries), for floats an elementwise test (``0.5`` is in range)."""
    if mask.numel() == 0:
        return False
    if not mask.is_floating_point() and not mask.is_complex():
        lo, hi = torch.aminmax(mask)
        return bool(lo < 0) or bool(hi > 1)
    return bool(((mask != 0) & (mask != 1)).any())


def _documents_of(attend: torch.Tensor, real: torch.Tensor) -> list[list[int]] | None:
    """The per-row document lengths a block-diagonal causal mask describes, else ``None``.

    Args:
        attend: BoolTensor ``[B, S, S]`` (one head), ``True`` = query attends key.
        real: BoolTensor ``[B, S]``.
    """
    seq = attend.shape[-1]
    ar = torch.arange(seq, device=attend.device)
    first = torch.where(attend, ar, seq).amin(dim=-1)  # [B, S]: first key each query sees
    out: list[list[int]] = []
    for b in range(attend.shape[0]):
        if not bool(real[b].all()):
            return None  # documents with padding inside: no plain seq_lens to name
        starts = first[b]
        # documents are runs: a query's document starts where its first key is
        doc_start = torch.cummax(starts, 0).values
        if not bool((doc_start == starts).all()) or int(starts[0]) != 0:
            return None
        want = (ar[None, :] <= ar[:, None]) & (ar[None, :] >= starts[:, None])
        if not torch.equal(attend[b], want):
            return None
        bounds = [*torch.unique_consecutive(starts).tolist(), seq]
        out.append([e - s for s, e in itertools.pairwise(bounds)])
    return out


def _check_causal_padding_mask(attend: torch.Tensor, real: torch.Tensor) -> None:
    """Raise unless every real query of every head attends exactly to the real keys ``<=`` it.

    Args:
        attend: BoolTensor ``[B, 1|H, S, S]`` (``True`` = attend; for an additive mask, ``== 0``).
        real: BoolTensor ``[B, S]`` (the diagonal: ``True`` = a real token).

    Raises:
        ValueError: the mask is not causal padding (documents, bidirectional, a bias).
    """
    seq = attend.shape[-1]
    if attend.shape[-2] != seq or attend.shape[0] != real.shape[0]:
        raise ValueError(
            f"a 4-D attention_mask must be [B, 1|H, S, S], got shape {tuple(attend.shape)}"
        )
    ar = torch.arange(seq, device=attend.device)
    causal = ar[None, :] <= ar[:, None]  # [S, S]
    want = causal[None, None] & real[:, None, None, :]  # [B, 1, S, S]
    wrong = (attend != want) & real[:, None, :, None]  # pad query rows are not read
    if not bool(wrong.any()):
        return
    b, h, q, k = (int(i) for i in wrong.nonzero()[0].tolist())
    docs = (
        _documents_of(attend[:, 0], real)
        if attend.shape[1] == 1 or bool((attend == attend[:, :1]).all())
        else None
    )
    fix = (
        f"it describes documents: pass them as seq_lens={docs} (one list per row, the packed "
        "layouts shard them) and no attention_mask"
        if docs is not None
        else "pass a 2-D [B, S] padding mask (1 = token), and documents as seq_lens"
    )
    seen = "attends" if bool(attend[b, h, q, k]) else "does not attend"
    raise ValueError(
        "a 4-D attention_mask is honoured only as causal padding (each real token attends to "
        "the real tokens at or before it); this one is not: in row "
        f"{b}, head {h}, query {q} {seen} key {k}. CP attention is causal within documents and "
        f"cannot follow an arbitrary mask (nor reduce it to padding: silently wrong); {fix}"
    )


def _seq_len_of(key: str, t: torch.Tensor, dim: int, batch_size: int, seq_len: int) -> None:
    if t.dim() <= dim:
        want = "[B|1, S] or mRoPE [3, B, S]" if key == "position_ids" else f"sequence dim {dim}"
        raise ValueError(
            f"batch[{key!r}] is {t.dim()}-D with shape {tuple(t.shape)}, but a per-token tensor "
            f"needs {want}; add the batch dim, e.g. t.unsqueeze(0)"
        )
    if t.shape[dim] != seq_len:
        raise ValueError(
            f"batch[{key!r}] has length {t.shape[dim]} on its sequence dim {dim} (shape "
            f"{tuple(t.shape)}), but the primary input has seq_len={seq_len}; every per-token "
            "tensor must have the same sequence length"
        )
    bdim = 1 if key == "position_ids" and t.dim() == 3 else 0  # mRoPE is [3, B, S]
    if bdim != dim and t.shape[bdim] not in (1, batch_size):
        raise ValueError(
            f"batch[{key!r}] has batch size {t.shape[bdim]} (shape {tuple(t.shape)}), but the "
            f"primary input has batch size {batch_size}; use {batch_size} or 1"
        )


def _check_mrope(position_ids: object) -> None:
    """Raise unless 3-D ``position_ids`` are mRoPE's ``[3, B, S]`` (temporal, height, width)."""
    t = position_ids
    if isinstance(t, torch.Tensor) and t.dim() == 3 and t.shape[0] != 3:
        raise ValueError(
            f"batch['position_ids'] is 3-D with shape {tuple(t.shape)}, which cpshard reads as "
            "mRoPE [3, B, S] (temporal, height, width sections): its first dim must be 3, got "
            f"{t.shape[0]}. Pass [B, S] positions, or mRoPE positions as [3, B, S]"
        )


def _check_pad_value(key: str, t: torch.Tensor, pad: float | int | bool) -> None:
    integral = not t.is_floating_point() and not t.is_complex()
    if integral and isinstance(pad, float) and not pad.is_integer():
        raise ValueError(
            f"extra_token_keys[{key!r}] has pad={pad}, which an integer tensor "
            f"batch[{key!r}] ({t.dtype}) cannot hold (it would be truncated); pass an "
            "integer pad or a floating-point tensor"
        )


_PADDED_LENGTH_KEYS = (
    "seq_lens_padded",
    "cu_seqlens_padded",
    "cu_seqlens_q_padded",
    "cu_seqlens_kv_padded",
)


def check_batch_mapping(batch: object) -> None:
    """Raise unless ``batch`` is a dict of inputs cpshard can read without guessing.

    Raises:
        TypeError: ``batch`` is not a mapping.
        ValueError: a tensor on the meta device, or TransformerEngine's padded document lengths
            (``seq_lens_padded`` / ``cu_seqlens*_padded``), which cpshard does not read.
    """
    if not isinstance(batch, Mapping):
        raise TypeError(
            f"batch must be a dict of named inputs (e.g. {{'input_ids': ids, 'labels': labels}}),"
            f" got {type(batch).__name__}; wrap the tensors in a dict"
        )
    for key, value in batch.items():
        if isinstance(value, torch.Tensor) and value.device.type == "meta":
            raise ValueError(
                f"batch[{key!r}] is a meta-device tensor (shape {tuple(value.shape)}), which "
                "holds no values; move the batch to a real device first"
            )
        if key in _PADDED_LENGTH_KEYS and value is not None:
            raise ValueError(
                f"batch[{key!r}] gives TransformerEngine's padded document lengths (separator "
                "slots between documents), which cpshard does not read: it pads documents for "
                "CP itself. Fix: drop the separator slots and pass the real lengths as seq_lens "
                "/ cu_seqlens, or keep them, mark them with padding_mask (True = pad, label "
                "-100) and pass the padded lengths as seq_lens"
            )


def normalize_batch(
    batch: Mapping[str, Any],
    *,
    loss_mask: torch.Tensor | None = None,
    extra_token_keys: Mapping[str, TokenKey] | None = None,
) -> tuple[dict[str, Any], dict[str, int], str]:
    """Validate a dense batch and bring it to the conventions (no CP yet, nothing mutated).

    Args:
        batch: Caller's batch with exactly one of ``input_ids`` ``[B, S]`` /
            ``inputs_embeds`` ``[B, S, H]``; optional ``labels``, ``position_ids`` (``[B|1, S]``
            or mRoPE ``[3, B, S]``), ``loss_mask``, ``attention_mask`` / ``padding_mask``.
        loss_mask: Optional ``[B, S]`` mask given outside the batch; stored as ``loss_mask``.
        extra_token_keys: Caller-declared per-token keys and how to shard them.

    Returns:
        ``(batch, seq_dims, primary_key)``: a new dict (global, unpadded) with ``position_ids``
        filled in and ``attention_mask`` turned into ``padding_mask``; the sequence dim of every
        per-token key; the name of the primary input.

    Raises:
        ValueError: both or neither primary input, mismatched lengths, bad shapes.
    """
    # ``None`` means absent (HF-style batches carry e.g. ``input_ids=None`` with embeddings).
    has_ids = batch.get("input_ids") is not None
    has_emb = batch.get("inputs_embeds") is not None
    if has_ids == has_emb:
        raise ValueError(
            "a CP batch needs exactly one of 'input_ids' [B, S] or 'inputs_embeds' [B, S, H], got "
            f"{'both' if has_ids else 'neither'} (keys: {sorted(batch)}); pass one of them"
        )
    primary = "input_ids" if has_ids else "inputs_embeds"
    x = batch[primary]
    want = 2 if has_ids else 3
    if not isinstance(x, torch.Tensor) or x.dim() != want:
        shape = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
        raise ValueError(f"batch[{primary!r}] must be a {want}-D tensor, got {shape}")
    bsz, seq_len = x.shape[0], x.shape[1]
    if bsz == 0 or seq_len == 0:
        raise ValueError(
            f"batch[{primary!r}] has shape {tuple(x.shape)}: a CP batch needs B >= 1 rows of "
            "S >= 1 tokens; skip empty batches before sharding"
        )
    check_batch_mapping(batch)
    out = dict(batch)
    if out.get("attention_mask") is not None:
        if out.get("padding_mask") is not None:
            raise ValueError(
                "the batch has both 'attention_mask' and 'padding_mask'; pass one of them "
                "(attention_mask is converted to padding_mask)"
            )
        out["padding_mask"] = attention_mask_to_padding_mask(out.pop("attention_mask"))
    if loss_mask is not None:
        if out.get("loss_mask") is not None:
            raise ValueError("loss_mask was given both in the batch and as an argument; pass one")
        out["loss_mask"] = loss_mask
    if "position_ids" not in out or out["position_ids"] is None:
        out["position_ids"] = torch.arange(seq_len, device=x.device).expand(bsz, seq_len)
    dims: dict[str, int] = {primary: 1}
    for key in ("labels", "loss_mask", "padding_mask"):
        if out.get(key) is not None:
            dims[key] = 1
    dims["position_ids"] = 2 if out["position_ids"].dim() == 3 else 1
    _check_mrope(out["position_ids"])
    for key, spec in (extra_token_keys or {}).items():
        if key in KNOWN_TOKEN_KEYS:
            raise ValueError(
                f"extra_token_keys names {key!r}, which already has a built-in convention; "
                "remove it from extra_token_keys"
            )
        if key not in out:
            raise ValueError(f"extra_token_keys names {key!r}, which is not in the batch")
        t = out[key]
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"batch[{key!r}] must be a tensor, got {type(t).__name__}")
        if not -t.dim() <= spec.seq_dim < t.dim():
            raise ValueError(
                f"extra_token_keys[{key!r}].seq_dim={spec.seq_dim} is out of range for a "
                f"{t.dim()}-D tensor of shape {tuple(t.shape)}; pass a dim in "
                f"[{-t.dim()}, {t.dim() - 1}]"
            )
        _check_pad_value(key, t, spec.pad)
        dims[key] = spec.seq_dim % t.dim()
    for key, dim in dims.items():
        t = out[key]
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"batch[{key!r}] must be a tensor, got {type(t).__name__}")
        _seq_len_of(key, t, dim, bsz, seq_len)
    return out, dims, primary


def pad_value(
    key: str, padding_token_id: int, extra_token_keys: Mapping[str, TokenKey] | None = None
) -> float | int | bool | None:
    """The pad table's value of a per-token key (see the module docstring).

    Args:
        key: A batch key: a built-in one or one of ``extra_token_keys``.
        padding_token_id: Pad id of ``input_ids``.
        extra_token_keys: Caller-declared per-token keys and their pad values.

    Returns:
        The pad value; ``None`` for ``position_ids`` (continued, see :func:`pad_tokens`).

    Raises:
        KeyError: ``key`` is neither built-in nor declared.
    """
    table: dict[str, float | int | bool | None] = {
        "input_ids": padding_token_id,
        "inputs_embeds": 0,
        "labels": -100,
        "loss_mask": 0,
        "padding_mask": True,
        "position_ids": None,  # continued
    }
    return table[key] if key in table else (extra_token_keys or {})[key].pad


def pad_tokens(t: torch.Tensor, dim: int, n: int, value: float | int | bool | None) -> torch.Tensor:
    """Append ``n`` CP pad slots to ``t`` on its sequence dim (``t`` itself when ``n == 0``).

    Args:
        t: A per-token tensor, e.g. ``[B, S]`` or ``[B, S, H]``.
        dim: Its sequence dim.
        n: Pad slots to append.
        value: Their value (:func:`pad_value`); ``None`` continues positions monotonically
            (``last + 1, last + 2, ...``).

    Returns:
        ``t`` with ``S + n`` tokens on ``dim`` (a new tensor when ``n > 0``).
    """
    if n == 0:
        return t
    return torch.cat([t, _pad_piece(t, dim, 0, n, value)], dim=dim)


def take_runs(
    t: torch.Tensor,
    dim: int,
    runs: tuple[tuple[int, int], ...],
    value: float | int | bool | None,
) -> torch.Tensor:
    """The tokens at ``runs`` of ``t`` padded by :func:`pad_tokens`, without padding ``t``.

    Equal to ``pad_tokens(t, dim, P - S, value).index_select(dim, idx)`` for ``idx`` the
    concatenated ``arange`` ranges of ``runs``: the real part of each run is a slice of ``t``, its
    pad part (positions ``>= S``) is made like :func:`pad_tokens` makes it; one copy in all
    (a new tensor, never a view of ``t``; differentiable).

    Args:
        t: A per-token tensor with ``S`` tokens on ``dim``.
        dim: Its sequence dim.
        runs: ``((start, length), ...)``: contiguous runs of padded-stream positions.
        value: The pad value (:func:`pad_value`); ``None`` continues positions.

    Returns:
        ``t``'s tokens at the runs, contiguous, with ``sum(length)`` tokens on ``dim``.
    """
    seq = t.shape[dim]
    # an empty slice of t first: a rank whose tokens are all pads still gets a result in t's
    # autograd graph (zero gradient), as an index_select of the padded tensor would
    pieces = [t.narrow(dim, 0, 0)]
    for start, n in runs:
        end = start + n
        if start < seq:
            pieces.append(t.narrow(dim, start, min(end, seq) - start))
        if end > seq:
            lo = max(start, seq)
            pieces.append(_pad_piece(t, dim, lo - seq, end - lo, value))
    return torch.cat(pieces, dim=dim).contiguous()


def _pad_piece(
    t: torch.Tensor, dim: int, offset: int, n: int, value: float | int | bool | None
) -> torch.Tensor:
    """Pad slots ``offset .. offset + n - 1`` past the end of ``t`` (as :func:`pad_tokens`)."""
    if value is None:  # positions continue: last + 1 + offset, ...
        last = t.narrow(dim, t.shape[dim] - 1, 1)
        steps = torch.arange(offset + 1, offset + n + 1, device=t.device, dtype=t.dtype)
        shape = [1] * t.dim()
        shape[dim] = n
        return last + steps.reshape(shape)
    shape = list(t.shape)
    shape[dim] = n
    return t.new_full(shape, value)


def shard_batch_dense(
    cp_mesh: DeviceMesh | None,
    tp_mesh: DeviceMesh | None,
    batch: dict[str, Any],
    *,
    loss_mask: torch.Tensor | None = None,
    padding_token_id: int = 0,
    layout: ClosedFormLayout,
    extra_token_keys: Mapping[str, TokenKey] | None = None,
) -> tuple[CPContext, dict[str, Any]]:
    """Pad and shard a dense ``[B, S]`` batch with a closed-form layout.

    Args:
        cp_mesh: 1-D CP mesh or ``None`` (``None`` / size 1: the same conventions, no copies
            unless the layout pads).
        tp_mesh: Unused by dense layouts; part of the ``shard_batch`` contract.
        batch: Caller's batch (see :func:`normalize_batch`); never mutated. A packed batch
            (``seq_lens`` / ``cu_seqlens``) raises: closed-form layouts cannot express documents.
        loss_mask: Optional ``[B, S]`` loss mask.
        padding_token_id: Pad id for ``input_ids``.
        layout: The closed-form layout.
        extra_token_keys: Caller-declared per-token keys.

    Returns:
        ``(ctx, batch)``: ``batch`` holds local ``[B, P/C]`` tensors in local layout order;
        ``ctx.facts`` are the captured facts. ``ctx`` brings no context of its own (sharding
        knows nothing of attention): the dispatcher supplies CP attention over
        ``ctx.facts.token_meta``.
    """
    del tp_mesh
    packed = [k for k in ("seq_lens", "cu_seqlens") if batch.get(k) is not None]
    if packed:  # e.g. a model-owned or hand-built closed-form sharder given a packed batch
        raise ValueError(
            f"the batch describes packed documents ({packed}), which layout={layout.name!r} "
            "cannot express (its attention would cross documents); shard it with "
            "layout='balanced' or 'packed', or drop the key if the rows are single documents"
        )
    rank, world = _comm.cp_rank_and_size(cp_mesh)
    extra = dict(extra_token_keys or {})
    out, dims, primary = normalize_batch(batch, loss_mask=loss_mask, extra_token_keys=extra)
    x = out[primary]
    bsz, seq_len = x.shape[0], x.shape[1]
    pad_mask = out.get("padding_mask")
    placement = layout.placement(world, bsz, seq_len, pad_mask, x.device)
    padded = placement.padded_len
    facts = ShardFacts.of(placement, rank)
    # cp=1 runs the same path (same keys, same attention semantics); only copies are skipped.
    identity = world == 1 and padded == seq_len
    local = placement.rank_map[rank]
    runs = placement.local_runs(rank)
    for key, dim in dims.items():
        if identity:  # still a copy: the sharded batch never shares memory with the caller's
            out[key] = out[key].clone(memory_format=torch.contiguous_format)
            continue
        value = pad_value(key, padding_token_id, extra)
        if runs is not None:  # a few contiguous slices (and their pads), not token by token
            out[key] = take_runs(out[key], dim, runs, value)
            continue
        t = pad_tokens(out[key], dim, padded - seq_len, value)
        out[key] = t.index_select(dim, local).contiguous()
    return CPContext(None, facts), out
