"""Cross-rank batch consistency: every CP rank must shard the *same* global batch.

Each rank computes a small fingerprint of its whole (unsharded) batch before sharding: ``B``, ``S``,
the names, dtypes and shapes of every key, the layout, the attention method, the pad id, the
document structure (``seq_lens`` / ``cu_seqlens``), the padding mask, and content hashes of the
token ids, positions, labels and masks. The ranks exchange it in ONE all-gather of a fixed-size
int64 vector (its size never depends on the batch), so a data-loader bug that hands two ranks
different batches raises the same ``ValueError`` on every rank, naming the fields and the ranks
that differ, before any data-sized collective could crash (gloo aborts on a size mismatch) or hang.

Content hashes are weighted sums in int64 arithmetic (mod ``2**64``) with odd per-position weights,
so any single changed value, and any swap of two values, changes the hash. Integer and bool
tensors are hashed in full; floating-point tensors (``inputs_embeds``, float masks, extra keys) by
a strided sample of at most :data:`FLOAT_SAMPLE` values plus their shape and dtype.

The fingerprint is computed defensively: it never raises on a malformed batch (a bad value only
changes a hash), so a batch that is invalid on one rank only is reported here, on every rank,
instead of raising on that rank alone before a collective the others then wait in.

Owns the fingerprint and its one all-gather (:func:`check_dispatch_consistency` for the
dispatcher, :func:`check_verb_consistency` for the sharder's token verbs). Imports only torch and
:mod:`cpshard._comm`: :mod:`cpshard.sharding` calls it, so it never imports sharding, attention
or dispatch.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from typing import Any

import torch
from torch.distributed.device_mesh import DeviceMesh

from cpshard import _comm

__all__ = [
    "FIELDS",
    "FLOAT_SAMPLE",
    "batch_fingerprint",
    "check_batch_consistency",
    "check_dispatch_consistency",
    "check_verb_consistency",
    "mismatch_message",
]

FLOAT_SAMPLE = 4096
# One slot per field, in this order; the vector exchanged is ``len(FIELDS)`` int64 values.
FIELDS = (
    "batch type",
    "B",
    "S",
    "keys",
    "dtypes and shapes",
    "layout",
    "attention",
    "padding_token_id",
    "options",
    "seq_lens",
    "cu_seqlens",
    "padding (attention_mask / padding_mask)",
    "input_ids",
    "position_ids",
    "labels",
    "loss_mask",
    "inputs_embeds",
    "other keys",
)
_MASK = (1 << 63) - 1
_CONTENT = {
    "seq_lens": "seq_lens",
    "cu_seqlens": "cu_seqlens",
    "attention_mask": "padding (attention_mask / padding_mask)",
    "padding_mask": "padding (attention_mask / padding_mask)",
    "input_ids": "input_ids",
    "position_ids": "position_ids",
    "labels": "labels",
    "loss_mask": "loss_mask",
    "inputs_embeds": "inputs_embeds",
}


def _str_hash(text: str) -> int:
    """Deterministic across processes (``hash()`` of a str is salted per process)."""
    digest = hashlib.blake2b(text.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & _MASK


def _describe(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"Tensor({value.dtype}, {tuple(value.shape)}, {value.device.type})"
    if value is None or isinstance(value, bool | int | float | str):
        return repr(value)
    if isinstance(value, list | tuple):
        return f"{type(value).__name__}[{', '.join(_describe(v) for v in value[:64])}]"
    return type(value).__name__


def _content_hash(t: torch.Tensor) -> torch.Tensor:
    """0-d int64 tensor: ``sum_k x_k * (2k + 1) + numel`` over the flat values, mod ``2**64``.

    Computed without a ``[N]`` temporary: viewing the values as ``[R, C]`` (``k = C*i + j``),
    ``sum_k x_k (2k + 1) = 2C * sum_i i*rowsum_i + 2 * sum_j j*colsum_j + sum_k x_k``, and int64
    arithmetic wraps, so the identity holds exactly. Floating-point tensors contribute the bits of
    a strided sample of at most :data:`FLOAT_SAMPLE` values.
    """
    if t.device.type == "meta" or t.numel() == 0:
        return torch.zeros((), dtype=torch.long)
    x = t.detach()
    if x.is_floating_point() or x.is_complex():
        flat = x.reshape(-1)
        step = max(1, flat.numel() // FLOAT_SAMPLE)
        flat = flat[::step].contiguous()
        if flat.is_complex():
            flat = torch.view_as_real(flat).reshape(-1)
        bits = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
        x = flat.view(bits[flat.element_size()])
    x = x.reshape(1, -1) if x.dim() < 2 else x.reshape(-1, x.shape[-1])
    rows = x.sum(dim=1, dtype=torch.long)  # [R]
    cols = x.sum(dim=0, dtype=torch.long)  # [C]
    r, c = x.shape
    total = rows.sum()
    # sum_i i*rows_i = R*total - sum_i cumsum(rows)_i (no arange), likewise for the columns
    row_weighted = r * total - rows.cumsum(0).sum()
    col_weighted = c * total - cols.cumsum(0).sum()
    return 2 * c * row_weighted + 2 * col_weighted + total + x.numel()


def _as_hashable_tensor(value: Any) -> torch.Tensor | None:
    """Integer lists (``seq_lens``) as a tensor, so lists and tensors hash alike; else None."""
    if isinstance(value, torch.Tensor):
        return value
    try:
        t = torch.as_tensor(value)
    except (TypeError, ValueError, RuntimeError, OverflowError):
        return None
    return t if t.dtype in (torch.long, torch.int32, torch.bool) else None


def batch_fingerprint(
    batch: object,
    *,
    layout: str,
    attention: str,
    padding_token_id: object,
    options: Mapping[str, Any] | None = None,
) -> torch.Tensor:
    """LongTensor ``[len(FIELDS)]`` summarising everything the CP ranks must agree on.

    Args:
        batch: The caller's whole (unsharded) batch; never mutated, never validated here.
        layout: The layout requested (``"auto"``, ``"round_robin"``, ...).
        attention: The attention method.
        padding_token_id: The pad id as given.
        options: Further arguments that must agree (``pad_multiple``, ``loss_mask``, ...); tensors
            are hashed by content, other values by their ``repr``.

    Returns:
        A LongTensor on the batch's device, one slot per entry of :data:`FIELDS`.
    """
    slots: dict[str, torch.Tensor | int] = dict.fromkeys(FIELDS, 0)
    slots["batch type"] = _str_hash(type(batch).__name__)
    slots["layout"] = _str_hash(repr(layout))
    slots["attention"] = _str_hash(repr(attention))
    slots["padding_token_id"] = _str_hash(repr(padding_token_id))
    opts = dict(options or {})
    opt_text = []
    other = torch.zeros((), dtype=torch.long)
    for name in sorted(opts):
        v = opts[name]
        opt_text.append(f"{name}={_describe(v)}")
        if isinstance(v, torch.Tensor):
            other = other + _content_hash(v) * (len(opt_text) + 1)
    slots["options"] = _str_hash(";".join(opt_text))
    if not isinstance(batch, Mapping):
        slots["keys"] = _str_hash(_describe(batch))
        return _pack(slots)
    keys = sorted(str(k) for k in batch)
    slots["keys"] = _str_hash(",".join(keys))
    slots["dtypes and shapes"] = _str_hash(";".join(f"{k}:{_describe(batch[k])}" for k in batch))
    primary = batch.get("input_ids")
    if primary is None:
        primary = batch.get("inputs_embeds")
    if isinstance(primary, torch.Tensor) and primary.dim() >= 2:
        slots["B"], slots["S"] = int(primary.shape[0]), int(primary.shape[1])
    else:
        slots["B"] = slots["S"] = -1
    for i, key in enumerate(sorted(batch, key=str)):
        value = batch[key]
        t = _as_hashable_tensor(value)
        field = _CONTENT.get(str(key), "other keys")
        if t is not None:
            h = _content_hash(t)
        elif isinstance(value, list | tuple):  # ragged seq_lens and the like
            h = torch.tensor(_str_hash(repr(value)), dtype=torch.long)
        else:
            continue
        if field == "other keys":
            h = h * (2 * i + 3)
        slots[field] = h + slots[field]
    slots["other keys"] = other + slots["other keys"]
    return _pack(slots)


def _pack(slots: Mapping[str, torch.Tensor | int]) -> torch.Tensor:
    """Stack the slots on the device of the content hashes (one transfer later, not 18 syncs)."""
    device = next(
        (v.device for v in slots.values() if isinstance(v, torch.Tensor)), torch.device("cpu")
    )
    values = [torch.as_tensor(slots[f], dtype=torch.long).to(device) for f in FIELDS]
    return torch.stack(values)


def _ranks_that_differ(column: list[int]) -> str:
    groups: dict[int, list[int]] = {}
    for r, v in enumerate(column):
        groups.setdefault(v, []).append(r)
    return " vs ".join(f"ranks {g}" for g in sorted(groups.values()))


def mismatch_message(table: torch.Tensor) -> str | None:
    """The error text for a gathered ``[C, len(FIELDS)]`` table, or ``None`` if all rows agree."""
    rows = table.tolist()
    bad = [i for i in range(len(FIELDS)) if len({row[i] for row in rows}) > 1]
    if not bad:
        return None
    parts = []
    for i in bad:
        column = [row[i] for row in rows]
        if FIELDS[i] in ("B", "S"):
            values = ", ".join(f"rank {r}: {v}" for r, v in enumerate(column))
            parts.append(f"{FIELDS[i]} ({values})")
        else:
            parts.append(f"{FIELDS[i]} ({_ranks_that_differ(column)})")
    return (
        f"the {len(rows)} ranks of the CP group were given different batches: "
        + "; ".join(parts)
        + ". Every rank of a CP group must receive the same global batch (same tensors, same "
        "arguments); check the data loader / sampler (seed it per data-parallel rank, not per "
        "global rank) and that every rank passes the same layout, attention and pad id. Pass "
        "check_consistency=False only if your loop guarantees this."
    )


def check_batch_consistency(
    cp_mesh: DeviceMesh | None,
    batch: object,
    *,
    layout: str,
    attention: str,
    padding_token_id: object,
    options: Mapping[str, Any] | None = None,
) -> None:
    """Raise the same ``ValueError`` on every CP rank unless all ranks hold the same batch.

    One all-gather of ``len(FIELDS)`` int64 values; no collective without CP.

    Args:
        cp_mesh: 1-D CP mesh (already validated) or ``None``.
        batch, layout, attention, padding_token_id, options: See :func:`batch_fingerprint`.

    Raises:
        ValueError: the fingerprints differ; the message names the fields and the ranks.
    """
    group = _comm.cp_group(cp_mesh)
    if group is None:
        return
    assert cp_mesh is not None
    fp = batch_fingerprint(
        batch,
        layout=layout,
        attention=attention,
        padding_token_id=padding_token_id,
        options=options,
    )
    table = _comm.all_gather_fixed(fp, group)
    message = mismatch_message(table)
    if message is not None:
        raise ValueError(message)


def check_dispatch_consistency(
    cp_mesh: DeviceMesh | None,
    batch: object,
    layout: str,
    attention: str,
    padding_token_id: object,
    options: dict[str, Any],
) -> None:
    """:func:`check_batch_consistency` for the dispatcher's arguments (sharders and extra keys are
    compared by type and spec, tensors by content)."""
    described = {
        k: (type(v).__name__ if k in ("cp_sharder", "extra_token_keys") and v is not None else v)
        for k, v in options.items()
    }
    if options.get("extra_token_keys") is not None:
        described["extra_token_keys"] = repr(sorted(dict(options["extra_token_keys"]).items()))
    check_batch_consistency(
        cp_mesh,
        batch,
        layout=layout,
        attention=attention,
        padding_token_id=padding_token_id,
        options=described,
    )


# --- token verbs ------------------------------------------------------------------------------
_DTYPES = (
    torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32,
    torch.int16, torch.int8, torch.uint8, torch.bool, torch.complex64, torch.complex128,
)  # fmt: skip
_MAX_DIMS = 8
_VERB_FIELDS = ("tensor type", "dtype", "shape", "seq_dim", "trim", "fill", "grad")


def _verb_descriptor(
    t: object, seq_dim: object, trim: object, fill: object, grad: object
) -> list[int]:
    """Fixed-size int64 description of a verb call (never raises)."""
    if not isinstance(t, torch.Tensor):
        head = [-1, -1]
        dims = [-2] * (_MAX_DIMS + 2)
    else:
        head = [1, _DTYPES.index(t.dtype) if t.dtype in _DTYPES else _str_hash(str(t.dtype))]
        shape = [int(d) for d in t.shape]
        dims = [len(shape), *(shape + [-1] * _MAX_DIMS)[:_MAX_DIMS], _str_hash(repr(shape))]
    return [*head, *dims, _str_hash(repr(seq_dim)), _str_hash(repr(trim)),
            _str_hash(repr(fill)), _str_hash(repr(grad))]  # fmt: skip


def _verb_field_slices() -> list[tuple[str, slice]]:
    shape_end = 2 + _MAX_DIMS + 2
    return [
        ("tensor type", slice(0, 1)),
        ("dtype", slice(1, 2)),
        ("shape", slice(2, shape_end)),
        ("seq_dim", slice(shape_end, shape_end + 1)),
        ("trim", slice(shape_end + 1, shape_end + 2)),
        ("fill", slice(shape_end + 2, shape_end + 3)),
        ("grad", slice(shape_end + 3, shape_end + 4)),
    ]


def _readable(field: str, row: list[int]) -> str:
    if field == "dtype":
        code = row[1]
        return str(_DTYPES[code]) if 0 <= code < len(_DTYPES) else "other"
    if field == "shape":
        n = row[2]
        return "not a tensor" if n < 0 else str(tuple(row[3 : 3 + min(n, _MAX_DIMS)]))
    if field == "tensor type":
        return "tensor" if row[0] == 1 else "not a tensor"
    return "differs"


def check_verb_consistency(
    cp_mesh: DeviceMesh,
    group: Any,
    verb: str,
    t: object,
    *,
    seq_dim: object,
    trim: object,
    fill: object,
    grad: object,
) -> None:
    """Raise the same ``ValueError`` on every rank unless all ranks call ``verb`` alike.

    One all-gather of 16 int64 values, before the verb's data all-gather: a dtype mismatch would
    otherwise reinterpret bits, and a shape mismatch crash gloo or hang.

    Raises:
        ValueError: the ranks passed tensors of different type, dtype or shape, or different
            ``seq_dim`` / ``trim`` / ``fill`` / ``grad``.
    """
    desc = torch.tensor(_verb_descriptor(t, seq_dim, trim, fill, grad), dtype=torch.long)
    rows = _comm.all_gather_fixed(desc, group).tolist()
    parts = []
    for field, sl in _verb_field_slices():
        if len({tuple(row[sl]) for row in rows}) > 1:
            values = ", ".join(f"rank {r}: {_readable(field, row)}" for r, row in enumerate(rows))
            parts.append(f"{field} ({values})")
    if parts:
        raise ValueError(
            f"{verb} was called with different tensors or arguments on the {len(rows)} CP "
            f"ranks: {'; '.join(parts)}. Every rank must pass its local shard of the same "
            "per-token tensor (same dtype, same shape) with the same arguments; cast or reshape "
            "before the call"
        )
