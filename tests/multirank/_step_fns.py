"""Rank functions of the step's life (``test_step_life.py``): a rank that leaves a phase of its
step, sync_grads misuse, one-rank differences that crashed, and valid inputs once refused.

Each function returns what its rank saw (an error message, or values to compare), so the test
can check that every rank ended the same way. Out-of-step cases run on pools of their own with a
short process-group timeout (``tests/multirank/test_step_life.py``).
"""

from __future__ import annotations

import contextlib
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

import cpshard
from cpshard.loss import count_tokens, cp_cross_entropy
from cpshard.models import TinyDecoder, TinyDecoderConfig
from cpshard.tools.corpus import PAD_ID, VOCAB_SIZE, dense_batch

ODD_RANK = 1


class Injected(RuntimeError):
    """The failure a case injects on one rank."""


def _model() -> TinyDecoder:
    torch.manual_seed(0)  # the same weights on every rank
    return TinyDecoder(TinyDecoderConfig(vocab_size=VOCAB_SIZE))


def _forward(model: nn.Module, cp_mesh: DeviceMesh, step: int) -> tuple[Any, torch.Tensor, Any]:
    batch = dense_batch(2, 32, seed=step)
    ctx, local, _ = cpshard.prepare_cp_forward(model, cp_mesh, batch, padding_token_id=PAD_ID)
    with ctx():
        logits = model(local["input_ids"], local["position_ids"])
    loss = cp_cross_entropy(logits, local["labels"], num_tokens=count_tokens(batch["labels"]))
    return ctx, loss, local


def _full_step(model: nn.Module, cp_mesh: DeviceMesh, step: int) -> float:
    _, loss, _ = _forward(model, cp_mesh, step)
    loss.backward()
    cpshard.sync_grads(model, cp_mesh)
    model.zero_grad(set_to_none=True)
    return float(cpshard.loss.reduce_for_logging(loss, cp_mesh))


def _raise(*_: Any) -> None:
    raise Injected("injected on one rank")


def leave_the_step(cp_mesh: DeviceMesh, case: str) -> dict[str, Any]:
    """One rank leaves step 1 at a phase boundary and goes on, as a skip-bad-batch loop does.
    Every rank must raise (the same error where both meet a header), and then a full step must
    work on every rank: the ranks are in step again."""
    odd = cp_mesh.get_local_rank() == ODD_RANK
    model = _model()
    _full_step(model, cp_mesh, 0)
    message = ""
    try:
        batch = dense_batch(2, 32, seed=1)
        ctx, local, _ = cpshard.prepare_cp_forward(model, cp_mesh, batch, padding_token_id=PAD_ID)
        with ctx():
            logits = model(local["input_ids"], local["position_ids"])
            if odd and case == "raise_in_ctx_after_forward":
                raise Injected("after the forward, inside ctx()")
        if odd and case == "backward_error":
            logits.register_hook(_raise)  # raises before any CP backward on this rank
        n = count_tokens(batch["labels"])
        loss = cp_cross_entropy(logits, local["labels"], num_tokens=n)
        if not (odd and case == "skip_backward"):
            loss.backward()
        if not (odd and case == "skip_sync"):
            cpshard.sync_grads(model, cp_mesh)
    except Injected:
        pass  # a skip-bad-batch loop: carry on with the next step
    except RuntimeError as e:
        message = str(e)
    after = None
    for _ in range(2):  # the next step; a rank whose header met a peer's error retries it once
        model.zero_grad(set_to_none=True)
        try:
            after = _full_step(model, cp_mesh, 2)
            break
        except RuntimeError as e:
            message = message or str(e)
    return {"message": message, "after": after}


def _raise_in_backward(module: nn.Module, args: Any, out: torch.Tensor) -> None:
    out.register_hook(_raise)


def leave_in_the_middle(cp_mesh: DeviceMesh, case: str) -> str:
    """One rank leaves a phase after its first collective and goes on: it must raise locally at
    its next call, naming what it skipped, without entering a collective (its peers wait in
    theirs until the process-group timeout, or fail as soon as it exits)."""
    odd = cp_mesh.get_local_rank() == ODD_RANK
    model = _model()
    _full_step(model, cp_mesh, 0)
    try:
        batch = dense_batch(2, 32, seed=1)
        ctx, local, _ = cpshard.prepare_cp_forward(model, cp_mesh, batch, padding_token_id=PAD_ID)
        hooks = []
        if odd and case == "forward":  # raises after block 0's CP attention call
            hooks.append(model.blocks[1].register_forward_pre_hook(_raise))
        if odd and case == "backward":  # raises after block 1's CP attention backward
            hooks.append(model.blocks[0].register_forward_hook(_raise_in_backward))
        with ctx():
            logits = model(local["input_ids"], local["position_ids"])
        n = count_tokens(batch["labels"])
        cp_cross_entropy(logits, local["labels"], num_tokens=n).backward()
    except Injected:
        pass  # a skip-bad-batch loop
    for h in hooks:
        h.remove()
    _full_step(model, cp_mesh, 2)
    return "no error"


def every_rank_raises_then_fresh_mesh(cp_mesh: DeviceMesh) -> list[float]:
    """Every rank raises the same error in the middle of the forward and skips the batch: the old
    mesh object refuses (naming the way on), a new mesh object over the same group trains on,
    exactly like a run that never met the bad batch."""
    from torch.distributed.device_mesh import DeviceMesh as _Mesh

    def fresh(mesh: DeviceMesh) -> DeviceMesh:
        return _Mesh.from_group(
            mesh.get_group(), mesh.device_type, mesh_dim_names=mesh.mesh_dim_names
        )

    old = fresh(cp_mesh)  # the pool's own mesh object stays usable for the next tests
    torch.manual_seed(0)
    model, clean = _model(), _model()
    clean.load_state_dict(model.state_dict())
    losses = [_full_step(model, old, 0), _full_step(clean, fresh(cp_mesh), 0)]
    hook = model.blocks[1].register_forward_pre_hook(_raise)  # after block 0's CP call
    with contextlib.suppress(Injected):
        _full_step(model, old, 1)
    hook.remove()
    with pytest.raises(RuntimeError, match=r"DeviceMesh\.from_group"):
        _full_step(model, old, 2)
    mesh = fresh(cp_mesh)
    losses += [_full_step(model, mesh, 2), _full_step(clean, fresh(cp_mesh), 2)]
    assert losses[0] == losses[1] and losses[2] == losses[3], losses
    return losses


# --- sync_grads misuse (every rank makes the same mistake) ----------------------------------
def sync_misuse(cp_mesh: DeviceMesh, case: str) -> str:
    """Forgotten, doubled or per-micro-batch sync_grads raises on every rank; accumulation over
    micro-batches with one sync is legal and matches one big batch."""
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    try:
        if case == "forgotten":
            for step in range(3):
                _, loss, _ = _forward(model, cp_mesh, step)
                loss.backward()
                opt.step()
                opt.zero_grad()
        elif case == "doubled":
            _, loss, _ = _forward(model, cp_mesh, 0)
            loss.backward()
            cpshard.sync_grads(model, cp_mesh)
            cpshard.sync_grads(model, cp_mesh)
        elif case == "per_micro_batch":
            for micro in range(2):
                _, loss, _ = _forward(model, cp_mesh, micro)
                loss.backward()
                cpshard.sync_grads(model, cp_mesh)
        elif case == "accumulate":
            return _accumulate(model, cp_mesh, opt)
        else:
            raise AssertionError(case)
    except RuntimeError as e:
        return str(e)
    return "no error"


def _accumulate(model: nn.Module, cp_mesh: DeviceMesh, opt: torch.optim.Optimizer) -> str:
    """Two micro-batches, one sync, for three optimizer steps (zero_grad in place or to None)."""
    for step in range(3):
        for micro in range(2):
            _, loss, _ = _forward(model, cp_mesh, 10 * step + micro)
            loss.backward()
        cpshard.sync_grads(model, cp_mesh)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=step % 2 == 0)
    # the summed gradient equals the micro-batches' gradients summed one by one
    grads = []
    for micro in range(2):
        _, loss, _ = _forward(model, cp_mesh, 100 + micro)
        loss.backward()
        cpshard.sync_grads(model, cp_mesh)
        grads.append([p.grad.clone() for p in model.parameters()])
        model.zero_grad(set_to_none=True)
    for micro in range(2):
        _, loss, _ = _forward(model, cp_mesh, 100 + micro)
        loss.backward()
    cpshard.sync_grads(model, cp_mesh)
    for p, g0, g1 in zip(model.parameters(), *grads, strict=True):
        torch.testing.assert_close(p.grad, g0 + g1)
    return "no error"


def two_models_one_mesh(cp_mesh: DeviceMesh, doubled: bool) -> str:
    """An actor and a critic trained on one CP mesh (RL): each synced once per step, gradients
    zeroed in place or to None, is legal; syncing the critic twice is the doubled sync."""
    actor, critic = _model(), _model()
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (actor, critic)]
    try:
        for step in range(4):
            for i, model in enumerate((actor, critic)):
                _, loss, _ = _forward(model, cp_mesh, 10 * step + i)
                loss.backward()
            cpshard.sync_grads(actor, cp_mesh)
            cpshard.sync_grads(critic, cp_mesh)
            if doubled and step == 2:
                cpshard.sync_grads(critic, cp_mesh)
            for opt in opts:
                opt.step()
                opt.zero_grad(set_to_none=step % 2 == 0)
    except RuntimeError as e:
        return str(e)
    return "no error"


def sync_on_dp_mesh(cp_mesh: DeviceMesh) -> str:
    """sync_grads given the dp mesh of a dp x cp mesh raises on every rank."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "cp"))
    model = _model()
    _, loss, _ = _forward(model, mesh["cp"], 0)
    loss.backward()
    try:
        cpshard.sync_grads(model, mesh["dp"])
    except ValueError as e:
        return str(e)
    return "no error"


def frozen_on_one_rank(cp_mesh: DeviceMesh, where: str) -> str:
    """A parameter frozen on one rank only: a clear ValueError on every rank."""
    model = _model()
    _, loss, _ = _forward(model, cp_mesh, 0)
    loss.backward()
    if cp_mesh.get_local_rank() == ODD_RANK:
        model.blocks[0].q.weight.requires_grad_(False)
    try:
        if where == "sync":
            cpshard.sync_grads(model, cp_mesh)
        else:
            model.zero_grad(set_to_none=True)
            _forward(model, cp_mesh, 1)
    except ValueError as e:
        return str(e)
    return "no error"


# --- one rank differs -----------------------------------------------------------------------
def check_consistency_on_some_ranks(cp_mesh: DeviceMesh) -> str:
    """check_consistency=False on one rank only: the same ValueError on every rank."""
    batch = dense_batch(2, 32, seed=0)
    flag = cp_mesh.get_local_rank() != ODD_RANK
    try:
        cpshard.make_cp_batch_and_ctx(cp_mesh, batch, check_consistency=flag)
    except ValueError as e:
        return str(e)
    return "no error"


def attention_differs(cp_mesh: DeviceMesh, what: str) -> str:
    """A CP attention call with another dtype or head count on one rank: the same ValueError on
    every rank, before its data collective."""
    batch = dense_batch(2, 32, seed=0)
    ctx, local, _ = cpshard.make_cp_batch_and_ctx(cp_mesh, batch, padding_token_id=PAD_ID)
    n = local["input_ids"].shape[1]
    heads = 4
    dtype = torch.float32
    if cp_mesh.get_local_rank() == ODD_RANK:
        if what == "dtype":
            dtype = torch.float64
        else:
            heads = 2
    q, k, v = (torch.randn(2, heads, n, 8, dtype=dtype) for _ in range(3))
    try:
        with ctx():
            F.scaled_dot_product_attention(q, k, v, is_causal=True)
    except ValueError as e:
        return str(e)
    return "no error"


def mesh_without_this_rank(cp_mesh: DeviceMesh) -> str:
    """A CP mesh that does not contain this rank: a clear ValueError on that rank; the ranks of
    the mesh shard as usual."""
    from torch.distributed.device_mesh import DeviceMesh as Mesh

    sub = Mesh("cpu", torch.tensor([0, 1]), mesh_dim_names=("cp",))
    batch = dense_batch(2, 32, seed=0)
    try:
        _, local, _ = cpshard.make_cp_batch_and_ctx(sub, batch, padding_token_id=PAD_ID)
    except ValueError as e:
        return str(e)
    return f"sharded {tuple(local['input_ids'].shape)}"


# --- valid inputs once refused --------------------------------------------------------------
class _MaskedAttention(nn.Module):
    """A model whose attention hands SDPA an explicit mask: refused inside ctx() on every rank,
    at its first CP attention call."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = _model()
        self.bad = True

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        if self.bad:
            n = input_ids.shape[1]
            q = torch.randn(1, 1, n, 4)
            F.scaled_dot_product_attention(q, q, q, attn_mask=torch.ones(n, n, dtype=torch.bool))
        out: torch.Tensor = self.inner(input_ids, position_ids)
        return out


def every_rank_raised(cp_mesh: DeviceMesh, where: str) -> float:
    """Every rank raises at the same point of a forward; the loop catches it; the next prepare
    with the model works and trains like one process."""
    model = _MaskedAttention()
    batch = dense_batch(2, 32, seed=0)
    ctx, local, _ = cpshard.prepare_cp_forward(model, cp_mesh, batch, padding_token_id=PAD_ID)
    try:
        with ctx():
            if where == "after_forward":
                model.bad = False
            out = model(local["input_ids"], local["position_ids"])
            if where == "after_forward":
                raise Injected(f"every rank, after the forward ({out.shape})")
    except (ValueError, Injected):
        pass
    model.bad = False
    return _full_step(model, cp_mesh, 1)


def mask_dtypes_differ(cp_mesh: DeviceMesh) -> list[int]:
    """An attention_mask that is long on one rank and bool on another, equal values: accepted."""
    batch = dense_batch(2, 32, seed=0)
    mask = batch["attention_mask"]
    batch["attention_mask"] = mask.bool() if cp_mesh.get_local_rank() == ODD_RANK else mask.long()
    _, local, _ = cpshard.make_cp_batch_and_ctx(cp_mesh, batch, padding_token_id=PAD_ID)
    return [int(v) for v in local["input_ids"].reshape(-1)]


def seq_dim_spelled_differently(cp_mesh: DeviceMesh) -> list[float]:
    """gather_token_tensor with seq_dim=1 on one rank and -2 on another (the same dim of a 3-D
    tensor): accepted."""
    batch = dense_batch(2, 32, seed=0)
    _, local, sharder = cpshard.make_cp_batch_and_ctx(cp_mesh, batch, padding_token_id=PAD_ID)
    t = local["position_ids"].to(torch.float32)[..., None].expand(-1, -1, 3)
    seq_dim = -2 if cp_mesh.get_local_rank() == ODD_RANK else 1
    full = sharder.gather_token_tensor(t, seq_dim=seq_dim)
    return [float(v) for v in full[0, :, 0]]


def position_ids_of_two_sections(cp_mesh: DeviceMesh) -> str:
    """3-D position ids ``[2, B, S]`` are not mRoPE ``[3, B, S]``: the same ValueError on every
    rank."""
    batch = dense_batch(2, 32, seed=0)
    pos = torch.arange(32).expand(2, 32)
    batch["position_ids"] = torch.stack([pos, pos])
    try:
        cpshard.make_cp_batch_and_ctx(cp_mesh, batch, padding_token_id=PAD_ID)
    except ValueError as e:
        return str(e)
    return "no error"


class _Opaque(nn.Module):
    """A model whose vocabulary cpshard cannot read (no config, no get_input_embeddings)."""

    def __init__(self) -> None:
        super().__init__()
        self.net = _model()

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.net(input_ids, position_ids)
        return out


def pad_id_outside_vocabulary(cp_mesh: DeviceMesh) -> str:
    """A pad id outside the vocabulary: only the ranks with CP pad slots fail in the embedding."""
    model = _Opaque()
    batch = dense_batch(2, 31, seed=0)  # 31 tokens: round_robin pads one slot on one rank
    try:
        ctx, local, _ = cpshard.prepare_cp_forward(
            model, cp_mesh, batch, padding_token_id=VOCAB_SIZE + 5
        )
        with ctx():
            model(local["input_ids"], local["position_ids"])
    except Exception as e:
        return f"{type(e).__name__}: {e}"
    return "no error"


class _Windowed(nn.Module):
    """Sliding-window CP attention through cp_attention (as a Mistral-style layer would)."""

    def __init__(self, sharder: Any, method: str = "auto") -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8)
        self.sharder = sharder
        self.method = method

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.proj(x).unsqueeze(1)  # [B, 1, L, 8]
        out: torch.Tensor = cpshard.attention.cp_attention(
            h, h, h, sharder=self.sharder, method=self.method, causal=True, window=3
        )
        return out


def window_first_met_compiled(cp_mesh: DeviceMesh, attention: str) -> str:
    """A window first met inside torch.compile(fullgraph=True): a clear error on every rank
    (before any collective), naming the fix (for an explicit method, and for ``"auto"``)."""
    import torch._dynamo

    torch._dynamo.reset()
    torch.manual_seed(0)
    x = torch.randn(2, 16, 8)
    ctx, local, sharder = cpshard.make_cp_batch_and_ctx(
        cp_mesh, {"inputs_embeds": x}, attention=attention
    )
    model = torch.compile(_Windowed(sharder, attention), fullgraph=True, dynamic=False)
    try:
        with ctx():
            model(local["inputs_embeds"])
    except Exception as e:
        text = str(e)
        return text[text.index("CP attention with") :].split("\n")[0]
    return "no error"
