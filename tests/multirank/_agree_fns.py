"""Rank functions of ``test_agree.py``: one rank's CP attention call differs from its peers'.

Every route into CP attention is run with rank 1 alone in another dtype (bf16 tensors, or an
autocast region on rank 1 only) or with another head count (the same weights split into other
heads: the prepare's parameter fingerprint cannot see it). Every rank must raise the same clear
``ValueError`` before the K/V exchange (before the fix gloo aborted rank 1, or the ranks hung);
then the same ranks run the call correctly and match one process (the group is still usable).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh
from torch.testing import assert_close

import cpshard
from cpshard.attention import cp_attention
from cpshard.layouts.closed_form import RoundRobinLayout
from cpshard.models import TinyDecoder, TinyDecoderConfig
from cpshard.sharding.batch import shard_batch_dense
from cpshard.sharding.sharder import CPContext, CPSharder

B, S, H, D = 2, 24, 2, 8  # S: no CP padding at C = 2, 3
ROUTES = ("direct", "direct_in_ctx", "model_owned", "sdpa", "hf")
DIFFS = ("dtype", "heads")
# what each route's error says (cpshard.attention.agree, or the step header of a tracked ctx())
UNTRACKED = "the CP ranks called CP attention with different inputs"
TRACKED = "the first CP attention call's dtypes, head counts, head dims"


def _qkv(heads: int, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(3)
    return tuple(
        torch.randn(B, heads, S, D, generator=gen, dtype=torch.float64).to(dtype) for _ in range(3)
    )


def _local(x: torch.Tensor, sharder: Any) -> torch.Tensor:
    """``x [B, H, S, D]`` -> this rank's ``[B, H, L, D]`` (tokens on dim 2)."""
    local: torch.Tensor = sharder.shard_token_tensor(x.transpose(1, 2)).transpose(1, 2)
    return local


def _own_context_shard(
    cp_mesh: DeviceMesh | None, tp_mesh: DeviceMesh | None, batch: dict[str, Any], **kw: Any
) -> Any:
    """A model-owned shard: its own context (no cpshard SDPA routing), the token meta kept."""
    ctx, out = shard_batch_dense(cp_mesh, tp_mesh, batch, layout=RoundRobinLayout(), **kw)
    return CPContext(contextlib.nullcontext, ctx.facts), out


def _prepare(cp_mesh: DeviceMesh, ids: torch.Tensor, owned: bool) -> tuple[Any, Any]:
    own = CPSharder(shard_batch=_own_context_shard, local_token_global_indices=None)
    ctx, _, sharder = cpshard.make_cp_batch_and_ctx(
        cp_mesh, {"input_ids": ids}, cp_sharder=own if owned else None
    )
    return ctx, sharder


def _direct(cp_mesh: DeviceMesh, diff: str, odd: bool, route: str) -> str:
    heads, dtype = H, torch.float32
    if odd and diff == "heads":
        heads = 2 * H
    if odd and diff == "dtype":
        dtype = torch.bfloat16
    ids = torch.arange(B * S).view(B, S)
    in_ctx, owned = route != "direct", route == "model_owned"
    ctx, sharder = _prepare(cp_mesh, ids, owned)
    q, k, v = (_local(t, sharder) for t in _qkv(heads, dtype))
    scope = ctx() if in_ctx else contextlib.nullcontext()
    with scope, pytest.raises(ValueError) as info:
        cp_attention(q, k, v, sharder=sharder)
    # the same ranks again, every rank alike: exact against one process, forward and backward
    q, k, v = (_local(t, sharder).requires_grad_() for t in _qkv(H, torch.float32))
    ctx, sharder = _prepare(cp_mesh, ids, owned)
    with ctx() if in_ctx else contextlib.nullcontext():
        out = cp_attention(q, k, v, sharder=sharder)
    out.square().sum().backward()
    full = [t.requires_grad_() for t in _qkv(H, torch.float32)]
    want = F.scaled_dot_product_attention(*full, is_causal=True)
    want.square().sum().backward()
    assert_close(out, _local(want, sharder))
    for got, ref in zip((q, k, v), full, strict=True):
        assert got.grad is not None and ref.grad is not None
        assert_close(got.grad, _local(ref.grad, sharder))
    return str(info.value)


def _tiny_decoder(heads: int) -> TinyDecoder:
    torch.manual_seed(0)  # the same weights on every rank
    return TinyDecoder(TinyDecoderConfig(num_heads=heads, num_kv_heads=heads // 2))


def _tiny_llama(heads: int) -> Any:
    import transformers

    cfg = transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=heads, num_key_value_heads=heads // 2, use_cache=False,
        attn_implementation="sdpa",
    )  # fmt: skip
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg)


@contextlib.contextmanager
def _autocast(on: bool) -> Iterator[None]:
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=on):
        yield


def _model_route(cp_mesh: DeviceMesh, route: str, diff: str, odd: bool) -> str:
    heads = 8 if odd and diff == "heads" else 4  # same weight shapes, other head split
    build = _tiny_decoder if route == "sdpa" else _tiny_llama
    ids = torch.randint(1, 64, (B, S), generator=torch.Generator().manual_seed(4))

    def run(model: Any, local: dict[str, Any]) -> torch.Tensor:
        out = model(local["input_ids"], position_ids=local["position_ids"])
        logits: torch.Tensor = out if isinstance(out, torch.Tensor) else out.logits
        return logits

    model = build(heads)
    ctx, local, _ = cpshard.prepare_cp_forward(model, cp_mesh, {"input_ids": ids})
    with _autocast(odd and diff == "dtype"), ctx(), pytest.raises(ValueError) as info:
        run(model, local)
    # the same ranks again, every rank alike: exact against one process
    model = build(4)
    ctx, local, sharder = cpshard.prepare_cp_forward(model, cp_mesh, {"input_ids": ids})
    with ctx():
        logits = run(model, local)
    want = run(model, {"input_ids": ids, "position_ids": torch.arange(S).expand(B, S)})
    assert_close(sharder.gather_token_tensor(logits, trim=True), want)
    return str(info.value)


def one_rank_differs(cp_mesh: DeviceMesh, route: str, diff: str) -> str:
    """Rank 1 differs (``diff``) on ``route``; the message of the error this rank raised."""
    odd = cp_mesh.get_local_rank() == 1
    if route in ("direct", "direct_in_ctx", "model_owned"):
        return _direct(cp_mesh, diff, odd, route)
    return _model_route(cp_mesh, route, diff, odd)
