"""Rank functions of real training loops the step record must let through exactly, and of the
silent mistakes it must turn into one clear error on every rank (``test_loop_guards.py``).

Loops run 3 optimizer steps and return what the test compares with one process; error cases
return each rank's message (or ``"no error"``), so the test can check that every rank raised the
same error.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.testing import assert_close

import cpshard
from cpshard.guards.step import NoCPBackwardError, ParameterMismatchError, step_state
from cpshard.loss import count_tokens, cp_cross_entropy, reduce_for_logging
from cpshard.models import TinyDecoder, TinyDecoderConfig
from cpshard.tools.corpus import PAD_ID, VOCAB_SIZE, dense_batch

STEPS = 3
ODD_RANK = 1
_CFG = TinyDecoderConfig(vocab_size=VOCAB_SIZE, hidden_size=32, num_layers=2, intermediate_size=64)


def _model(seed: int = 0) -> TinyDecoder:
    return TinyDecoder.from_config(_CFG, seed=seed).double()


def _fresh(cp_mesh: DeviceMesh) -> DeviceMesh:
    """A new root mesh over the pool's group: a step record of its own (no earlier test's)."""
    return DeviceMesh.from_group(
        cp_mesh.get_group(), cp_mesh.device_type, mesh_dim_names=cp_mesh.mesh_dim_names
    )


def _loss(
    model: nn.Module, cp_mesh: DeviceMesh | None, batch: dict[str, torch.Tensor]
) -> torch.Tensor:
    """This rank's share of the global mean cross-entropy of ``batch`` (forward under ctx())."""
    ctx, local, _ = cpshard.prepare_cp_forward(model, cp_mesh, batch, padding_token_id=PAD_ID)
    with ctx():
        logits = model(local["input_ids"], local["position_ids"])
    n = count_tokens(batch["labels"])
    return cp_cross_entropy(logits, local["labels"], num_tokens=n)


def _weights(*models: nn.Module) -> dict[str, torch.Tensor]:
    return {f"{i}.{k}": p.detach().clone() for i, m in enumerate(models)
            for k, p in m.named_parameters()}  # fmt: skip


# --- loops the record must let through --------------------------------------------------------
def own_all_reduce(cp_mesh: DeviceMesh | None) -> dict[str, Any]:
    """STEPS steps summing the gradients with the user's own all_reduce over the CP group
    instead of sync_grads (was refused at step 2 as a forgotten sync)."""
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    losses = []
    for step in range(STEPS):
        loss = _loss(model, cp_mesh, dense_batch(2, 24, seed=step))
        loss.backward()
        if cp_mesh is not None:
            for p in model.parameters():
                assert p.grad is not None
                dist.all_reduce(p.grad, group=cp_mesh.get_group())
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(reduce_for_logging(loss, cp_mesh))
    return {"losses": torch.stack(losses), "weights": _weights(model)}


class _Head(nn.Module):
    """A model around a shared ``body``: the body's logits times its own per-token scale."""

    def __init__(self, body: nn.Module, seed: int) -> None:
        super().__init__()
        self.body = body
        g = torch.Generator().manual_seed(seed)
        self.scale = nn.Parameter(1 + 0.1 * torch.randn(VOCAB_SIZE, generator=g).double())

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        logits: torch.Tensor = self.body(input_ids, position_ids)
        return logits * self.scale


def shared_module(cp_mesh: DeviceMesh | None, backward: str) -> dict[str, Any]:
    """Two models sharing a module (an actor and a critic on one trunk), each prepared, run and
    synced, for STEPS steps (the shared gradient was summed twice: C times too large).

    ``backward``: ``"separate"`` (one backward per model) or ``"joint"`` (one backward of the
    summed losses); the gradients are zeroed to None and in place on alternate steps.
    """
    body = _model()
    actor, critic = _Head(body, 1), _Head(body, 2)
    params = list({id(p): p for m in (actor, critic) for p in m.parameters()}.values())
    opt = torch.optim.SGD(params, lr=0.5)
    losses = []
    for step in range(STEPS):
        pair = [
            _loss(m, cp_mesh, dense_batch(2, 24, seed=10 * step + i))
            for i, m in enumerate((actor, critic))
        ]
        if backward == "joint":
            (pair[0] + pair[1]).backward()
        else:
            for loss in pair:
                loss.backward()
        cpshard.sync_grads(actor, cp_mesh)
        cpshard.sync_grads(critic, cp_mesh)
        opt.step()
        opt.zero_grad(set_to_none=step % 2 == 0)
        losses += [reduce_for_logging(loss, cp_mesh) for loss in pair]
    return {"losses": torch.stack(losses), "weights": _weights(actor, critic)}


def _actor_synced(mesh: DeviceMesh) -> tuple[nn.Module, nn.Module, nn.Module]:
    """An actor and a critic sharing one body, each run through a CP backward; the actor synced.

    Returns:
        ``(body, actor, critic)``: the shared body, the actor (the caller keeps it alive: the
        sync records of its own parameters go with it) and the critic, whose sync is to come.
    """
    body = _model()
    actor, critic = _Head(body, 1), _Head(body, 2)
    for i, m in enumerate((actor, critic)):
        _loss(m, mesh, dense_batch(2, 24, seed=i)).backward()
    cpshard.sync_grads(actor, mesh)
    return body, actor, critic


def shared_module_synced_twice(cp_mesh: DeviceMesh) -> str:
    """The critic synced twice in one step is still the doubled sync (every rank raises)."""
    mesh = _fresh(cp_mesh)
    _, _actor, critic = _actor_synced(mesh)
    cpshard.sync_grads(critic, mesh)
    try:
        cpshard.sync_grads(critic, mesh)
    except RuntimeError as e:
        return str(e)
    return "no error"


def shared_module_touched_on_one_rank(cp_mesh: DeviceMesh, actor_alive: bool = True) -> str:
    """Between the two syncs one rank alone changes a shared gradient in place: the second sync
    cannot skip it on some ranks and sum it on others; every rank raises the same error.

    ``actor_alive=False``: the actor is gone by the critic's sync (its records with it), so the
    critic's are the group's only records and that rank reads its shared gradient as one
    accumulated into after the sync (a per-micro-batch sync); that verdict is that rank's alone,
    and every rank must still raise (not that rank alone while its peers wait in the header)."""
    mesh = _fresh(cp_mesh)
    body, actor, critic = _actor_synced(mesh)
    if not actor_alive:
        del actor
    if cp_mesh.get_local_rank() == ODD_RANK:
        grad = body.norm.weight.grad
        assert grad is not None
        grad.mul_(1.0)  # an in-place op (a version bump) on this rank only
    try:
        cpshard.sync_grads(critic, mesh)
    except RuntimeError as e:
        return str(e)
    return "no error"


def record_of_the_group(world_mesh: DeviceMesh) -> None:
    """Every ``mesh["cp"]`` of one root mesh (a new object per call) shares the step record;
    another root mesh over the same group (DeviceMesh.from_group) starts its own."""
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "cp"))
    a, b = mesh["cp"], mesh["cp"]
    assert a is not b
    assert step_state(a) is step_state(b) is not None
    assert step_state(_fresh(a)) is not step_state(a)
    assert step_state(mesh["dp"]) is not step_state(a)  # another group, another record


# --- silent mistakes that must raise on every rank --------------------------------------------
class _WithBuffers(nn.Module):
    """A decoder with a persistent buffer (state) and a non-persistent one (a cache)."""

    def __init__(self, state: float, cache: float) -> None:
        super().__init__()
        self.net = _model()
        self.register_buffer("running", torch.full((4,), state, dtype=torch.float64))
        self.register_buffer("cache", torch.full((4,), cache), persistent=False)

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.net(input_ids, position_ids)
        return out


def weights_differ(cp_mesh: DeviceMesh, case: str) -> str:
    """Weights that differ across the CP ranks: the first prepare raises on every rank, naming
    the first parameter or buffer that differs (the logits were silently off)."""
    mesh = _fresh(cp_mesh)
    rank = cp_mesh.get_local_rank()
    odd = rank == ODD_RANK
    if case == "manual_seed(rank)":
        torch.manual_seed(rank)
        model: nn.Module = TinyDecoder(_CFG).double()
    elif case == "persistent_buffer":
        model = _WithBuffers(state=float(odd), cache=0.0)
    elif case == "non_persistent_buffer":  # a cache, not state: not compared
        model = _WithBuffers(state=0.0, cache=float(rank))
    elif case == "check_consistency=False":  # the opt-out reads no values
        torch.manual_seed(rank)
        model = TinyDecoder(_CFG).double()
    else:
        raise AssertionError(case)
    batch = dense_batch(2, 24, seed=0)
    check = case != "check_consistency=False"
    try:
        cpshard.prepare_cp_forward(
            model, mesh, batch, padding_token_id=PAD_ID, check_consistency=check
        )
    except ParameterMismatchError as e:
        return str(e)
    return "no error"


def weights_differ_later(cp_mesh: DeviceMesh, case: str) -> str:
    """Two prepares agree (the second reuses the module tree and the fingerprint's plan the
    model's guard kept); then the weights change on one rank only: the third prepare raises on
    every rank, however they changed."""
    mesh = _fresh(cp_mesh)
    odd = cp_mesh.get_local_rank() == ODD_RANK
    model = _model()
    batch = dense_batch(2, 24, seed=0)
    for step in range(3):
        w = model.embed.weight
        if step == 2 and odd:
            # an update changes every value (the fingerprint reads a strided sample of them)
            if case == "in place":
                with torch.no_grad():
                    w.add_(1e-3)
            elif case == "new storage":
                w.data = w.data + 1e-3
            elif case == "new parameter":
                model.embed.weight = nn.Parameter(w.detach() + 1e-3)
            elif case == "frozen":
                w.requires_grad_(False)
            else:
                raise AssertionError(case)
        try:
            cpshard.prepare_cp_forward(model, mesh, batch, padding_token_id=PAD_ID)
        except (ParameterMismatchError, ValueError) as e:
            return f"step {step}: {e}"
    return "no error"


def forgotten_sync_under_fsdp(world_mesh: DeviceMesh) -> str:
    """FSDP2 over mesh["dp"] (DTensor parameters, the same shard on the CP ranks of a dp row)
    without sync_grads: the next prepare raises on every rank, naming the missing sync."""
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "cp"))
    model = _model()
    fully_shard(model, mesh=mesh["dp"])
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    row = mesh["dp"].get_local_rank()
    try:
        for step in range(STEPS):
            glob = dense_batch(4, 22, seed=step)
            batch = {k: v[2 * row : 2 * row + 2] for k, v in glob.items()}
            ctx, local, _ = cpshard.prepare_cp_forward(
                model, mesh["cp"], batch, padding_token_id=PAD_ID
            )
            with ctx():
                logits = model(local["input_ids"], local["position_ids"])
            n = count_tokens(local["labels"], group=mesh)
            cp_cross_entropy(logits, local["labels"], num_tokens=n, scale=2.0).backward()
            opt.step()  # no sync_grads(model, mesh["cp"])
            opt.zero_grad(set_to_none=True)
    except ParameterMismatchError as e:
        return f"step {step}: {e}"
    return "no error"


def convert_after_sync(cp_mesh: DeviceMesh, case: str) -> str:
    """Two CP steps with ``sync_grads``, then the model converted in place (``nn.Module.to`` swaps
    the tensors: DTensor parameters under FSDP2 always, every parameter with torch's swap flag
    on), then ``load_state_dict`` and one more step: cpshard's records between steps hold no
    reference to a parameter or a gradient, which ``torch.utils.swap_tensors`` would refuse."""
    world = cp_mesh.size()
    mesh = init_device_mesh("cpu", (1, world), mesh_dim_names=("dp", "cp"))
    model = _model()
    if case == "fsdp2":
        fully_shard(model, mesh=mesh["dp"])
    swap = torch.__future__.get_swap_module_params_on_conversion()
    torch.__future__.set_swap_module_params_on_conversion(case == "swap flag" or swap)
    try:
        for step in range(STEPS):
            if step == 2:  # there and back (FSDP2 keeps the dtype it was sharded with)
                model.to(torch.float32).to(torch.float64)
                model.load_state_dict({k: v.clone() for k, v in model.state_dict().items()})
            opt = torch.optim.SGD(model.parameters(), lr=0.1)
            ctx, local, _ = cpshard.prepare_cp_forward(
                model, mesh["cp"], dense_batch(2, 22, seed=step), padding_token_id=PAD_ID
            )
            with ctx():
                logits = model(local["input_ids"], local["position_ids"])
            n = count_tokens(local["labels"], group=mesh["cp"])
            cp_cross_entropy(logits, local["labels"], num_tokens=n).backward()
            cpshard.sync_grads(model, mesh["cp"])
            opt.step()
            opt.zero_grad(set_to_none=True)
    except RuntimeError as e:
        return f"step {step}: {e} <- {e.__cause__}"
    finally:
        torch.__future__.set_swap_module_params_on_conversion(swap)
    return "ok"


def mistakes_after_conversion(cp_mesh: DeviceMesh, case: str) -> str:
    """A synced step, the model converted there and back (``.float().double()``: new storages
    under the same parameter and gradient objects), then a mistake: the sync's checks still see
    it (its record follows the objects, not their storage)."""
    mesh = _fresh(cp_mesh)
    model = _model()
    _loss(model, mesh, dense_batch(2, 24, seed=0)).backward()
    cpshard.sync_grads(model, mesh)
    try:
        if case == "sync again":
            model.float().double()
        elif case == "no CP forward":
            model.zero_grad()
            model.float().double()
            batch = dense_batch(2, 24, seed=1)
            logits = model(batch["input_ids"])  # outside ctx(): no CP attention
            n = count_tokens(batch["labels"])
            cp_cross_entropy(logits, batch["labels"], num_tokens=n).backward()
        else:
            raise AssertionError(case)
        cpshard.sync_grads(model, mesh)
    except (RuntimeError, NoCPBackwardError) as e:
        return f"{type(e).__name__}: {e}"
    return "no error"


def fsdp_gradient_checks(
    world_mesh: DeviceMesh, set_to_none: bool, micro_batches: int, mistake: str
) -> str:
    """FSDP2 over mesh["dp"], synced over mesh["cp"], 3 steps of 1-2 micro-batches: a legal loop
    (either zero_grad) goes through; a sync per micro-batch or twice per step raises. FSDP2 adds
    a backward into the gradient's local shard, leaving the DTensor's own version alone."""
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "cp"))
    model = _model()
    fully_shard(model, mesh=mesh["dp"])
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    try:
        for step in range(STEPS):
            for micro in range(micro_batches):
                _loss(model, mesh["cp"], dense_batch(2, 24, seed=10 * step + micro)).backward()
                if mistake == "per micro-batch":
                    cpshard.sync_grads(model, mesh["cp"])
            if mistake != "per micro-batch":
                cpshard.sync_grads(model, mesh["cp"])
            if mistake == "twice":
                cpshard.sync_grads(model, mesh["cp"])
            opt.step()
            opt.zero_grad(set_to_none=set_to_none)
    except RuntimeError as e:
        return f"step {step}: {e}"
    return "ok"


def no_cp_backward(cp_mesh: DeviceMesh, case: str) -> str:
    """sync_grads on gradients that no CP forward produced (each rank holds the full gradient of
    its batch; the sum multiplied it by the CP size): every rank raises. Legal loops pass."""
    mesh = _fresh(cp_mesh)
    model = _model()
    batch = dense_batch(2, 24, seed=0)
    n = count_tokens(batch["labels"])
    if case == "compiled_forward":
        import torch._dynamo

        torch._dynamo.reset()
        compiled = torch.compile(model, backend="eager", dynamic=False)
    try:
        for step in range(STEPS):
            if case == "forward_outside_ctx":  # prepared, but run on the whole batch outside
                cpshard.prepare_cp_forward(model, mesh, batch, padding_token_id=PAD_ID)
                logits = model(batch["input_ids"])
                labels = batch["labels"]
            elif case == "never_prepared":
                logits, labels = model(batch["input_ids"]), batch["labels"]
            elif case == "second_step_outside_ctx":  # step 0 is right, step 1 is not
                if step == 0:
                    ctx, local, _ = cpshard.prepare_cp_forward(
                        model, mesh, batch, padding_token_id=PAD_ID
                    )
                    with ctx():
                        logits = model(local["input_ids"], local["position_ids"])
                    labels = local["labels"]
                else:
                    logits, labels = model(batch["input_ids"]), batch["labels"]
            elif case == "compiled_forward":  # legal: its CP calls are not tracked, its ctx is
                ctx, local, _ = cpshard.prepare_cp_forward(
                    model, mesh, batch, padding_token_id=PAD_ID
                )
                with ctx():
                    logits = compiled(local["input_ids"], local["position_ids"])
                labels = local["labels"]
            elif case == "ctx_without_model":  # legal: make_cp_batch_and_ctx, no model
                ctx, local, _ = cpshard.make_cp_batch_and_ctx(mesh, batch, padding_token_id=PAD_ID)
                with ctx():
                    logits = model(local["input_ids"], local["position_ids"])
                labels = local["labels"]
            else:
                raise AssertionError(case)
            cp_cross_entropy(logits, labels, num_tokens=n).backward()
            cpshard.sync_grads(model, mesh)
            model.zero_grad(set_to_none=True)
    except NoCPBackwardError as e:
        return f"step {step}: {e}"
    return "no error"


def one_process(fn: Any, *args: Any) -> Any:
    """``fn(None, *args)``: the same loop without CP, in this process."""
    return fn(None, *args)


def compare(got: dict[str, Any], want: dict[str, Any]) -> None:
    assert_close(got["losses"], want["losses"], rtol=1e-6, atol=1e-8)
    assert got["weights"].keys() == want["weights"].keys()
    for name, w in want["weights"].items():
        assert_close(got["weights"][name], w, rtol=1e-6, atol=1e-8, msg=name)
