"""Rank functions for the packed-batch sharder tests (top-level so ranks can import them)."""

from __future__ import annotations

import torch
from torch.distributed.device_mesh import DeviceMesh

import cpshard
from cpshard.layouts.balanced import plan_balanced
from cpshard.layouts.documents import PackSpec
from cpshard.layouts.packed import plan_packed
from cpshard.names import ATTENTION_CHOICES, DENSE_LAYOUTS
from cpshard.sharding.labels import shift_labels_packed

SEQ_LENS = [[5, 1, 4], [7, 2], [1, 1, 1, 1, 9]]  # B=3, S=13: rows 0 and 1 end in padding
ROW_LEN = 13


def _plan(layout: str, spec: PackSpec, world: int):  # type: ignore[no-untyped-def]
    return plan_balanced(spec, world) if layout == "balanced" else plan_packed(spec, world)


def packed_round_trip(cp_mesh: DeviceMesh, layout: str, use_cu: bool) -> list[int]:
    """Batch shard matches the plan; verbs round-trip in caller coordinates; nothing mutated."""
    rank, world = cp_mesh.get_local_rank(), cp_mesh.size()
    if use_cu:
        spec = PackSpec.from_seq_lens([[4, 1, 6, 3]], 14)
        pack = {"cu_seqlens": torch.tensor([0, 4, 5, 11, 14], dtype=torch.int32)}
    else:
        spec = PackSpec.from_seq_lens(SEQ_LENS, ROW_LEN)
        pack = {"seq_lens": SEQ_LENS}
    bsz, seq = spec.num_rows, spec.row_len
    ids = torch.arange(1, bsz * seq + 1).reshape(bsz, seq)
    labels = shift_labels_packed(ids, spec)
    batch = {"input_ids": ids, "labels": labels, "attention_mask": ~spec.padding_mask(), **pack}
    before = {k: v.clone() for k, v in batch.items() if isinstance(v, torch.Tensor)}
    _, out, sharder = cpshard.make_cp_batch_and_ctx(
        cp_mesh, batch, layout=layout, padding_token_id=0
    )
    for k, v in before.items():
        assert torch.equal(batch[k], v), k
    plan = _plan(layout, spec, world)
    mine = plan.rank_map[rank]
    assert sharder.layout == layout and sharder.local_token_global_indices is None
    assert torch.equal(sharder.rank_map, plan.rank_map)
    assert sharder.padded_seq_len == plan.padded_len and sharder.original_seq_len is None
    assert sharder.input_row_shape == (bsz, seq)
    assert torch.equal(sharder.input_token_stream_positions, plan.input_token_stream_positions)
    assert "seq_lens" not in out and "cu_seqlens" not in out
    assert torch.equal(out["input_ids"][0], plan.to_stream(ids, 0)[mine])  # ids start at 1
    assert torch.equal(out["labels"][0], plan.to_stream(labels, -100)[mine])
    assert torch.equal(out["position_ids"][0], plan.stream_position_ids[mine])
    assert torch.equal(out["padding_mask"][0], plan.stream_padding_mask[mine])
    meta = sharder.token_meta
    assert meta is not None
    pos, doc = meta.local()
    assert torch.equal(pos[0], mine)
    real = plan.stream_document_ids[mine] >= 0
    assert torch.equal(doc[0][real], plan.stream_document_ids[mine][real])
    assert bool((doc[0][~real] < 0).all())
    # verbs in caller coordinates, several dtypes and trailing dims
    valid = plan.input_token_stream_positions >= 0
    g = torch.Generator().manual_seed(5)  # the same tensors on every rank
    for x, fill in (
        (torch.randn(bsz, seq, generator=g), 0.0),
        (torch.randn(bsz, seq, 3, generator=g).double(), -1.5),
        (torch.randint(0, 9, (bsz, seq), generator=g), 7),
        (torch.rand(bsz, seq, generator=g) > 0.5, False),
    ):
        local = sharder.shard_token_tensor(x, fill=fill)
        assert local.shape[:2] == (1, plan.local_len)
        back = sharder.gather_token_tensor(local, trim=True, fill=fill)
        expect = x.clone()
        expect[~valid] = fill
        assert torch.equal(back, expect), (x.dtype, tuple(x.shape))
        stream = sharder.gather_token_tensor(local)
        assert torch.equal(stream[0], plan.to_stream(x, fill))
    assert torch.equal(
        sharder.gather_token_tensor(out["input_ids"], trim=True, fill=-1)[valid], ids[valid]
    )
    return mine.tolist()


def packed_embeds_grad(cp_mesh: DeviceMesh, layout: str) -> None:
    """inputs_embeds that require grad shard out of place; gradients reach the caller's tensor."""
    rank, world = cp_mesh.get_local_rank(), cp_mesh.size()
    spec = PackSpec.from_seq_lens(SEQ_LENS, ROW_LEN)
    emb = torch.randn(3, ROW_LEN, 4, generator=torch.Generator().manual_seed(0), requires_grad=True)
    _, out, _ = cpshard.make_cp_batch_and_ctx(
        cp_mesh,
        {"inputs_embeds": emb, "seq_lens": SEQ_LENS},
        layout=layout,  # type: ignore[arg-type]
    )
    (out["inputs_embeds"].sum() * (rank + 1)).backward()
    plan = _plan(layout, spec, world)
    owner = torch.empty(plan.padded_len, dtype=torch.long)
    owner[plan.rank_map.reshape(-1)] = torch.arange(world).repeat_interleave(plan.local_len)
    pos = plan.input_token_stream_positions
    # this rank's loss reaches exactly the caller tokens it owns, with weight rank + 1
    mine = (pos >= 0) & (owner[pos.clamp(min=0)] == rank)
    expect = torch.where(mine, rank + 1.0, 0.0)
    assert emb.grad is not None
    torch.testing.assert_close(emb.grad, expect[..., None].expand(-1, -1, 4))


def packed_errors(cp_mesh: DeviceMesh) -> None:
    import pytest

    ids = torch.zeros(2, 4, dtype=torch.long)
    with pytest.raises(ValueError, match=r"cu_seqlens describes one \[1, T\] stream"):
        cpshard.make_cp_batch_and_ctx(
            cp_mesh, {"input_ids": ids, "cu_seqlens": torch.tensor([0, 8])}
        )
    with pytest.raises(ValueError, match=r"seq_lens has 1 rows but the batch has B=2"):
        cpshard.make_cp_batch_and_ctx(cp_mesh, {"input_ids": ids, "seq_lens": [[4]]})
    with pytest.raises(ValueError, match=r"seq_lens of row 0: must sum to <= the row length S=4"):
        cpshard.make_cp_batch_and_ctx(cp_mesh, {"input_ids": ids, "seq_lens": [[5], [1]]})
    with pytest.raises(ValueError, match=r"cannot express"):
        cpshard.make_cp_batch_and_ctx(
            cp_mesh, {"input_ids": ids, "seq_lens": [[4], [1]]}, layout="round_robin"
        )


def packed_corpus_batch(cp_mesh: DeviceMesh) -> None:
    """The shipped corpus's packed batch (flat seq_lens, end padding) round-trips."""
    from cpshard.tools import corpus

    ids, seq_lens = corpus.packed_batch(300, max_doc_len=70, seed=1)
    labels = shift_labels_packed(ids, PackSpec.from_seq_lens(seq_lens, 300))
    batch = {"input_ids": ids, "labels": labels, "seq_lens": seq_lens}
    _, out, sharder = cpshard.make_cp_batch_and_ctx(cp_mesh, batch, padding_token_id=corpus.PAD_ID)
    assert sharder.layout == "balanced"
    real = ids[0, : sum(seq_lens)]
    back = sharder.gather_token_tensor(out["input_ids"], trim=True, fill=corpus.PAD_ID)
    assert torch.equal(back[0, : sum(seq_lens)], real)
    assert bool((back[0, sum(seq_lens) :] == corpus.PAD_ID).all())
    got = sharder.gather_token_tensor(out["labels"], trim=True, fill=-100)
    assert torch.equal(got, labels)


def packed_from_positions(cp_mesh: DeviceMesh, layout: str) -> None:
    """Documents described by restarting position_ids shard exactly like seq_lens."""
    spec = PackSpec.from_seq_lens(SEQ_LENS, ROW_LEN)
    ids = torch.arange(1, spec.num_rows * ROW_LEN + 1).reshape(spec.num_rows, ROW_LEN)
    mask = ~spec.padding_mask()
    by_lens = {"input_ids": ids, "attention_mask": mask, "seq_lens": SEQ_LENS}
    by_pos = {"input_ids": ids, "attention_mask": mask, "position_ids": spec.position_ids()}
    _, a, sa = cpshard.make_cp_batch_and_ctx(cp_mesh, by_lens, layout=layout)  # type: ignore[arg-type]
    _, b, sb = cpshard.make_cp_batch_and_ctx(cp_mesh, by_pos, layout=layout)  # type: ignore[arg-type]
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k
    assert sa.token_meta is not None and sb.token_meta is not None
    assert torch.equal(sa.token_meta.document_ids, sb.token_meta.document_ids)
    # seq_lens as tensors (one per row; rows hold different numbers of documents) == lists
    by_tensors = {**by_lens, "seq_lens": [torch.tensor(r) for r in SEQ_LENS]}
    _, c, _ = cpshard.make_cp_batch_and_ctx(cp_mesh, by_tensors, layout=layout)  # type: ignore[arg-type]
    assert a.keys() == c.keys() and all(torch.equal(a[k], c[k]) for k in a)
    # without layout="packed"/"balanced" restarting positions are just positions (dense)
    _, dense, s_dense = cpshard.make_cp_batch_and_ctx(cp_mesh, by_pos)
    assert s_dense.layout in ("none", "round_robin")


def random_seq_lens(seed: int, rows: int, row_len: int) -> list[list[int]]:
    """Random document lengths per row: every row starts with a 1-token document, lengths
    1..9 (so more 1-token documents), row 0 ends in 1-3 pads, the other rows are full."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for b in range(rows):
        budget = row_len - (int(torch.randint(1, 4, (1,), generator=g)) if b == 0 else 0)
        lens = [1]
        while sum(lens) < budget:
            lens.append(min(int(torch.randint(1, 10, (1,), generator=g)), budget - sum(lens)))
        out.append(lens)
    return out


def _reference_grads(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    go: torch.Tensor,
    spec: PackSpec,
    window: int | None = None,
) -> tuple[torch.Tensor, ...]:
    """fp64 one-process attention in caller coordinates ``[B, S, H, D]``: each document attends
    causally within itself (pads see only themselves); output and ``(dq, dk, dv)``."""
    from _attention_common import reference_with_grads
    from cpshard.sharding.meta import pad_document_ids

    docs = pad_document_ids(spec.document_ids(), spec.padding_mask())
    out, dq, dk, dv = reference_with_grads(
        *(t.transpose(1, 2) for t in (q, k, v, go)), docs, causal=True, window=window
    )
    return tuple(t.transpose(1, 2) for t in (out, dq, dk, dv))


def packed_attention(cp_mesh: DeviceMesh, layout: str, pack: str, seed: int) -> int:
    """Shard a packed batch with the dispatcher, run CP attention on sharded q/k/v (through
    ``cp_attention`` and through ``ctx()`` + plain SDPA, every method), gather output and
    dQ/dK/dV back to caller ``[B, S]`` coordinates and compare real tokens with one process.

    Returns the number of (method, path) cases checked on this rank."""
    world = cp_mesh.size()
    if pack == "seq_lens":
        seq_lens = random_seq_lens(seed, 3, 4 * world + 7)
        spec = PackSpec.from_seq_lens(seq_lens, 4 * world + 7)
        extra: dict[str, object] = {"seq_lens": seq_lens}
    else:
        lens = random_seq_lens(seed, 1, 6 * world + 5)[0]
        spec = PackSpec.from_seq_lens([lens], sum(lens))
        extra = {"cu_seqlens": spec.cu_seqlens()}
    return _attention_case(cp_mesh, layout, spec, extra, seed)


def packed_attention_lens(
    cp_mesh: DeviceMesh, layout: str, seq_lens: list[list[int]], row_len: int
) -> int:
    """:func:`packed_attention` on explicit document lengths (edge cases)."""
    spec = PackSpec.from_seq_lens(seq_lens, row_len)
    return _attention_case(cp_mesh, layout, spec, {"seq_lens": seq_lens}, 0)


def packed_attention_window(cp_mesh: DeviceMesh, layout: str, window: int) -> int:
    """:func:`packed_attention` (seq_lens rows) with a sliding window."""
    seq_lens = random_seq_lens(3, 3, 5 * cp_mesh.size() + 7)
    spec = PackSpec.from_seq_lens(seq_lens, 5 * cp_mesh.size() + 7)
    return _attention_case(cp_mesh, layout, spec, {"seq_lens": seq_lens}, 3, window)


def _attention_case(
    cp_mesh: DeviceMesh,
    layout: str,
    spec: PackSpec,
    extra: dict[str, object],
    seed: int,
    window: int | None = None,
) -> int:
    import torch.nn.functional as F

    from cpshard.attention import cp_attention
    from cpshard.attention.context import active_cp_attention

    world = cp_mesh.size()
    hkv = max(world, 2)  # ulysses splits heads over the CP ranks
    hq, dim = 2 * hkv, 4
    bsz, seq = spec.num_rows, spec.row_len
    g = torch.Generator().manual_seed(100 + seed)  # the same tensors on every rank
    q = torch.randn(bsz, seq, hq, dim, generator=g, dtype=torch.float64)
    k = torch.randn(bsz, seq, hkv, dim, generator=g, dtype=torch.float64)
    v = torch.randn(bsz, seq, hkv, dim, generator=g, dtype=torch.float64)
    go = torch.randn(bsz, seq, hq, dim, generator=g, dtype=torch.float64)
    ref = _reference_grads(q, k, v, go, spec, window)
    real = ~spec.padding_mask()
    ids = torch.arange(1, bsz * seq + 1).reshape(bsz, seq)
    checked = 0
    for method in ATTENTION_CHOICES:  # "auto" too: the dispatcher resolves it per batch
        for path in ("cp_attention", "ctx"):
            ctx, out, sharder = cpshard.make_cp_batch_and_ctx(
                cp_mesh,
                {"input_ids": ids, **extra},
                layout=layout,
                attention=method,  # type: ignore[arg-type]
            )
            # caller [B, S, H, D] -> local [1, L, H, D] -> [1, H, L, D], leaves for the grads
            ql, kl, vl = (
                sharder.shard_token_tensor(t, fill=0.0).transpose(1, 2).requires_grad_()
                for t in (q, k, v)
            )
            gol = sharder.shard_token_tensor(go, fill=0.0).transpose(1, 2)
            if path == "cp_attention":
                o = cp_attention(ql, kl, vl, sharder=sharder, method=method, window=window)
            elif window is None:
                with ctx():
                    o = F.scaled_dot_product_attention(ql, kl, vl, is_causal=True, enable_gqa=True)
            else:  # SDPA cannot carry a window: the context's bound attention (as HF's path)
                with ctx():
                    attn = active_cp_attention()
                    assert attn is not None
                    o = attn(ql, kl, vl, causal=True, window=window)
            (o * gol).sum().backward()
            got = [o.detach(), ql.grad, kl.grad, vl.grad]
            for name, local, want in zip(("out", "dq", "dk", "dv"), got, ref, strict=True):
                assert local is not None
                full = sharder.gather_token_tensor(local.transpose(1, 2), trim=True, fill=0.0)
                assert full.shape == want.shape
                torch.testing.assert_close(
                    full[real], want[real],
                    msg=lambda m, n=name, p=path, me=method: f"{layout} {me} {p} {n}: {m}",
                )  # fmt: skip
            checked += 1
    return checked


def _bad_packed_batches() -> dict[str, tuple[dict[str, object], str, str]]:
    """name -> (batch, layout or "" for the rank's packed layout, expected message regex)."""
    one = torch.arange(8).reshape(1, 8)
    two = torch.arange(8).reshape(2, 4)
    ok_lens = {"input_ids": two, "seq_lens": [[4], [1, 2]]}
    ok_cu = {"input_ids": one, "cu_seqlens": torch.tensor([0, 3, 8])}
    return {
        "cu_not_from_0": (
            {"input_ids": one, "cu_seqlens": torch.tensor([1, 4, 8])},
            "",
            r"cu_seqlens: must start at 0",
        ),
        "cu_decreasing": (
            {"input_ids": one, "cu_seqlens": torch.tensor([0, 5, 4, 8])},
            "",
            r"cu_seqlens: must be strictly increasing.*cu\[1\]=5 >= cu\[2\]=4",
        ),
        "cu_repeated": (
            {"input_ids": one, "cu_seqlens": torch.tensor([0, 4, 4, 8])},
            "",
            r"cu_seqlens: must be strictly increasing",
        ),
        "cu_short_of_stream": (
            {"input_ids": one, "cu_seqlens": torch.tensor([0, 4, 7])},
            "",
            r"cu_seqlens: must end at the stream length T=8; got cu\[-1\]=7",
        ),
        "cu_past_stream": (
            {"input_ids": one, "cu_seqlens": torch.tensor([0, 4, 9])},
            "",
            r"cu_seqlens: must end at the stream length T=8; got cu\[-1\]=9",
        ),
        "cu_with_rows": (
            {"input_ids": two, "cu_seqlens": torch.tensor([0, 8])},
            "",
            r"cu_seqlens describes one \[1, T\] stream, but the batch has B=2",
        ),
        "seq_lens_overflow_row": (
            {"input_ids": two, "seq_lens": [[3, 2], [1]]},
            "",
            r"seq_lens of row 0: must sum to <= the row length S=4",
        ),
        "seq_lens_wrong_rows": (
            {"input_ids": two, "seq_lens": [[4]]},
            "",
            r"seq_lens has 1 rows but the batch has B=2",
        ),
        "seq_lens_negative": (
            {"input_ids": two, "seq_lens": [[3, -1], [2]]},
            "",
            r"negative lengths are not allowed",
        ),
        "seq_lens_zero": (
            {"input_ids": two, "seq_lens": [[3, 0], [2]]},
            "",
            r"empty documents are not allowed",
        ),
        "no_real_tokens": (
            {"input_ids": two, "seq_lens": [[], []]},
            "",
            r"holds no real tokens \(all 2 rows are padding\).*skip the batch",
        ),
        "both_seq_lens_and_cu": (
            {"input_ids": one, "seq_lens": [[8]], "cu_seqlens": torch.tensor([0, 8])},
            "",
            r"exactly one of 'seq_lens'.*got both",
        ),
        "positions_with_inner_padding": (  # documents from positions, pads not a row suffix
            {
                "input_ids": two,
                "position_ids": torch.tensor([[0, 2, 3, 4], [0, 1, 0, 1]]),
                "padding_mask": torch.tensor([[0, 1, 0, 0], [0, 0, 0, 0]], dtype=torch.bool),
            },
            "",
            r"padding_mask row 0: must mark a suffix of the row",
        ),
        **{
            f"{key}_to_{lay}": (batch, lay, rf"which layout='{lay}' cannot express")
            for key, batch in (("seq_lens", ok_lens), ("cu_seqlens", ok_cu))
            for lay in ("none", *DENSE_LAYOUTS)
        },
    }


def _dispatch(cp_mesh: DeviceMesh, batch: dict[str, object], how: str, sharders: dict) -> None:  # type: ignore[type-arg]
    """Shard ``batch`` by layout name, by a closed-form ``cp_sharder`` or via a model hook."""
    from _dispatch_fns import HookModel

    if how == "model":
        cpshard.prepare_cp_forward(HookModel(), cp_mesh, batch)
    elif how.startswith("sharder:"):
        sharder = cpshard.closed_form_sharder(sharders[how.split(":")[1]])
        cpshard.make_cp_batch_and_ctx(cp_mesh, batch, cp_sharder=sharder)
    else:
        cpshard.make_cp_batch_and_ctx(cp_mesh, batch, layout=how)  # type: ignore[arg-type]


def packed_bad_inputs(cp_mesh: DeviceMesh, layout: str) -> list[str]:
    """Every bad packed input raises a clear ValueError on this rank, before any collective (a
    collective after each error proves no rank went ahead); the caller's batch is unchanged.
    Returns the names of the cases that raised."""
    import copy

    import pytest
    import torch.distributed as dist

    world = cp_mesh.size()
    cases = _bad_packed_batches()
    few = torch.arange(6).reshape(2, 3)  # 3 real tokens: too few for world 4
    cases["more_ranks_than_tokens"] = (
        {"input_ids": few, "seq_lens": [[1, 1], [1]]} if world > 3 else {},
        "",
        rf"cannot shard 3 real tokens over world_size={world} CP ranks",
    )
    from cpshard.layouts.closed_form import ContiguousLayout, NoneLayout, RoundRobinLayout

    lens_batch = {"input_ids": torch.arange(8).reshape(2, 4), "seq_lens": [[4], [1, 2]]}
    # closed-form sharders handed over directly (model-owned CP) cannot express documents either
    for closed in (NoneLayout(), ContiguousLayout(), RoundRobinLayout()):
        cases[f"cp_sharder_{closed.name}"] = (
            lens_batch,
            f"sharder:{closed.name}",
            rf"packed documents \(\['seq_lens'\]\), which layout='{closed.name}' cannot",
        )
    if world > 1:  # the model hook runs at cp > 1 and returns a contiguous sharder
        cases["model_owned_contiguous"] = (
            {**lens_batch, "pixel_values": torch.ones(1, 3)},
            "model",
            r"which layout='contiguous' cannot express",
        )
    sharders = {"none": NoneLayout(), "contiguous": ContiguousLayout()}
    sharders["round_robin"] = RoundRobinLayout()
    raised = []
    for name, (batch, lay, match) in cases.items():
        if not batch:
            continue
        before = copy.deepcopy(batch)
        with pytest.raises(ValueError, match=match):
            _dispatch(cp_mesh, batch, lay or layout, sharders)
        assert batch.keys() == before.keys(), name
        for k, v in before.items():
            got = batch[k]
            assert torch.equal(got, v) if isinstance(v, torch.Tensor) else got == v, (name, k)
        raised.append(name)
        flag = torch.ones(1)
        dist.all_reduce(flag, group=cp_mesh.get_group())  # every rank got here
        assert int(flag) == world, name
    return raised


def packed_keys_verbs_grads(cp_mesh: DeviceMesh, layout: str) -> None:
    """labels / loss_mask / extra keys (trailing dims, seq dim 0) shard like the tokens with
    their pad values; the verbs raise clear errors on mismatched shapes; gradients through
    shard -> gather match one process in both ``grad`` modes, trimmed and untrimmed."""
    import pytest
    import torch.distributed as dist

    rank, world = cp_mesh.get_local_rank(), cp_mesh.size()
    spec = PackSpec.from_seq_lens(SEQ_LENS, ROW_LEN)
    bsz, seq = spec.num_rows, ROW_LEN
    g = torch.Generator().manual_seed(11)
    ids = torch.arange(1, bsz * seq + 1).reshape(bsz, seq)
    labels = shift_labels_packed(ids, spec)
    lm = (torch.rand(bsz, seq, generator=g) > 0.3).long()
    adv = torch.randn(bsz, seq, generator=g)
    lp = torch.randn(bsz, seq, 5, generator=g)
    tr = torch.randn(seq, bsz, generator=g)  # sequence on dim 0
    batch = {"input_ids": ids, "labels": labels, "adv": adv, "lp": lp, "tr": tr, "tag": "keep"}
    extra = {"adv": cpshard.TokenKey(1, 0.5), "lp": cpshard.TokenKey(1, -1.0)}
    extra["tr"] = cpshard.TokenKey(0, 9.0)
    _, out, sh = cpshard.make_cp_batch_and_ctx(
        cp_mesh, {**batch, "seq_lens": SEQ_LENS}, layout=layout, loss_mask=lm,  # type: ignore[arg-type]
        extra_token_keys=extra,
    )  # fmt: skip
    plan = _plan(layout, spec, world)
    mine = plan.rank_map[rank]
    assert out["tag"] == "keep"
    for key, full, fill in (
        ("labels", labels, -100),
        ("loss_mask", lm, 0),
        ("adv", adv, 0.5),
        ("lp", lp, -1.0),
    ):
        assert torch.equal(out[key][0], plan.to_stream(full, fill)[mine]), key
    assert out["tr"].shape == (plan.local_len, 1)
    assert torch.equal(out["tr"][:, 0], plan.to_stream(tr.t(), 9.0)[mine])
    # verbs: mismatched shapes raise, naming what is accepted
    x = torch.randn(bsz, seq, dtype=torch.float64, generator=g)
    with pytest.raises(ValueError, match=r"requires `fill` for the padded slots"):
        sh.shard_token_tensor(x)
    for bad in ((bsz, seq + 1), (bsz + 1, seq), (1, bsz * seq)):
        with pytest.raises(ValueError, match=rf"input positions shape \({bsz}, {seq}\)"):
            sh.shard_token_tensor(torch.zeros(bad), fill=0.0)
    local = sh.shard_token_tensor(x, fill=0.0)
    with pytest.raises(ValueError, match=r"requires `fill` for dropped slots"):
        sh.gather_token_tensor(local, trim=True)
    with pytest.raises(ValueError, match=rf"padded_seq_len={plan.padded_len}"):
        sh.gather_token_tensor(torch.zeros(1, plan.local_len + 1))
    with pytest.raises(ValueError, match=r"needs a local \[1, L, \.\.\.\] stream shard"):
        sh.gather_token_tensor(local.unsqueeze(1), seq_dim=2, trim=True, fill=0.0)
    # gradients in both modes against the one-process gradient
    valid = (plan.input_token_stream_positions >= 0).double()
    for mode in ("sum", "replicated"):
        for trim in (True, False):
            xg = x.clone().requires_grad_()
            full = sh.gather_token_tensor(
                sh.shard_token_tensor(xg, fill=0.0) * 2.0, trim=trim, fill=0.0, grad=mode
            )
            # "sum": each rank weighs the gathered tensor differently; "replicated": one loss
            seeds = range(world) if mode == "sum" else [0]
            ws = [torch.randn(full.shape, dtype=torch.float64, generator=_seeded(s)) for s in seeds]
            (full * ws[rank if mode == "sum" else 0]).sum().backward()
            w = sum(ws)
            assert isinstance(w, torch.Tensor)
            if not trim:  # stream weights back to caller coordinates
                w = plan.from_stream(w[0], 0.0)
            assert xg.grad is not None
            grad = xg.grad.clone()
            dist.all_reduce(grad, group=cp_mesh.get_group())
            torch.testing.assert_close(
                grad, 2.0 * w * valid, msg=lambda m, mo=mode, t=trim: f"{mo} trim={t}: {m}"
            )


def _seeded(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(1000 + seed)
