"""Rank functions for the 2-D CP attention tests (Ulysses inside cp_inner x a method across
cp_outer); top-level, so pool ranks can import them."""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.nn.functional as F
from _attention_fns import TinyAttention, _backward_and_reduce, hf_padded_batch, tiny_hf_model
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from _attention_common import DTYPES, inputs, local_shards, make_case, make_meta
from cpshard import make_cp_batch_and_ctx, prepare_cp_forward, sync_grads
from cpshard._comm import CommRecorder, cp_group
from cpshard.attention import cp_grid, cp_sdpa


@functools.cache
def grid_mesh(outer: int, inner: int) -> DeviceMesh:
    """This pool rank's 2-D CP mesh ``(cp_outer, cp_inner)`` over every rank (made once per
    rank process: each mesh makes process groups)."""
    return init_device_mesh("cpu", (outer, inner), mesh_dim_names=("cp_outer", "cp_inner"))


def cp2d_case(
    cp_mesh: DeviceMesh,
    inner: int,
    method: str,
    layout: str,
    seq_len: int,
    heads: tuple[int, int],
    dtype: str,
    n_docs: int = 3,
    window: int | None = None,
    sinks: bool = False,
    meta_batch: int = 1,
    causal: bool = True,
) -> dict[str, Any]:
    """Local output and gradients of ``cp_sdpa`` with the grid of a 2-D CP mesh, and the number
    of all-to-alls it ran (the Ulysses exchanges: 2 forward + 2 backward, or 0 when the head
    count sent the call to the outer method over the whole group)."""
    rank, world = cp_mesh.get_local_rank(), cp_mesh.size()
    grid = cp_grid(grid_mesh(world // inner, inner))
    batch, dim = 2, 8
    rmap, docs = make_case(layout, world, seq_len, batch, n_docs, 0, meta_batch)
    q, k, v, go = inputs(batch, heads[0], heads[1], rmap.numel(), dim, 0)
    idx = rmap[rank]
    ql, kl, vl = local_shards((q, k, v), idx, DTYPES[dtype])
    s = None
    if sinks:
        s = torch.linspace(-1.0, 1.0, heads[0], dtype=DTYPES[dtype]).requires_grad_()
    meta = make_meta(rmap, docs, rank)
    with CommRecorder() as rec:
        out = cp_sdpa(
            ql, kl, vl, group=cp_group(cp_mesh), meta=meta, method=method, causal=causal,
            window=window, sinks=s, grid=grid,
        )  # fmt: skip
        (out * go.index_select(2, idx).to(out.dtype)).sum().backward()
    assert ql.grad is not None and kl.grad is not None and vl.grad is not None
    got = {"out": out.detach(), "dq": ql.grad, "dk": kl.grad, "dv": vl.grad, "idx": idx}
    if s is not None:
        assert s.grad is not None
        ds = s.grad.clone()
        torch.distributed.all_reduce(ds, group=cp_group(cp_mesh))  # summed over CP, as DDP does
        got["dsinks"] = ds
    got["all_to_all"] = rec.count("all_to_all")
    return got


def cp2d_error(cp_mesh: DeviceMesh, inner: int, method: str, transpose: bool) -> str:
    """The ValueError ``cp_sdpa`` raises on this rank with a 2-D grid (``transpose``: the grid
    of the transposed mesh, whose flattening is not the CP group's order)."""
    rank, world = cp_mesh.get_local_rank(), cp_mesh.size()
    grid = cp_grid(grid_mesh(world // inner, inner))
    if transpose:  # cp_outer's groups as the inner ones: not the row-major factoring
        grid = type(grid)(grid.outer, grid.inner, grid.inner_size, grid.outer_size)
    rmap, docs = make_case("round_robin", world, 16, 1, 1, 0, 1)
    q, k, v, _ = inputs(1, 4, 2, rmap.numel(), 8, 0)
    idx = rmap[rank]
    try:
        cp_sdpa(
            q.index_select(2, idx), k.index_select(2, idx), v.index_select(2, idx),
            group=cp_group(cp_mesh), meta=make_meta(rmap, docs, rank), method=method, grid=grid,
        )  # fmt: skip
    except ValueError as e:
        return str(e)
    return "no error"


def hf_cp2d_case(
    cp_mesh: DeviceMesh | None, inner: int, method: str, heads: int, checkpoint: bool = False
) -> dict[str, Any]:
    """A tiny Llama (``heads`` query heads, 2 kv heads when they divide, else 1) through
    ``prepare_cp_forward`` with a 2-D CP mesh (``cp_mesh=None``: one process, no CP): full
    logits, loss and the CP-summed parameter grads; the all-to-alls of the forward counted.
    ``checkpoint``: HF gradient checkpointing with cpshard's recompute context (the backward
    recomputes every layer's attention, on the same 2-D groups)."""
    batch = hf_padded_batch("mixed")
    model = tiny_hf_model("llama")
    if heads != model.config.num_attention_heads:
        import transformers as tf

        cfg = model.config.to_dict()
        kv = 2 if heads % 2 == 0 else 1
        cfg.update(
            num_attention_heads=heads, num_key_value_heads=kv, head_dim=8, hidden_size=8 * heads
        )
        torch.manual_seed(0)
        model = tf.LlamaForCausalLM(tf.LlamaConfig(**cfg)).to(torch.float64)
    if checkpoint:
        from cpshard.attention import checkpoint_context_fn

        model.train()
        model.gradient_checkpointing_enable(
            gradient_checkpointing_kwargs={
                "use_reentrant": False, "context_fn": checkpoint_context_fn,
            }
        )  # fmt: skip
    mesh: DeviceMesh | None = None
    if cp_mesh is not None:
        mesh = grid_mesh(cp_mesh.size() // inner, inner)
    ctx, local, sharder = prepare_cp_forward(model, mesh, batch, attention=method)
    with CommRecorder() as rec, ctx():
        logits = model(**{k: v for k, v in local.items() if k != "labels"}).logits
    n = int((batch["labels"] != -100).sum())
    loss = F.cross_entropy(logits.flatten(0, 1), local["labels"].flatten(), reduction="sum") / n
    if cp_mesh is None:
        loss.backward()
        grads = {k: p.grad for k, p in model.named_parameters() if p.grad is not None}
        return {"logits": logits.detach(), "loss": float(loss.detach()), "grads": grads}
    assert sharder.cp_mesh is not None and sharder.cp_mesh.ndim == 1  # sharded on the flattening
    with CommRecorder() as back:
        grads, total = _backward_and_reduce(model, loss, sharder.cp_mesh)
    return {
        "bwd_all_to_all": back.count("all_to_all"),
        "logits": sharder.gather_token_tensor(logits.detach(), trim=True),
        "loss": float(total),
        "grads": grads if cp_mesh.get_local_rank() == 0 else {},
        "all_to_all": rec.count("all_to_all"),
    }


def prepare_2d_refusals(cp_mesh: DeviceMesh) -> list[str]:
    """What ``make_cp_batch_and_ctx`` raises on this rank for ``attention='ulysses'`` on a 2-D CP
    mesh and for a 2-D mesh of other dim names, and what ``sync_grads`` raises for that other
    mesh (a 2-D CP mesh it takes: it sums over its flattening)."""
    batch = {"input_ids": torch.arange(16).reshape(1, 16)}
    msgs = []
    other = init_device_mesh("cpu", (2, 2), mesh_dim_names=("cp_inner", "cp_outer"))
    for mesh, attention in ((grid_mesh(2, 2), "ulysses"), (other, "ring")):
        try:
            make_cp_batch_and_ctx(mesh, batch, attention=attention)
        except ValueError as e:
            msgs.append(str(e))
        else:
            msgs.append("no error")
    try:
        sync_grads(torch.nn.Linear(2, 2), other)
    except ValueError as e:
        msgs.append(str(e))
    return msgs


def grid_on_some_ranks_only(cp_mesh: DeviceMesh) -> str:
    """Ranks 0-1 pass the 2-D CP mesh, ranks 2-3 its flattening (the same group): the first would
    run Ulysses x the outer method, the others the method over the whole group, so the
    collectives would not match. Every rank raises at the prepare's header instead."""
    from cpshard._comm import split_cp_mesh

    grid = grid_mesh(2, 2)
    flat, _ = split_cp_mesh(grid)
    batch = {"input_ids": torch.arange(16).reshape(1, 16)}
    try:
        make_cp_batch_and_ctx(grid if cp_mesh.get_local_rank() < 2 else flat, batch)
    except ValueError as e:
        return str(e)
    return "no error"


def dp_grid_case(cp_mesh: DeviceMesh, method: str) -> dict[str, Any]:
    """4 ranks as dp=2 x (1 cp_outer x 2 cp_inner): the tiny Llama on the CP sub-mesh of a 3-D
    mesh (its flattening is a sub-mesh's), each DP replica the same batch; full logits."""
    mesh = init_device_mesh("cpu", (2, 1, 2), mesh_dim_names=("dp", "cp_outer", "cp_inner"))
    model = tiny_hf_model("llama")
    batch = hf_padded_batch("right")
    ctx, local, sharder = prepare_cp_forward(
        model, mesh["cp_outer", "cp_inner"], batch, attention=method
    )
    with CommRecorder() as rec, ctx():
        logits = model(**{k: v for k, v in local.items() if k != "labels"}).logits
    return {
        "logits": sharder.gather_token_tensor(logits.detach(), trim=True),
        "all_to_all": rec.count("all_to_all"),
    }


def one_process_logits(padding: str) -> torch.Tensor:
    """The tiny Llama's logits on :func:`hf_padded_batch` in one process through
    ``prepare_cp_forward`` without CP."""
    model = tiny_hf_model("llama")
    ctx, local, _ = prepare_cp_forward(model, None, hf_padded_batch(padding))
    with ctx():
        return model(**{k: v for k, v in local.items() if k != "labels"}).logits.detach()


def compiled_2d_case(cp_mesh: DeviceMesh, method: str, fullgraph: bool) -> Any:
    """:class:`TinyAttention` under ``ctx()`` on the 2 x 2 CP mesh: eager vs ``torch.compile``
    output and grads (the compiled module runs twice: the second call must reuse the graph)."""
    import torch._dynamo

    torch._dynamo.reset()
    torch.manual_seed(0)
    model = TinyAttention(16, 4, 2).to(torch.float64)
    x = torch.randn(2, 21, 16, dtype=torch.float64)
    memory = torch.randn(2, 5, 4, dtype=torch.float64)
    ctx, batch, _ = make_cp_batch_and_ctx(
        grid_mesh(2, 2), {"inputs_embeds": x}, attention=method, layout="round_robin"
    )
    xl = batch["inputs_embeds"]
    results = []
    for fn in (model, torch.compile(model, fullgraph=fullgraph, dynamic=False)):
        for _ in range(2):
            model.zero_grad()
            with ctx():
                y = fn(xl, memory)
            y.pow(2).sum().backward()
        results.append((y.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}))
    return results


def grid_checks_per_ctx(cp_mesh: DeviceMesh) -> tuple[int, int]:
    """:class:`TinyAttention` (one CP attention call per forward) under ``ctx()`` on the 2 x 2
    CP mesh, the ctx entered twice, each forward with a backward: how often the grid was checked
    against the CP group ``(at the context's entry, inside the attention calls)``."""
    from unittest import mock

    from cpshard.attention import context, core

    torch.manual_seed(0)
    model = TinyAttention(16, 4, 2).to(torch.float64)
    x = torch.randn(2, 21, 16, dtype=torch.float64)
    memory = torch.randn(2, 5, 4, dtype=torch.float64)
    ctx, batch, _ = make_cp_batch_and_ctx(
        grid_mesh(2, 2), {"inputs_embeds": x}, attention="ring", layout="round_robin"
    )
    with (
        mock.patch.object(context, "check_grid", wraps=context.check_grid) as at_entry,
        mock.patch.object(core, "check_grid", wraps=core.check_grid) as per_call,
    ):
        for _ in range(2):
            model.zero_grad()
            with ctx():
                y = model(batch["inputs_embeds"], memory)
            y.pow(2).sum().backward()
    return at_entry.call_count, per_call.call_count


def training_2d_case(cp_mesh: DeviceMesh, method: str) -> None:
    """3 SGD steps of a TinyDecoder (GQA 4/2) with the 2 x 2 CP mesh passed to both
    ``prepare_cp_forward`` and ``sync_grads`` equal 3 steps of one process on the same batches:
    the losses after each step's sync and the final weights (the attention ran Ulysses inside
    cp_inner: its all-to-alls are counted)."""
    from cpshard.loss import count_tokens, cp_cross_entropy, reduce_for_logging
    from cpshard.models import TinyDecoder, TinyDecoderConfig
    from cpshard.tools.corpus import PAD_ID, VOCAB_SIZE, dense_batch

    cfg = TinyDecoderConfig(vocab_size=VOCAB_SIZE, hidden_size=32, intermediate_size=64)
    globs = [dense_batch(2, 21, seed=3 + step) for step in range(3)]
    ref = TinyDecoder.from_config(cfg, seed=0).double()
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.5)
    ref_losses = []
    for glob in globs:
        loss = cp_cross_entropy(
            ref(glob["input_ids"]), glob["labels"], num_tokens=count_tokens(glob["labels"])
        )
        loss.backward()
        ref_opt.step()
        ref_opt.zero_grad(set_to_none=True)
        ref_losses.append(loss.detach())

    model = TinyDecoder.from_config(cfg, seed=0).double()
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    mesh = grid_mesh(2, 2)
    for glob, want in zip(globs, ref_losses, strict=True):
        ctx, local, sharder = prepare_cp_forward(
            model, mesh, glob, padding_token_id=PAD_ID, attention=method
        )
        with CommRecorder() as rec, ctx():
            logits = model(local["input_ids"], local["position_ids"])
        assert rec.count("all_to_all") == 2 * cfg.num_layers  # Ulysses in and out per layer
        loss = cp_cross_entropy(logits, local["labels"], num_tokens=count_tokens(glob["labels"]))
        loss.backward()
        sync_grads(model, mesh)  # the 2-D mesh itself, as given to prepare_cp_forward
        opt.step()
        opt.zero_grad(set_to_none=True)
        torch.testing.assert_close(reduce_for_logging(loss, sharder.cp_mesh), want)
    start = dict(TinyDecoder.from_config(cfg, seed=0).double().named_parameters())
    got = dict(model.named_parameters())
    moved = 0.0
    for name, p in ref.named_parameters():
        torch.testing.assert_close(got[name], p, msg=lambda m, n=name: f"{n}: {m}")
        moved += float((p - start[name]).abs().sum())
    assert moved > 0  # the steps changed the weights


def u1_grid_auto_case(cp_mesh: DeviceMesh) -> list[dict[str, Any]]:
    """``cp_sdpa(method="auto")`` at world 4 with no grid (1-D) and with the grid of a 4 x 1
    mesh (a 1-wide cp_inner), on a call whose 1-D choice is Ulysses (16 MHA heads of 128,
    random layout): per run the collectives it issued, its output and q/k/v grads."""
    rank, world = cp_mesh.get_local_rank(), cp_mesh.size()
    rmap, docs = make_case("random", world, 200, 1, 1, 0, 1)
    q, k, v, go = inputs(1, 16, 16, rmap.numel(), 128, 0)
    idx = rmap[rank]
    runs = []
    for grid in (None, cp_grid(grid_mesh(world, 1))):
        meta = make_meta(rmap, docs, rank)  # each run its own (its own agreement header)
        ql, kl, vl = local_shards((q, k, v), idx, torch.float64)
        with CommRecorder() as rec:
            out = cp_sdpa(ql, kl, vl, group=cp_group(cp_mesh), meta=meta, method="auto", grid=grid)
            (out * go.index_select(2, idx)).sum().backward()
        runs.append({"events": list(rec.events), "out": out.detach(), "dq": ql.grad,
                     "dk": kl.grad, "dv": vl.grad, "idx": idx})  # fmt: skip
    return runs
