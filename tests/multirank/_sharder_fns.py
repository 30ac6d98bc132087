"""Rank functions for the sharder tests (top-level so ranks can import them)."""

from __future__ import annotations

import contextlib
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.testing import assert_close

import cpshard
from cpshard._comm import cp_rank_and_size
from cpshard.layouts.closed_form import ContiguousLayout, NoneLayout, RoundRobinLayout
from cpshard.layouts.index import padded_length

DTYPES = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "int64": torch.long,
    "bool": torch.bool,
}


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _layout_obj(name: str, pad_multiple: int, world: int) -> Any:
    if name == "contiguous":
        return ContiguousLayout(pad_multiple)
    return RoundRobinLayout() if world > 1 else NoneLayout()


def _make(shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> torch.Tensor:
    x = torch.randn(shape, generator=_gen(seed))
    if dtype == torch.bool:
        return x > 0
    if dtype == torch.long:
        return (x * 100).long()
    return x.to(dtype)


def round_trip(
    cp_mesh: DeviceMesh, layout: str, seq_len: int, shape_kind: str, dtype: str, pad_mult: int
) -> int:
    """shard -> gather(trim=True) is the identity in caller coordinates; shards match the math."""
    rank, world = cp_mesh.get_local_rank(), cp_mesh.size()
    batch = {"input_ids": torch.arange(2 * seq_len).reshape(2, seq_len)}
    _, out, sharder = cpshard.make_cp_batch_and_ctx(
        cp_mesh,
        batch,
        layout=layout,
        pad_multiple=pad_mult,  # type: ignore[arg-type]
    )
    lay = _layout_obj(layout, pad_mult, world)
    padded = lay.padded_length(seq_len, world)
    assert sharder.padded_seq_len == padded and sharder.original_seq_len == seq_len
    local_idx = lay.local_indices(rank, world, padded)
    shapes = {"bs": ((2, seq_len), 1), "bks": ((2, 3, seq_len), 2), "sk": ((seq_len, 3), 0)}
    shape, seq_dim = shapes[shape_kind]
    x = _make(shape, DTYPES[dtype], seed=7)
    fill = False if dtype == "bool" else 0
    local = sharder.shard_token_tensor(x, seq_dim=seq_dim - x.dim() if seq_dim else 0, fill=fill)
    xp = torch.cat(
        [
            x,
            torch.full_like(x.narrow(seq_dim, 0, 1), fill).expand(
                *[padded - seq_len if d == seq_dim else s for d, s in enumerate(x.shape)]
            ),
        ],
        dim=seq_dim,
    )
    assert torch.equal(local, xp.index_select(seq_dim, local_idx))
    assert local.is_contiguous()
    back = sharder.gather_token_tensor(local, seq_dim=seq_dim, trim=True)
    assert torch.equal(back, x)
    full = sharder.gather_token_tensor(local, seq_dim=seq_dim)
    assert torch.equal(full, xp)
    # the padded-length tensor is accepted without fill too
    assert torch.equal(sharder.shard_token_tensor(xp, seq_dim=seq_dim), local)
    if world > 1:
        assert torch.equal(
            out["input_ids"], _pad_ids(batch["input_ids"], padded).index_select(1, local_idx)
        )
    return int(local.shape[seq_dim])


def _pad_ids(ids: torch.Tensor, padded: int, pad_id: int = 0) -> torch.Tensor:
    return torch.cat([ids, ids.new_full((ids.shape[0], padded - ids.shape[1]), pad_id)], 1)


def pad_table(cp_mesh: DeviceMesh, layout: str) -> None:
    """Every key gets its pad value, is sharded like the tokens, and nothing is mutated."""
    rank, world = cp_mesh.get_local_rank(), cp_mesh.size()
    s = 5
    ids = torch.arange(10, 20).reshape(2, s)
    am = torch.tensor([[1, 1, 1, 1, 0], [1, 1, 1, 1, 1]])
    adv = torch.randn(2, s, generator=_gen(1))
    pos3 = torch.arange(s).expand(3, 2, s).clone()
    lm = torch.ones(2, s)
    obj = {"not": "a token"}
    batch = {
        "input_ids": ids,
        "labels": cpshard.shift_labels(ids),
        "attention_mask": am,
        "adv": adv,
        "position_ids": pos3,
        "image_meta": obj,
    }
    snapshot = {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in batch.items()}
    ctx, out, sharder = cpshard.make_cp_batch_and_ctx(
        cp_mesh,
        batch,
        layout=layout,  # type: ignore[arg-type]
        padding_token_id=99,
        loss_mask=lm,
        extra_token_keys={"adv": cpshard.TokenKey(1, -7.5)},
    )
    assert set(batch) == set(snapshot)
    for k, v in snapshot.items():
        if isinstance(v, torch.Tensor):
            assert torch.equal(batch[k], v), k
    assert batch["image_meta"] is obj
    assert out["image_meta"] is obj and "attention_mask" not in out
    padded = sharder.padded_seq_len
    assert padded is not None
    idx = _layout_obj(layout, 1, world).local_indices(rank, world, padded)
    n = padded - s

    def pad(t: torch.Tensor, v: Any, dim: int = 1) -> torch.Tensor:
        shape = list(t.shape)
        shape[dim] = n
        return torch.cat([t, torch.full(shape, v, dtype=t.dtype)], dim)

    assert torch.equal(out["input_ids"], pad(ids, 99).index_select(1, idx))
    assert torch.equal(out["labels"], pad(batch["labels"], -100).index_select(1, idx))
    assert torch.equal(out["loss_mask"], pad(lm, 0).index_select(1, idx))
    assert torch.equal(out["padding_mask"], pad(am == 0, True).index_select(1, idx))
    assert torch.equal(out["adv"], pad(adv, -7.5).index_select(1, idx))
    cont = torch.arange(padded).expand(3, 2, padded)
    assert torch.equal(out["position_ids"], cont.index_select(2, idx))
    meta = sharder.token_meta
    assert meta is not None
    pos, doc = meta.local()
    assert torch.equal(pos[0], idx)
    gpad = pad(am == 0, True)
    expect_doc = torch.where(gpad, -1 - torch.arange(padded), 0).index_select(1, idx)
    assert torch.equal(doc, expect_doc)


def grads(cp_mesh: DeviceMesh, mode: str, trim: bool) -> None:
    """Gradients of shard -> gather match the single-process gradient in both modes."""
    rank, world = cp_mesh.get_local_rank(), cp_mesh.size()
    s = 11
    batch = {"input_ids": torch.zeros(2, s, dtype=torch.long)}
    _, _, sharder = cpshard.make_cp_batch_and_ctx(cp_mesh, batch)
    padded = sharder.padded_seq_len
    assert padded is not None
    x = torch.randn(2, s, dtype=torch.float64, generator=_gen(3), requires_grad=True)
    local = sharder.shard_token_tensor(x, fill=0.0) * 2.0
    full = sharder.gather_token_tensor(local, trim=trim, grad=mode)
    n = s if trim else padded
    if mode == "sum":  # each rank's loss weighs the gathered tensor differently
        weights = [
            torch.randn(2, n, dtype=torch.float64, generator=_gen(100 + r)) for r in range(world)
        ]
        (full * weights[rank]).sum().backward()
        expected = 2.0 * sum(weights)
    else:  # one loss, identical on every rank
        w = torch.randn(2, n, dtype=torch.float64, generator=_gen(100))
        (full * w).sum().backward()
        expected = 2.0 * w
    assert x.grad is not None
    g = x.grad.clone()
    dist.all_reduce(g, group=cp_mesh.get_group())
    assert_close(g, expected[:, :s])


def embeds_grad(cp_mesh: DeviceMesh) -> None:
    """Grad-carrying inputs_embeds shard out of place and gradients reach the caller's leaf."""
    rank, world = cp_mesh.get_local_rank(), cp_mesh.size()
    emb = torch.randn(2, 6, 4, generator=_gen(5), requires_grad=True)
    before = emb.detach().clone()
    _, out, sharder = cpshard.make_cp_batch_and_ctx(cp_mesh, {"inputs_embeds": emb})
    assert torch.equal(emb.detach(), before)
    out["inputs_embeds"].sum().backward()
    padded = sharder.padded_seq_len
    assert padded is not None and emb.grad is not None
    lay = RoundRobinLayout() if world > 1 else NoneLayout()
    owned = torch.zeros(padded)
    owned[lay.local_indices(rank, world, padded)] = 1.0
    assert_close(emb.grad, owned[:6].reshape(1, 6, 1).expand(2, 6, 4))


def mesh_2d_rejected(cp_mesh: DeviceMesh) -> str:
    mesh2 = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "cp"))
    with pytest.raises(ValueError, match=r"must be 1-D .* got a 2-D mesh .*mesh\['cp'\]") as e:
        cpshard.make_cp_batch_and_ctx(mesh2, {"input_ids": torch.zeros(1, 8, dtype=torch.long)})
    # the sub-mesh works
    _, out, _ = cpshard.make_cp_batch_and_ctx(
        mesh2["cp"], {"input_ids": torch.arange(8).reshape(1, 8)}
    )
    assert out["input_ids"].shape == (1, 4)
    return str(e.value)


def bad_gather_raises_everywhere(cp_mesh: DeviceMesh) -> str:
    _, _, sharder = cpshard.make_cp_batch_and_ctx(
        cp_mesh, {"input_ids": torch.zeros(1, 16, dtype=torch.long)}
    )
    with pytest.raises(ValueError, match="gathers to") as e:
        sharder.gather_token_tensor(torch.randn(1, 3))
    with (
        pytest.raises(ValueError, match="original_seq_len=13")
        if False
        else pytest.raises(ValueError, match="padded_seq_len=16")
    ):
        sharder.shard_token_tensor(torch.randn(1, 15))
    dist.barrier(group=cp_mesh.get_group())  # every rank got here: nobody hangs
    return str(e.value)


def original_len_needs_fill(cp_mesh: DeviceMesh) -> None:
    _, _, sharder = cpshard.make_cp_batch_and_ctx(
        cp_mesh, {"input_ids": torch.zeros(1, 13, dtype=torch.long)}
    )
    if sharder.padded_seq_len == 13:
        return
    with pytest.raises(ValueError, match=r"original_seq_len=13 \(with `fill`\).*explicit `fill`"):
        sharder.shard_token_tensor(torch.randn(1, 13))


def _rr_indices(mesh: DeviceMesh | None, padded: int, device: torch.device) -> torch.Tensor:
    rank, world = cp_rank_and_size(mesh)
    return cpshard.round_robin_local_indices(rank, world, padded, device)


def _third_party_shard(kind: str) -> Any:
    """A user's dense round-robin ``shard_batch``: a plain factory (no facts), a factory object
    carrying its facts in a ``facts`` attribute, or a ``CPContext`` of its own."""

    def shard(
        cp_mesh: DeviceMesh | None,
        tp_mesh: DeviceMesh | None,
        batch: dict[str, torch.Tensor],
        *,
        loss_mask: torch.Tensor | None = None,
        padding_token_id: int = 0,
    ) -> Any:
        ids = batch["input_ids"]
        world = cp_rank_and_size(cp_mesh)[1]
        padded = padded_length(ids.shape[1], 2 * world)
        out = {
            "input_ids": _pad_ids(ids, padded).index_select(
                1, _rr_indices(cp_mesh, padded, ids.device)
            )
        }
        facts = cpshard.ShardFacts(ids.shape[1], padded)

        class Carrier:  # any factory may carry its facts
            def __init__(self) -> None:
                self.facts = facts

            def __call__(self) -> Any:
                return contextlib.nullcontext()

        if kind == "plain":
            return contextlib.nullcontext, out
        return (
            Carrier() if kind == "carrier" else cpshard.CPContext(contextlib.nullcontext, facts)
        ), out

    return shard


def third_party_sharders(cp_mesh: DeviceMesh) -> None:
    """A CPSharder built from two callables and a context factory, sharded twice: the facts of
    each shard, and verbs that learn the other ranks' maps (no rank map, no rank_map_fn)."""
    world = cp_mesh.size()
    for kind in ("plain", "carrier", "cpctx"):
        sharder = cpshard.CPSharder(_third_party_shard(kind), _rr_indices)
        for seq in (7, 12):
            ids = torch.arange(1, 2 * seq + 1).reshape(2, seq)
            padded = padded_length(seq, 2 * world)
            ctx, local, again = cpshard.make_cp_batch_and_ctx(
                cp_mesh, {"input_ids": ids}, cp_sharder=sharder
            )
            # the sharder bound to this batch, and the template answering for its latest batch
            assert again.is_bound and again.facts is sharder.facts is ctx.facts
            assert sharder.cp_mesh is cp_mesh
            with ctx(), ctx:  # the user's context, both spellings
                pass
            lengths = (None, None) if kind == "plain" else (seq, padded)
            assert (sharder.original_seq_len, sharder.padded_seq_len) == lengths
            assert sharder.input_row_shape is None and sharder.input_token_stream_positions is None
            assert sharder.rank_map is None and sharder.token_meta is None
            stream = _pad_ids(ids, padded)
            assert torch.equal(sharder.gather_token_tensor(local["input_ids"]), stream)
            want = stream.index_select(1, _rr_indices(cp_mesh, padded, stream.device)).float()
            assert torch.equal(sharder.shard_token_tensor(stream.float()), want)
            if kind != "plain":  # caller coordinates need the captured lengths
                assert torch.equal(sharder.shard_token_tensor(ids.float(), fill=0.0), want)
                assert torch.equal(sharder.gather_token_tensor(local["input_ids"], trim=True), ids)


def facts_replaced_per_shard(cp_mesh: DeviceMesh, layout: str) -> None:
    """A sharder given again shards with its template: the sharder it returns holds exactly the
    facts a fresh one gets for the new batch, while the first sharder and ctx keep the first
    batch's facts (a bound sharder never goes stale)."""
    if layout in ("packed", "balanced"):
        first: dict[str, Any] = {
            "input_ids": torch.arange(1, 13).reshape(2, 6),
            "seq_lens": [[3, 2], [4, 1]],
        }
        second: dict[str, Any] = {
            "input_ids": torch.arange(1, 12).reshape(1, 11),
            "seq_lens": [[5, 4, 2]],
        }
    else:
        first = {"input_ids": torch.arange(1, 15).reshape(2, 7)}
        second = {"input_ids": torch.arange(1, 31).reshape(3, 10)}
    kw: dict[str, Any] = {"layout": layout, "pad_multiple": 3}
    ctx1, _, sharder = cpshard.make_cp_batch_and_ctx(cp_mesh, first, **kw)
    facts1 = sharder.facts
    _, _, fresh = cpshard.make_cp_batch_and_ctx(cp_mesh, second, **kw)
    ctx2, _, again = cpshard.make_cp_batch_and_ctx(cp_mesh, second, cp_sharder=sharder)
    assert again is not sharder and ctx1.facts is facts1 and ctx2.facts is again.facts
    assert sharder.facts is facts1  # the first batch's sharder still answers for it
    for name in ("original_seq_len", "padded_seq_len", "input_row_shape"):
        assert getattr(again, name) == getattr(fresh, name), name
    for name in ("input_token_stream_positions", "rank_map"):
        a, b = getattr(again, name), getattr(fresh, name)
        assert (a is None) == (b is None) and (a is None or torch.equal(a, b)), name
    m, f = again.token_meta, fresh.token_meta
    assert m is not None and f is not None and (m.rank, m.world_size) == (f.rank, f.world_size)
    assert torch.equal(m.positions, f.positions) and torch.equal(m.document_ids, f.document_ids)
    assert again.facts is not facts1 and facts1.token_meta is not m
    assert facts1.original_seq_len == (None if layout in ("packed", "balanced") else 7)
