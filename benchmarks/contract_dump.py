"""Dump the observable behaviour of cpshard's public dispatch contract, deterministically.

For every layout name (plus a model-owned layout) at CP sizes 1, 2, 3 and 4, on dense batches
(with and without padding, ``attention_mask``, ``labels``, ``loss_mask``, ``inputs_embeds``) and
packed batches (``seq_lens`` / ``cu_seqlens``), it runs ``make_cp_batch_and_ctx`` and
``prepare_cp_forward`` on real gloo ranks and prints every public fact of the result (the
sharded batch, the sharder's captured facts, its ``TokenMeta``, the chosen attention method),
the token verbs (``shard_token_tensor``, ``gather_token_tensor`` and its gradient for both
``grad`` modes), a CP forward of a tiny decoder with its loss, the collectives of every
successful call, and the errors of invalid calls (type and message). Tensors are printed exactly
(dtype, shape, ``tolist()``); one line per item, rank-prefixed, in a fixed order; no timing,
addresses or object ids.

Its use is a refactor check: run it on an untouched tree and on the changed one and compare the
outputs byte for byte::

    PYTHONPATH=src:tests OMP_NUM_THREADS=1 python benchmarks/contract_dump.py > base.txt

Runs in well under two minutes on two CPU cores.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch.distributed.device_mesh import DeviceMesh

import cpshard
from cpshard import loss
from cpshard._comm import CommRecorder
from cpshard.attention.cost import CostModel
from cpshard.launch import run_local_ranks
from cpshard.models.decoder import TinyDecoder, TinyDecoderConfig
from cpshard.models.global_prefix import GlobalPrefixConfig, GlobalPrefixDecoder
from cpshard.names import LAYOUT_NAMES

WORLDS = (1, 2, 3, 4)
VOCAB = 32
PAD = 31


def _fmt(value: Any) -> str:
    """One exact, address-free rendering of a value."""
    if isinstance(value, torch.Tensor):
        return (
            f"tensor(dtype={value.dtype}, shape={tuple(value.shape)}, "
            f"requires_grad={value.requires_grad}, values={value.detach().tolist()})"
        )
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k!r}: {_fmt(value[k])}" for k in sorted(value)) + "}"
    if isinstance(value, list | tuple):
        inner = ", ".join(_fmt(v) for v in value)
        return f"[{inner}]" if isinstance(value, list) else f"({inner})"
    if isinstance(value, DeviceMesh):
        return f"DeviceMesh({value.mesh.tolist()})"
    if callable(value):
        return f"<callable {getattr(value, '__name__', type(value).__name__)}>"
    return repr(value)


# --------------------------------------------------------------------------- batches
def _dense(kind: str) -> dict[str, Any]:
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(0, PAD, (2, 11), generator=g)
    if kind == "plain":
        return {"input_ids": ids}
    if kind == "labels":
        return {"input_ids": ids, "labels": cpshard.shift_labels(ids)}
    if kind == "mask":  # right padding in row 1, attention_mask, labels, position_ids
        mask = torch.ones(2, 11, dtype=torch.long)
        mask[1, 8:] = 0
        ids = ids.masked_fill(mask == 0, PAD)
        labels = cpshard.shift_labels(ids, padding_mask=mask == 0)
        return {"input_ids": ids, "attention_mask": mask, "labels": labels}
    if kind == "embeds":
        emb = torch.randn(1, 9, 4, generator=g)
        return {"inputs_embeds": emb, "labels": torch.randint(0, PAD, (1, 9), generator=g)}
    raise ValueError(kind)


def _packed(kind: str) -> dict[str, Any]:
    g = torch.Generator().manual_seed(11)
    if kind == "seq_lens":
        ids = torch.randint(0, PAD, (1, 10), generator=g)
        seq_lens = [[3, 5, 2]]
        return {
            "input_ids": ids,
            "seq_lens": seq_lens,
            "labels": cpshard.shift_labels_packed(ids, seq_lens=seq_lens),
        }
    if kind == "cu_seqlens":
        ids = torch.randint(0, PAD, (1, 11), generator=g)
        cu = torch.tensor([0, 4, 11])
        return {
            "input_ids": ids,
            "cu_seqlens": cu,
            "labels": cpshard.shift_labels_packed(ids, cu_seqlens=cu),
        }
    if kind == "rows":  # two rows of documents, row 1 with a pad tail
        ids = torch.randint(0, PAD, (2, 7), generator=g)
        seq_lens = [[3, 4], [5]]
        return {
            "input_ids": ids,
            "seq_lens": seq_lens,
            "labels": cpshard.shift_labels_packed(ids, seq_lens=seq_lens),
        }
    raise ValueError(kind)


# --------------------------------------------------------------------------- printing
class Out:
    """Rank-prefixed lines of one case."""

    def __init__(self, rank: int, world: int) -> None:
        self.prefix = f"world={world} rank={rank}"
        self.lines: list[str] = []
        self.case = ""

    def __call__(self, item: str, value: Any) -> None:
        self.lines.append(f"{self.prefix} | {self.case} | {item} = {_fmt(value)}")


def _try(out: Out, item: str, fn: Callable[[], Any]) -> Any:
    """``fn()``, printed as ``item`` (a ``"call"`` prints ``ok`` and the collectives it issued)."""
    recorder = CommRecorder()
    try:
        with recorder:
            value = fn()
    except Exception as e:  # the error is the behaviour being dumped
        value, shown = None, f"raises {type(e).__name__}: {e}"
    else:
        shown = "ok" if item == "call" else value
    out(item, shown)
    if item == "call" and value is not None:  # an error's timing is no contract
        out("collectives", recorder.events)
    return value


def _caller_tensor(batch: dict[str, Any], feature: bool = False) -> torch.Tensor:
    ref = batch.get("input_ids")
    if ref is None:
        ref = batch["inputs_embeds"][..., 0]
    shape = tuple(ref.shape) + ((2,) if feature else ())
    return torch.arange(float(torch.Size(shape).numel())).reshape(shape) + 1.0


def _dump_result(out: Out, cp_mesh: DeviceMesh, batch: dict[str, Any], result: Any) -> None:
    ctx, local, sharder = result
    for key in sorted(local):
        out(f"batch[{key!r}]", local[key])
    out("sharder.layout", sharder.layout)
    for name in (
        "original_seq_len",
        "padded_seq_len",
        "input_row_shape",
        "input_token_stream_positions",
        "rank_map",
        "cp_size",
        "check_consistency",
    ):
        out(f"sharder.{name}", getattr(sharder, name))
    out("sharder.cp_mesh", sharder.cp_mesh)
    out("sharder.local_token_global_indices is None", sharder.local_token_global_indices is None)
    if sharder.local_token_global_indices is not None and sharder.padded_seq_len is not None:
        out(
            "sharder.local_token_global_indices()",
            sharder.local_token_global_indices(
                cp_mesh, sharder.padded_seq_len, torch.device("cpu")
            ),
        )
    facts = ctx.facts
    out("ctx.facts is sharder.facts", facts is sharder.facts)
    out("ctx.factory is None", ctx.factory is None)
    out("facts.attention_method", facts.attention_method)
    out("facts.check_consistency", facts.check_consistency)
    meta = facts.token_meta
    if meta is None:
        out("token_meta", None)
    else:
        out("token_meta.rank", meta.rank)
        out("token_meta.world_size", meta.world_size)
        out("token_meta.local_len", meta.local_len)
        out("token_meta.positions", meta.positions)
        out("token_meta.document_ids", meta.document_ids)
        out("token_meta.local()", meta.local())
        out("token_meta.local_record", meta.local_record)
        # the attention method auto chose (the plan cache's other entries are internal caches)
        out("token_meta attention_method", meta.plan_cache.get("attention_method"))
    # Token verbs, in the caller's coordinates.
    plain = _caller_tensor(batch)
    shard = _try(
        out, "shard_token_tensor(fill=0)", lambda: sharder.shard_token_tensor(plain, fill=0.0)
    )
    _try(
        out,
        "shard_token_tensor(feature, fill=-1)",
        lambda: sharder.shard_token_tensor(_caller_tensor(batch, True), fill=-1.0),
    )
    _try(out, "shard_token_tensor(no fill)", lambda: sharder.shard_token_tensor(plain))
    if shard is None:
        return
    _try(out, "gather_token_tensor()", lambda: sharder.gather_token_tensor(shard))
    _try(out, "gather_token_tensor(trim)", lambda: sharder.gather_token_tensor(shard, trim=True))
    _try(
        out,
        "gather_token_tensor(trim, fill=-5)",
        lambda: sharder.gather_token_tensor(shard, trim=True, fill=-5.0),
    )
    for mode in ("sum", "replicated"):
        local = shard.clone().requires_grad_(True)
        full = sharder.gather_token_tensor(local, grad=mode)
        weights = torch.arange(float(full.numel())).reshape(full.shape)
        (full * weights).sum().backward()
        out(f"gather_token_tensor(grad={mode!r}) grad", local.grad)
    wrong = torch.zeros(plain.shape[0], plain.shape[1] + 5)
    _try(out, "shard_token_tensor(wrong length)", lambda: sharder.shard_token_tensor(wrong))


def _dispatch_cases(out: Out, cp_mesh: DeviceMesh) -> None:
    world = cp_mesh.size()
    dense_kinds = ("plain", "labels", "mask", "embeds")
    packed_kinds = ("seq_lens", "cu_seqlens", "rows")
    for layout in LAYOUT_NAMES:
        for kind in dense_kinds + packed_kinds:
            batch = _dense(kind) if kind in dense_kinds else _packed(kind)
            extra: dict[str, Any] = {}
            if kind == "mask" and layout == "contiguous":
                extra["pad_multiple"] = 2
            if kind == "labels":
                extra["loss_mask"] = (batch["labels"] != -100).long()
            out.case = f"make_cp_batch_and_ctx layout={layout} batch={kind} {sorted(extra)}"
            pad = None if kind == "embeds" else PAD
            result = _try(
                out,
                "call",
                functools.partial(
                    cpshard.make_cp_batch_and_ctx,
                    cp_mesh,
                    batch,
                    layout=layout,
                    padding_token_id=pad,
                    **extra,
                ),
            )
            if result is not None:
                _dump_result(out, cp_mesh, batch, result)
    # The attention methods on one dense and one packed batch.
    for method in ("all_gather", "ring", "ulysses", "selective"):
        for kind in ("labels", "seq_lens"):
            batch = _dense(kind) if kind == "labels" else _packed(kind)
            out.case = f"make_cp_batch_and_ctx attention={method} batch={kind}"
            result = _try(
                out,
                "call",
                functools.partial(
                    cpshard.make_cp_batch_and_ctx,
                    cp_mesh,
                    batch,
                    attention=method,
                    padding_token_id=PAD,
                ),
            )
            if result is not None:
                out("facts.attention_method", result[0].facts.attention_method)
    # check_consistency=False, a given sharder, extra token keys, a cost model.
    batch = _dense("labels")
    batch["advantages"] = torch.arange(22.0).reshape(2, 11)
    out.case = "make_cp_batch_and_ctx extra_token_keys check_consistency=False cost"
    result = _try(
        out,
        "call",
        lambda: cpshard.make_cp_batch_and_ctx(
            cp_mesh,
            batch,
            padding_token_id=PAD,
            extra_token_keys={"advantages": cpshard.TokenKey(seq_dim=1, pad=0.0)},
            check_consistency=False,
            attention_cost=CostModel(),
        ),
    )
    if result is not None:
        _dump_result(out, cp_mesh, batch, result)
    out.case = "make_cp_batch_and_ctx cp_sharder=contiguous(3)"
    given = cpshard.closed_form_sharder(cpshard.ContiguousLayout(3))
    result = _try(
        out,
        "call",
        lambda: cpshard.make_cp_batch_and_ctx(
            cp_mesh, _dense("plain"), cp_sharder=given, padding_token_id=PAD
        ),
    )
    if result is not None:
        _dump_result(out, cp_mesh, _dense("plain"), result)
    del world


def _forward(out: Out, model: torch.nn.Module, ctx: Any, local: dict[str, Any], n: int) -> None:
    with ctx():
        logits = model(input_ids=local["input_ids"], position_ids=local["position_ids"])
    out("logits.logsumexp(-1)", logits.detach().logsumexp(-1))
    labels = local["labels"]
    part = loss.cp_cross_entropy(logits, labels, num_tokens=n)
    out("cp_cross_entropy partial", part)
    out("loss.count_tokens(local, group)", loss.count_tokens(labels, group=ctx.facts.cp_mesh))


def _prepare_cases(out: Out, cp_mesh: DeviceMesh) -> None:
    cfg = TinyDecoderConfig(
        vocab_size=VOCAB, hidden_size=16, num_layers=1, num_heads=2, num_kv_heads=1,
        intermediate_size=32,
    )  # fmt: skip
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = TinyDecoder(cfg)
    for kind in ("labels", "mask", "seq_lens", "cu_seqlens", "rows"):
        for layout in ("auto", "packed", "round_robin"):
            batch = _dense(kind) if kind in ("labels", "mask") else _packed(kind)
            out.case = f"prepare_cp_forward TinyDecoder layout={layout} batch={kind}"
            result = _try(
                out,
                "call",
                functools.partial(
                    cpshard.prepare_cp_forward,
                    model,
                    cp_mesh,
                    batch,
                    padding_token_id=PAD,
                    layout=layout,
                ),
            )
            if result is None:
                continue
            _dump_result(out, cp_mesh, batch, result)
            _forward(out, model, result[0], result[1], loss.count_tokens(batch["labels"]))
    gp_cfg = GlobalPrefixConfig(text=cfg, num_global_tokens=2, block_size=2)
    gp = GlobalPrefixDecoder.from_config(gp_cfg, seed=0)
    for num_chunks in (1, 2):
        batch = _dense("labels")
        out.case = f"prepare_cp_forward GlobalPrefixDecoder num_chunks={num_chunks}"
        result = _try(
            out,
            "call",
            functools.partial(
                cpshard.prepare_cp_forward,
                gp,
                cp_mesh,
                batch,
                padding_token_id=PAD,
                num_chunks=num_chunks,
            ),
        )
        if result is not None:
            _dump_result(out, cp_mesh, batch, result)


def _error_cases(out: Out, cp_mesh: DeviceMesh) -> None:
    """Invalid calls, each on a fresh mesh object (a fresh step record)."""
    world = cp_mesh.size()
    cfg = TinyDecoderConfig(
        vocab_size=VOCAB, hidden_size=16, num_layers=1, num_heads=2, num_kv_heads=1,
        intermediate_size=32,
    )  # fmt: skip
    model = TinyDecoder(cfg)
    dense = _dense("labels")
    ids = dense["input_ids"]
    make, prepare = (
        cpshard.make_cp_batch_and_ctx,
        functools.partial(cpshard.prepare_cp_forward, model),
    )
    cases: list[tuple[str, Callable[..., Any], Any, dict[str, Any]]] = [
        ("layout=bogus", make, dense, {"layout": "bogus"}),
        ("attention=bogus", make, dense, {"attention": "bogus"}),
        ("attention_cost=1", make, dense, {"attention_cost": 1}),
        ("padding_token_id=-1", make, dense, {"padding_token_id": -1}),
        ("padding_token_id=True", make, dense, {"padding_token_id": True}),
        ("padding_token_id=None", make, dense, {"padding_token_id": None}),
        ("batch=list", make, [1, 2], {}),
        ("batch=ids+embeds", make, {"input_ids": ids, "inputs_embeds": torch.zeros(2, 11, 4)}, {}),
        ("batch=seq_lens_padded", make, {"input_ids": ids, "seq_lens_padded": [[11], [11]]}, {}),
        ("pad_multiple=0", make, dense, {"layout": "contiguous", "pad_multiple": 0}),
        ("prepare num_chunks=0", prepare, dense, {"num_chunks": 0}),
        ("prepare padding_token_id=VOCAB", prepare, dense, {"padding_token_id": VOCAB}),
        ("prepare attention=bogus", prepare, dense, {"attention": "bogus"}),
        ("prepare layout=bogus", prepare, dense, {"layout": "bogus"}),
        ("prepare batch=list", prepare, [1], {}),
    ]
    for name, fn, batch, kwargs in cases:
        out.case = f"error {name}"
        fresh = DeviceMesh("cpu", torch.arange(world), mesh_dim_names=("cp",))
        _try(out, "call", functools.partial(_summary, fn, fresh, batch, kwargs))


def _summary(fn: Callable[..., Any], mesh: DeviceMesh, batch: Any, kwargs: Any) -> Any:
    _, local, sharder = fn(mesh, batch, **kwargs)
    return {"layout": sharder.layout, "keys": sorted(local), "padded": sharder.padded_seq_len}


def _rank(cp_mesh: DeviceMesh) -> list[str]:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    warnings.simplefilter("ignore")
    out = Out(cp_mesh.get_local_rank(), cp_mesh.size())
    _dispatch_cases(out, cp_mesh)
    _prepare_cases(out, cp_mesh)
    _error_cases(out, cp_mesh)
    return out.lines


def main() -> None:
    """Print the dump of every CP size to stdout."""
    for world in WORLDS:
        for lines in run_local_ranks(world, _rank, timeout_s=600.0):
            for line in lines:
                print(line)


if __name__ == "__main__":
    main()
