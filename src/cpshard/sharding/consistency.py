"""Cross-rank batch consistency: every CP rank must shard the *same* global batch.

Each rank computes a small fingerprint of its whole (unsharded) batch before sharding: ``B``, ``S``,
the names, dtypes and shapes of every key, the layout, the attention method, the pad id, the
document structure (``seq_lens`` / ``cu_seqlens``), the padding mask, and content hashes of the
token ids, positions, labels and masks. The ranks exchange it in ONE all-gather of a fixed-size
int64 vector (its size never depends on the batch), so a data-loader bug that hands two ranks
different batches raises the same ``ValueError`` on every rank, naming the fields and the ranks
that differ, before any data-sized collective could crash (gloo aborts on a size mismatch) or hang.

What it covers, exactly (with ``check_consistency=True``, the default):

* every key of the batch: its name, and its type, dtype, shape and device (``None``, bools,
  numbers and strings: their value; lists: each element's);
* every value of every tensor of the batch, whatever its key or dtype: token ids, positions,
  labels, masks, ``inputs_embeds`` (every token row, every element), ``seq_lens``, extra keys;
  sparse, quantized and nested tensors by their parts (indices and values, integers and
  quantizer, components) and their layout;
* every non-tensor entry by content: numpy arrays (dtype, shape, every byte), lists, tuples and
  dicts (their items in order, tensors inside by content), dataclass instances (their fields),
  ``None``, bools, numbers, strings and bytes; any other object by its type only (its ``repr``
  may hold a per-process address);
* the arguments: layout, attention method, pad id, ``pad_multiple``, ``num_chunks``,
  ``extra_token_keys``, ``attention_cost`` (every rate and the assumed call shape of the
  ``CostModel``: ranks with different ones could choose different methods under ``"auto"``), a
  given sharder's type, and ``loss_mask`` by content.

Content hash (:func:`_content_hash`): on the CPU, XXH3-64 (the ``xxhash`` package) of the
tensor's canonical bytes: integers and bools widened to int64 (equal values hash alike whatever the
integer dtype), floats by their bits (``-0.0`` and each NaN payload count as different values). It
reads about 60 bytes a nanosecond, so hashing the batch costs less than its ``index_select``. On
an accelerator, where a host copy would cost more than the hash, a keyed quadratic sum in 32-bit
lanes (:func:`_lane_hash`) runs as a few kernels. The two are different functions: a hash is only
compared with another of the same device type (each tensor's description carries its device type;
the shard's record hashes a call tensor on the record's device).

Not covered: tensors handed only to the token verbs (``sharder.shard_token_tensor(advantages)``
has no collective to ride; ``gather_token_tensor`` compares dtype, shape and arguments, not
values): keeping them equal on every CP rank is the caller's job, like the batch with the check
off. ``check_consistency=False`` skips the hashing (no value is read), not the collective: the
ranks still exchange the names, types, shapes, arguments and the flag itself, so ranks that
disagree on the flag raise the same error instead of mismatching collectives.

The fingerprint is computed defensively: it never raises on a malformed batch (a bad value only
changes a hash), so a batch that is invalid on one rank only is reported here, on every rank,
instead of raising on that rank alone before a collective the others then wait in.

Owns the fingerprint and its comparison (:func:`dispatch_fingerprint` for the dispatcher, whose
fingerprint rides in the step header's one all-gather, :func:`check_batch_consistency` with an
all-gather of its own, :func:`check_verb_consistency` for the sharder's token verbs).

Import rules: the rows of ``RULES`` in tests/unit/test_architecture.py that cover this module.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import itertools
from collections.abc import Mapping
from typing import Any

import torch
import xxhash
from torch.distributed.device_mesh import DeviceMesh

from cpshard import _comm

__all__ = [
    "FIELDS",
    "batch_fingerprint",
    "check_batch_consistency",
    "check_verb_consistency",
    "content_hash",
    "dispatch_fingerprint",
    "mismatch_message",
    "raise_on_mismatch",
    "verb_descriptor",
    "verb_mismatch_message",
]

# One slot per field, in this order; the vector exchanged is ``len(FIELDS)`` int64 values.
FIELDS = (
    "check_consistency",
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


def _describe(value: Any, depth: int = 0) -> str:
    """A deterministic text of a value's kind (tensors: dtype, shape, device, layout; scalars and
    strings: their ``repr``; lists: their elements'; dataclass instances, such as a
    ``CostModel``: their fields'; any other object: its type name only, its ``repr`` may hold a
    per-process address)."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type) and depth < 8:
        fields = ", ".join(
            f"{f.name}={_describe(getattr(value, f.name, None), depth + 1)}"
            for f in dataclasses.fields(value)
        )
        return f"{type(value).__name__}({fields})"
    if isinstance(value, torch.Tensor):
        if value.is_nested:  # no single shape: its components'
            shapes = [tuple(part.shape) for part in value.unbind()]
            return f"NestedTensor({value.dtype}, {shapes}, {value.device.type})"
        return f"Tensor({value.dtype}, {tuple(value.shape)}, {value.device.type}, {value.layout})"
    if value is None or isinstance(value, bool | int | float | str):
        return repr(value)
    if isinstance(value, list | tuple):
        inner = ", ".join(_describe(v, depth + 1) for v in value[:64])
        return f"{type(value).__name__}[{inner}]"
    if hasattr(value, "__array_interface__"):  # numpy: dtype and shape
        dtype, shape = getattr(value, "dtype", "?"), getattr(value, "shape", "?")
        return f"{type(value).__name__}({dtype}, {shape})"
    return type(value).__name__


_ODD = -0x2917014799A6026D  # 0xD6E8FEB86659FD93 as a signed int64: the blocks' odd weight
_GOLDEN32 = -0x61C88647  # 0x9E3779B9 as a signed int32: the lanes' odd key multiplier
# Elements per hash block (the unit of the hash's definition: each block's sum has an odd
# weight of its own). On the CPU one block is hashed at a time: its three 256 KB buffers (the
# lane keys, the lane products, a widening copy) stay in cache, and their one 768 KB block stays
# under the 2 MB tensors of a [8, 32768] batch, which glibc serves by a fresh mmap each (a 2 MB
# scratch page-faulted on every call).
_BLOCK = 1 << 15
_CHUNK_BLOCKS_CPU = 1
_CHUNK_BLOCKS_ACCELERATOR = 32  # on a GPU: 32 blocks a launch (8 MB temporaries)


_PADDING_KEYS = ("attention_mask", "padding_mask")


def _describe_entry(key: object, value: Any) -> str:
    """:func:`_describe`, except that a bool and an integer padding mask of the same shape
    describe alike (their 0/1 values hash alike too): equal masks are the same batch."""
    if (
        key in _PADDING_KEYS
        and isinstance(value, torch.Tensor)
        and not value.is_nested
        and not value.is_floating_point()
        and not value.is_complex()
    ):
        return f"Mask({tuple(value.shape)}, {value.device.type})"
    return _describe(value)


def _int64_view(t: torch.Tensor) -> torch.Tensor:
    """``t`` flattened, as integers: integers and bools by value, floats (and complex, as pairs
    of floats) by their bits; a view where ``t`` is contiguous. The hash widens it to int64."""
    x = t.detach()
    if x.is_complex():
        x = torch.view_as_real(x)
    if x.is_floating_point():
        bits = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
        x = x.contiguous().view(bits[x.element_size()])
    return x.reshape(-1)


def _scratch(
    store: dict[Any, torch.Tensor] | None, device: torch.device, block: int, blocks: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(keys, y, x)`` for hashing ``blocks`` blocks of ``block`` elements at a time: the lane
    keys ``(2j + 1) * G32`` of each block, tiled (int32, read only), an int32 work buffer of as
    many lanes and an int64 widening buffer of ``blocks * block`` elements; from ``store`` (one
    fingerprint's: the tensors of one batch share them) or new."""
    lanes = 2 * block * blocks
    slot = (str(device), block, blocks)
    got = None if store is None else store.get(slot)
    if got is None:
        got = torch.empty(3 * lanes, device=device, dtype=torch.int32)
        keys = got[:lanes].view(blocks, 2 * block)
        torch.arange(1, 4 * block, 2, out=keys[0]).mul_(_GOLDEN32)
        keys[1:] = keys[0]
        if store is not None:
            store[slot] = got
    return got[:lanes], got[lanes : 2 * lanes], got[2 * lanes :].view(torch.long)


def _content_hash(t: torch.Tensor, keys: dict[Any, torch.Tensor] | None = None) -> torch.Tensor:
    """0-d int64 tensor: a hash of every element of ``t`` (a meta or empty tensor hashes to 0).

    On the CPU, :func:`_host_hash`; on an accelerator, :func:`_lane_hash` (no host copy). Equal
    values give equal hashes whatever their integer dtype (integers and bools are hashed widened
    to int64), floats are hashed by their bits, and the hashes of the two device types differ.

    A tensor that is not a plain strided one is hashed by its parts (:func:`_parts`: a sparse
    tensor's coalesced indices and values, a quantized one's integers and quantizer, a nested
    one's components), so the fingerprint never raises on one (a rank that raised alone before
    the exchange would leave the others waiting in it).

    Args:
        t: Any tensor.
        keys: One fingerprint's store of the lane hash's keys and work buffers (:func:`_scratch`),
            which the tensors of one batch share; ``None``: this call's own. Unused on the CPU.
    """
    if not _is_plain(t):
        parts = _parts(t)
        if parts is None:
            return torch.tensor(_str_hash(f"unhashable {t.layout} {t.dtype}"), dtype=torch.long)
        total = torch.zeros((), dtype=torch.long, device=parts[0].device if parts else "cpu")
        for i, part in enumerate(parts):
            total = total + _content_hash(part, keys).to(total.device) * (2 * i + 1)
        return total
    if t.device.type == "meta" or t.numel() == 0:
        return torch.zeros((), dtype=torch.long)
    hash_of = _host_hash if t.device.type == "cpu" else functools.partial(_lane_hash, keys=keys)
    try:
        return hash_of(t)
    except (RuntimeError, NotImplementedError, TypeError):
        pass  # a dtype no conversion reaches (sub-byte, bits): its raw bytes
    try:
        return hash_of(t.detach().view(torch.uint8)) ^ _str_hash(f"raw {t.dtype}")
    except (RuntimeError, NotImplementedError, TypeError):
        return torch.tensor(_str_hash(f"unhashable {t.dtype}"), dtype=torch.long)


def _is_plain(t: torch.Tensor) -> bool:
    """Whether ``t`` is a plain strided tensor (not sparse, quantized or nested)."""
    return not (t.is_nested or t.layout != torch.strided or t.is_quantized)


def _parts(t: torch.Tensor) -> list[torch.Tensor] | None:
    """The plain tensors that describe a sparse, quantized or nested tensor exactly (with its
    shape, which its description holds), or ``None`` where reading them fails."""
    try:
        if t.is_nested:
            return [x for part in t.unbind() for x in _parts_or_self(part)]
        if t.is_quantized:
            if t.qscheme() in (torch.per_tensor_affine, torch.per_tensor_symmetric):
                scale = torch.tensor([t.q_scale()], dtype=torch.float64)
                point = torch.tensor([t.q_zero_point()], dtype=torch.long)
            else:
                scale = t.q_per_channel_scales().to(torch.float64)
                point = t.q_per_channel_zero_points().to(torch.long)
            return [t.int_repr(), scale.to(t.device), point.to(t.device)]
        coo = t.detach().to_sparse() if t.layout != torch.sparse_coo else t.detach()
        coo = coo.coalesce()
        return [coo.indices(), *_parts_or_self(coo.values())]
    except (RuntimeError, TypeError, ValueError, NotImplementedError):
        return None


def _parts_or_self(t: torch.Tensor) -> list[torch.Tensor]:
    """``[t]`` for a plain tensor, else its :func:`_parts` (a tag tensor where they fail)."""
    if _is_plain(t):
        return [t]
    got = _parts(t)
    return got if got is not None else [torch.tensor([_str_hash(f"unhashable {t.layout}")])]


def _host_hash(t: torch.Tensor) -> torch.Tensor:
    """0-d int64 tensor: XXH3-64 of the bytes of ``t`` flattened in row-major order (integers and
    bools widened to int64, floats and complex numbers by their bits), as a signed int64; ``t``
    on the CPU, not empty.

    One read of the tensor where it is contiguous int64 (token ids, labels, masks) or floating
    point, else one copy first (a widening, or a gather of a strided view)."""
    x = t.detach().resolve_conj().resolve_neg()
    if x.is_complex():
        x = torch.view_as_real(x)
    if x.is_floating_point():  # by its bits (the dtype is in the tensor's description)
        x = x.contiguous().view(
            {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[x.element_size()]
        )
    elif x.dtype != torch.long:
        x = x.to(torch.long)
    value = xxhash.xxh3_64_intdigest(x.contiguous().numpy().data)
    return torch.tensor(value - (1 << 64) if value >= 1 << 63 else value, dtype=torch.long)


def _lane_hash(t: torch.Tensor, keys: dict[Any, torch.Tensor] | None = None) -> torch.Tensor:
    """0-d int64 tensor: ``n + sum_i c_i S_i`` mod ``2**64`` over blocks ``i`` of
    :data:`_BLOCK` elements, ``c_i = (2i + 1) K``.

    Every element of every tensor is hashed: its value ``x`` (integers and bools, widened to
    int64) or its bits (floating point, so ``-0.0`` and each NaN payload count as different
    values), as two 32-bit lanes (``x mod 2**32`` and ``x >> 32``, the int64's halves). Lane
    ``j`` of a block maps to ``l * (l + v_j)`` mod ``2**32``, ``v_j = (2j + 1) G`` (``G`` the
    odd 32-bit golden ratio): a quadratic function of the keyed value, so the compensating
    changes that fool a weighted sum (``+3`` here, ``-1`` there) and swaps of values change it.
    ``S_i`` is the sum of the block's elements re-read from their two mapped lanes (an int64
    per element, mod ``2**64``) and ``K`` an odd constant, so each block counts with a weight of
    its own. One lane's change is missed only where ``(l' - l)(l' + l + v_j) = 0`` mod
    ``2**32``; ``v_j`` odd makes ``l' + l + v_j`` odd when ``l' - l`` is even, so a flip of a
    lane's top bit (the int64's top bit included) always counts; a changed lane always changes
    its element's int64 and, through the odd ``c_i``, the hash.

    All three passes per block are SIMD on the CPU: the keys' add and the product in 32-bit
    lanes, the sum in 64 (a 64-bit product and ``torch.dot`` of integers are scalar loops there).
    No temporary of the tensor's size; the value does not depend on how many blocks a pass
    takes (:data:`_CHUNK_BLOCKS_CPU` on the CPU, :data:`_CHUNK_BLOCKS_ACCELERATOR` elsewhere).

    Args:
        t: Any tensor (a meta or empty one hashes to 0).
        keys: One fingerprint's store of the lane keys and work buffers (:func:`_scratch`),
            which the tensors of one batch share; ``None``: this call's own.
    """
    if t.device.type == "meta" or t.numel() == 0:
        return torch.zeros((), dtype=torch.long)
    flat = _int64_view(t)
    n, device = flat.numel(), flat.device
    block = min(_BLOCK, n)
    n_blocks = -(-n // block)
    per = _CHUNK_BLOCKS_CPU if device.type == "cpu" else _CHUNK_BLOCKS_ACCELERATOR
    per = min(per, n_blocks)
    lane_keys, y_buf, x_buf = _scratch(keys, device, block, per)
    sums = torch.empty(n_blocks, dtype=torch.long, device=device)
    chunk = per * block
    for first, start in zip(range(0, n_blocks, per), range(0, n, chunk), strict=True):
        m = min(chunk, n - start)
        x = flat[start : start + m]
        if x.dtype != torch.long:
            x = x_buf[:m].copy_(x)
        lanes = x.view(torch.int32)
        y = torch.add(lanes, lane_keys[: 2 * m], out=y_buf[: 2 * m]).mul_(lanes)
        y64, full = y.view(torch.long), m // block
        if full:
            torch.sum(y64[: full * block].view(full, block), dim=1, out=sums[first : first + full])
        if full * block < m:
            torch.sum(y64[full * block :], dim=0, out=sums[first + full])
    weights = torch.arange(1, 2 * n_blocks, 2, dtype=torch.long, device=device).mul_(_ODD)
    return (sums * weights).sum() + n


content_hash = _content_hash  # public: the sharder's batch record hashes its local tensors too


def _wrap_int(x: int) -> int:
    """A Python int wrapped to int64 (mod ``2**64``, signed) like the tensor arithmetic."""
    x &= (1 << 64) - 1
    return x - (1 << 64) if x >= 1 << 63 else x


def _wrap(x: int | torch.Tensor) -> int | torch.Tensor:
    """:func:`_wrap_int` of a Python int; a tensor as it is."""
    return x if isinstance(x, torch.Tensor) else _wrap_int(x)


def _add(a: int | torch.Tensor, b: int | torch.Tensor) -> int | torch.Tensor:
    """``a + b`` mod ``2**64`` for int64-range ints and int64 tensors alike (a Python int
    that left the int64 range would overflow when it meets a tensor)."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return a + b
    return _wrap(a + b)


def _digest(value: Any, depth: int = 0) -> int | torch.Tensor:
    """A content hash of a batch value that is not hashed as a tensor (never raises).

    numpy arrays: dtype, shape and every byte; ``None``, bools, numbers, strings and bytes: their
    ``repr``; lists, tuples and dicts: their items, in order (tensors inside by content, via
    :func:`_content_hash`); dataclass instances: their type and fields; any other object: its
    type name only (its ``repr`` may hold a memory address that differs across ranks).
    """
    if isinstance(value, torch.Tensor):
        return _content_hash(value)
    if value is None or isinstance(value, bool | int | float | complex | str | bytes):
        return _str_hash(f"{type(value).__name__}:{value!r}")
    ndarray = getattr(value, "__array_interface__", None) is not None and hasattr(value, "tobytes")
    if ndarray:
        try:
            head = f"ndarray:{value.dtype}:{tuple(value.shape)}:".encode()
            raw = value.tobytes() if value.dtype != object else repr(value.tolist()).encode()
            digest = hashlib.blake2b(head + raw, digest_size=8).digest()
            return int.from_bytes(digest, "little") & _MASK
        except Exception:  # never raise here: the batch is validated after the exchange
            return _str_hash(type(value).__name__)
    if dataclasses.is_dataclass(value) and not isinstance(value, type) and depth < 8:
        fields = {f.name: getattr(value, f.name, None) for f in dataclasses.fields(value)}
        return _add(_str_hash(type(value).__name__), _digest(fields, depth + 1))
    if isinstance(value, list | tuple | dict) and depth < 8:
        items = list(value.items()) if isinstance(value, dict) else list(enumerate(value))
        total: int | torch.Tensor = _str_hash(f"{type(value).__name__}:{len(items)}")
        for i, (k, v) in enumerate(items):
            h = _digest(v, depth + 1)
            # Python ints are wrapped to int64 before they meet a tensor (a tensor hash of an
            # item turns the running total into a tensor; an unwrapped int would overflow it).
            key = _wrap((_str_hash(repr(k)) ^ (i + 1)) * (2 * i + 1))
            val = h * (4 * i + 3) if isinstance(h, torch.Tensor) else _wrap(h * (4 * i + 3))
            total = _add(_add(total, key), val)
        if isinstance(total, torch.Tensor):
            return total
        return total & _MASK
    return _str_hash(f"object:{type(value).__name__}")


def _as_hashable_tensor(value: Any) -> torch.Tensor | None:
    """A tensor, or a list of ints / bools as one (``seq_lens``: lists and tensors hash alike)."""
    if isinstance(value, torch.Tensor):
        return value
    if not isinstance(value, list | tuple) or not value:
        return None
    if not all(isinstance(v, int) for v in value):  # bools are ints
        return None
    try:
        return torch.as_tensor(value, dtype=torch.long)
    except (TypeError, ValueError, RuntimeError, OverflowError):
        return None


_NESTED_TAG = _str_hash("nested int lists")


def _nested_ints(value: Any) -> torch.Tensor | None:
    """A list (or tuple) of lists / tuples of ints (per-row ``seq_lens``) as one LongTensor
    ``[1 + R + N]``: the row count, each row's length, then the values in order (a prefix code:
    two different nestings never give the same tensor); ``None`` for anything else (hashed by
    :func:`_digest`). The caller tags its hash (:data:`_NESTED_TAG`), so it never equals a flat
    list's. Never raises."""
    if not isinstance(value, list | tuple) or not value:
        return None
    if not all(isinstance(row, list | tuple) for row in value):
        return None
    if not all(isinstance(v, int) for row in value for v in row):  # bools are ints
        return None
    try:
        head = [len(value), *(len(row) for row in value)]
        return torch.as_tensor(head + list(itertools.chain.from_iterable(value)), dtype=torch.long)
    except (TypeError, ValueError, RuntimeError, OverflowError):
        return None


def batch_fingerprint(
    batch: object,
    *,
    layout: str,
    attention: str,
    padding_token_id: object,
    options: Mapping[str, Any] | None = None,
    hashed: bool = True,
) -> torch.Tensor:
    """LongTensor ``[len(FIELDS)]`` summarising everything the CP ranks must agree on.

    Args:
        batch: The caller's whole (unsharded) batch; never mutated, never validated here.
        layout: The layout requested (``"auto"``, ``"round_robin"``, ...).
        attention: The attention method.
        padding_token_id: The pad id as given.
        options: Further arguments that must agree (``pad_multiple``, ``loss_mask``, ...); tensors
            are hashed by content, other values by their ``repr``.
        hashed: ``False`` (``check_consistency=False``): the content slots stay 0 (no value is
            read); the names, types, shapes and arguments are still compared, and so is this
            flag itself.

    Returns:
        A LongTensor on the batch's device, one slot per entry of :data:`FIELDS`.
    """
    slots: dict[str, torch.Tensor | int] = dict.fromkeys(FIELDS, 0)
    slots["check_consistency"] = 1 if hashed else 2
    slots["batch type"] = _str_hash(type(batch).__name__)
    slots["layout"] = _str_hash(repr(layout))
    slots["attention"] = _str_hash(repr(attention))
    slots["padding_token_id"] = _str_hash(repr(padding_token_id))
    opts = dict(options or {})
    opt_text = []
    other = torch.zeros((), dtype=torch.long)
    scratch: dict[Any, torch.Tensor] = {}  # this call's hash keys and buffers, shared
    for name in sorted(opts):
        v = opts[name]
        opt_text.append(f"{name}={_describe(v)}")
        if isinstance(v, torch.Tensor) and hashed:
            other = other + _content_hash(v, scratch) * (2 * len(opt_text) + 1)
    slots["options"] = _str_hash(";".join(opt_text))
    if not isinstance(batch, Mapping):
        slots["keys"] = _str_hash(_describe(batch))
        return _pack(slots)
    keys = sorted(str(k) for k in batch)
    slots["keys"] = _str_hash(",".join(keys))
    slots["dtypes and shapes"] = _str_hash(
        ";".join(f"{k}:{_describe_entry(k, batch[k])}" for k in batch)
    )
    primary = batch.get("input_ids")
    if primary is None:
        primary = batch.get("inputs_embeds")
    if isinstance(primary, torch.Tensor) and primary.dim() >= 2:
        slots["B"], slots["S"] = int(primary.shape[0]), int(primary.shape[1])
    else:
        slots["B"] = slots["S"] = -1
    for i, key in enumerate(sorted(batch, key=str) if hashed else ()):
        value = batch[key]
        t = _as_hashable_tensor(value)
        field = _CONTENT.get(str(key), "other keys")
        nested = None if t is not None else _nested_ints(value)
        if t is not None:
            h: int | torch.Tensor = _content_hash(t, scratch)
        elif nested is not None:  # per-row seq_lens: one tensor hash, not one per document
            h = _content_hash(nested, scratch) ^ _NESTED_TAG
        else:
            h = _digest(value)
        if field == "other keys":  # the key's name too, so two keys' values cannot swap
            h = h ^ _str_hash(str(key))
            h = h * (2 * i + 3) if isinstance(h, torch.Tensor) else _wrap(h * (2 * i + 3))
        slots[field] = _add(h, slots[field])
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
    flags = [row[0] for row in rows]
    if len(set(flags)) > 1:
        on = [r for r, f in enumerate(flags) if f == 1]
        off = [r for r, f in enumerate(flags) if f != 1]
        return (
            f"the {len(rows)} ranks of the CP group disagree on check_consistency: ranks {on} "
            f"pass True, ranks {off} pass False. It must be the same on every rank (the check "
            "is one collective either way); pass the same value everywhere"
        )
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
        "global rank) and that every rank passes the same layout, attention and pad id, the same "
        "other keywords (options: pad_multiple, loss_mask, extra_token_keys, strict, "
        "attention_cost, num_chunks / cp_sharder) and the same kind of cp_mesh (a 2-D "
        "('cp_outer', 'cp_inner') grid on every rank, or its 1-D flattening on every rank). Pass "
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
    hashed: bool = True,
) -> None:
    """Raise the same ``ValueError`` on every CP rank unless all ranks hold the same batch.

    One all-gather of ``len(FIELDS)`` int64 values; no collective without CP (and no hashing).
    The dispatcher does not call it (its fingerprint rides in the step header); it serves callers
    that check a batch on their own, and ``benchmarks/bench_consistency.py``.

    Args:
        cp_mesh: 1-D CP mesh (already validated) or ``None``.
        batch, layout, attention, padding_token_id, options, hashed: See
            :func:`batch_fingerprint`.

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
        hashed=hashed,
    )
    raise_on_mismatch(_comm.all_gather_fixed(fp, group))


def raise_on_mismatch(table: torch.Tensor | None) -> None:
    """Raise the same ``ValueError`` on every rank if the gathered fingerprints differ.

    Args:
        table: ``[C, len(FIELDS)]`` fingerprints gathered from every CP rank (e.g. riding in the
            step header's all-gather), or ``None`` (no collective ran: nothing to compare).
    """
    message = None if table is None else mismatch_message(table)
    if message is not None:
        raise ValueError(message)


def dispatch_fingerprint(
    cp_mesh: DeviceMesh | None,
    batch: object,
    layout: str,
    attention: str,
    padding_token_id: object,
    options: dict[str, Any],
    hashed: bool = True,
) -> torch.Tensor | None:
    """:func:`batch_fingerprint` of the dispatcher's arguments (``None`` without a CP group).

    A given sharder is compared by its type, layout label and callables (:func:`_sharder_spec`),
    extra keys by their spec, tensors by content;
    ``hashed=False``: no values are read, the fingerprint has the same size. The dispatcher
    sends it in the step header's all-gather and checks it with :func:`raise_on_mismatch`.
    """
    if _comm.cp_group(cp_mesh) is None:
        return None
    described = {
        k: (type(v).__name__ if k == "extra_token_keys" and v is not None else v)
        for k, v in options.items()
    }
    if options.get("cp_sharder") is not None:
        described["cp_sharder"] = _sharder_spec(options["cp_sharder"])
    if options.get("extra_token_keys") is not None:
        described["extra_token_keys"] = repr(sorted(dict(options["extra_token_keys"]).items()))
    return batch_fingerprint(
        batch,
        layout=layout,
        attention=attention,
        padding_token_id=padding_token_id,
        options=described,
        hashed=hashed,
    )


def _sharder_spec(sharder: object) -> str:
    """A given sharder as the ranks must agree on it: its type, layout label and callables
    (functions by name; a ``functools.partial``'s function, arguments and keywords described:
    a closed-form sharder's layout by its fields), not its facts (a used sharder's hold its
    last shard's, which differ by rank)."""
    parts = [type(sharder).__name__, repr(getattr(sharder, "layout", None))]
    for name in ("shard_batch", "local_token_global_indices", "rank_map_fn"):
        parts.append(f"{name}={_callable_spec(getattr(sharder, name, None))}")
    return ";".join(parts)


def _callable_spec(fn: object, depth: int = 0) -> str:
    """A function by its module and qualified name, a ``functools.partial`` by its function and
    its arguments' descriptions (:func:`_describe`), a bound method by its class and name, any
    other callable by its type."""
    if fn is None:
        return "None"
    if isinstance(fn, functools.partial) and depth < 8:
        args = _describe(list(fn.args))
        keywords = _describe([(str(k), _items(v)) for k, v in sorted(fn.keywords.items())])
        return f"partial({_callable_spec(fn.func, depth + 1)}, {args}, {keywords})"
    owner = getattr(fn, "__self__", None)
    name = getattr(fn, "__name__", None)
    if owner is not None and isinstance(name, str):  # a bound method: its object described
        return f"{_describe(owner)}.{name}"
    qualname = getattr(fn, "__qualname__", None)
    if isinstance(qualname, str):
        return f"{getattr(fn, '__module__', '')}.{qualname}"
    return type(fn).__name__


def _items(value: object) -> object:
    """A mapping as its items sorted by key (a list :func:`_describe` reads element by element),
    anything else as it is."""
    if isinstance(value, Mapping):
        return sorted(((str(k), v) for k, v in value.items()), key=lambda kv: kv[0])
    return value


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
    message = verb_mismatch_message(verb, rows)
    if message is not None:
        raise ValueError(message)


def verb_descriptor(t: object, *, seq_dim: object, trim: object, fill: object,
                    grad: object) -> list[int]:  # fmt: skip
    """The :data:`VERB_DESCRIPTOR_LEN` int64 values that describe a verb call (never raises);
    a verb that carries them in its own data collective compares them with
    :func:`verb_mismatch_message`."""
    return _verb_descriptor(t, seq_dim, trim, fill, grad)


def verb_mismatch_message(verb: str, rows: list[list[int]]) -> str | None:
    """The error text when the ranks' descriptors (one row per rank) differ, else ``None``."""
    parts = []
    for field, sl in _verb_field_slices():
        if len({tuple(row[sl]) for row in rows}) > 1:
            values = ", ".join(f"rank {r}: {_readable(field, row)}" for r, row in enumerate(rows))
            parts.append(f"{field} ({values})")
    if not parts:
        return None
    return (
        f"{verb} was called with different tensors or arguments on the {len(rows)} CP "
        f"ranks: {'; '.join(parts)}. Every rank must pass its local shard of the same "
        "per-token tensor (same dtype, same shape) with the same arguments; cast or reshape "
        "before the call"
    )


VERB_DESCRIPTOR_LEN = 2 + _MAX_DIMS + 2 + 4
