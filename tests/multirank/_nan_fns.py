"""Rank functions for the NaN-isolation tests: a non-finite value in one document of a packed
batch must not reach the other documents (top-level so pool ranks can import them)."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

import cpshard
from _attention_common import inputs, make_case, make_meta, reference_with_grads
from cpshard._comm import cp_group
from cpshard.attention import cp_sdpa
from cpshard.models import TinyDecoder, TinyDecoderConfig

# B=2 rows of 29 tokens: short documents (masked tiles of several documents), end padding
SEQ_LENS = [[5, 9, 3, 1, 7], [6, 10, 8]]
ROW_LEN = 29
BAD = (0, 1, 3)  # row 0, its document 1 (tokens 5..13), the document's 4th token
CONFIG = TinyDecoderConfig(
    vocab_size=40, hidden_size=48, num_layers=2, num_heads=12, num_kv_heads=6,
    intermediate_size=32,
)  # fmt: skip


def documents() -> list[tuple[int, int, int]]:
    """``(row, start, length)`` of every document, in order."""
    out = []
    for row, lens in enumerate(SEQ_LENS):
        start = 0
        for n in lens:
            out.append((row, start, n))
            start += n
    return out


def bad_token() -> tuple[int, int]:
    """``(row, column)`` of the non-finite token (document ``BAD[1]`` of row ``BAD[0]``)."""
    row, doc, offset = BAD
    return row, sum(SEQ_LENS[row][:doc]) + offset


def _embeddings() -> torch.Tensor:
    g = torch.Generator().manual_seed(3)
    return torch.randn(len(SEQ_LENS), ROW_LEN, CONFIG.hidden_size, generator=g).double()


def _model() -> TinyDecoder:
    return TinyDecoder.from_config(CONFIG, seed=0).double()


def decoder_alone_reference() -> list[tuple[torch.Tensor, torch.Tensor]]:
    """One process, each document alone (clean embeddings): its logits and embedding grads."""
    model, emb = _model(), _embeddings()
    out = []
    for row, start, n in documents():
        x = emb[row : row + 1, start : start + n].clone().requires_grad_()
        logits = model.decode(x, torch.arange(n)[None])
        logits.pow(2).sum().backward()
        assert x.grad is not None
        out.append((logits.detach()[0], x.grad[0]))
    return out


def decoder_with_nan_case(
    cp_mesh: DeviceMesh, method: str, layout: str, value: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """:class:`TinyDecoder` on the packed batch under CP, ``value`` (nan / inf) in one element
    of one document's ``inputs_embeds``: the gathered logits and the embedding grads (caller
    coordinates). The loss covers every token, so the bad document's gradients are NaN too."""
    emb = _embeddings()
    row, col = bad_token()
    emb[row, col, 0] = value
    emb.requires_grad_()
    ctx, local, sharder = cpshard.make_cp_batch_and_ctx(
        cp_mesh, {"inputs_embeds": emb, "seq_lens": SEQ_LENS},
        attention=method, layout=layout,  # type: ignore[arg-type]
    )  # fmt: skip
    model = _model()
    with ctx():
        logits = model.decode(local["inputs_embeds"], local["position_ids"])
    logits.pow(2).sum().backward()
    assert emb.grad is not None
    group = cp_group(cp_mesh)
    if group is not None:  # each rank's grads reach the tokens it owns: sum them
        dist.all_reduce(emb.grad, group=group)
    return sharder.gather_token_tensor(logits.detach(), trim=True, fill=0.0), emb.grad


def attention_with_nan_case(
    cp_mesh: DeviceMesh, method: str, layout: str, which: str
) -> dict[str, Any]:
    """``cp_sdpa`` with one NaN in ``which`` (q, k, v or the upstream gradient ``go``) of one
    document of meta row 0 (3 documents per row, distinct per row): local output and grads."""
    rank, world = cp_mesh.get_local_rank(), cp_mesh.size()
    rmap, docs = make_case(layout, world, 45, 2, 6, 0, 2)
    q, k, v, go = inputs(2, 12, 6, rmap.numel(), 8, 0)
    bad = {"q": q, "k": k, "v": v, "go": go}[which]
    bad[0, 1, BAD_SLOT, 2] = float("nan")
    idx = rmap[rank]
    ql, kl, vl = (t.index_select(2, idx).requires_grad_() for t in (q, k, v))
    out = cp_sdpa(
        ql, kl, vl, group=cp_group(cp_mesh), meta=make_meta(rmap, docs, rank), method=method
    )
    (out * go.index_select(2, idx)).sum().backward()
    return {"out": out.detach(), "dq": ql.grad, "dk": kl.grad, "dv": vl.grad, "idx": idx}


BAD_SLOT = 20  # global slot (meta row 0) of the NaN in the attention-level case


def attention_reference(layout: str, world: int) -> dict[str, Any]:
    """One process, clean inputs: output and grads of every token (global order), doc ids."""
    rmap, docs = make_case(layout, world, 45, 2, 6, 0, 2)
    q, k, v, go = inputs(2, 12, 6, rmap.numel(), 8, 0)
    out, dq, dk, dv = reference_with_grads(q, k, v, go, docs, True)
    return {"out": out, "dq": dq, "dk": dk, "dv": dv, "docs": docs}
