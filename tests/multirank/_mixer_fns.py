"""Rank functions: hybrid HF models (Mamba, Mamba2, Gated DeltaNet, short convs) under CP.

Each compares one fp64 training step under CP (logits, loss, every parameter gradient summed
over the CP group) with one process running the model on the whole batch without cpshard; a
packed batch's reference runs each document alone (the only exact one-process reference: HF's
own packed forward carries mixer state across documents).
"""

from __future__ import annotations

import copy
import warnings
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh
from torch.testing import assert_close

import cpshard
from _mixer_models import native_served, tiny_hybrid
from cpshard._comm import cp_group
from cpshard.mixers import CPMixerWarning, check_token_mixers, with_token_mixers

__all__ = [
    "gdn_module_alone",
    "hybrid_checkpointed",
    "hybrid_dense",
    "hybrid_packed",
    "hybrid_refusals",
    "mamba2_module_alone",
    "mamba_without_prepare",
]

_GDN = ("qwen3_next", "qwen3_5")


def _close(got: torch.Tensor, want: torch.Tensor, what: str, fp32_kernel: bool) -> None:
    """``assert_close`` in fp64, or at fp32 rounding of the tensor's scale for ``fp32_kernel``.

    transformers' delta rule computes in fp32 whatever the input dtype: a sequence split across
    ranks (its state handed over) rounds in another order than one run: ~1e-7 of the tensor's
    largest entry here (a missing or wrong incoming state is off by more than 1e-3).
    """
    if not fp32_kernel:
        assert_close(got, want, msg=lambda m: f"{what}: {m}")
        return
    scale = max(1.0, float(want.abs().max()))
    assert_close(got, want, rtol=1e-5, atol=2e-6 * scale, msg=lambda m: f"{what}: {m}")


_SEQ_LENS = [5, 1, 4, 3]  # one packed row of 13 tokens: a 1-token document too
# every mixer a Mamba2 copy or a reference Gated DeltaNet: native on in-order shards
_NATIVE = ("mamba2", "granitemoehybrid", "nemotron_h", "qwen3_next", "qwen3_5")


def _ids(rows: int, seq: int, seed: int) -> torch.Tensor:
    return torch.randint(1, 64, (rows, seq), generator=torch.Generator().manual_seed(seed))


def _loss(logits: torch.Tensor, labels: torch.Tensor, n: int) -> torch.Tensor:
    flat = logits.reshape(-1, logits.shape[-1])
    return F.cross_entropy(flat, labels.reshape(-1), ignore_index=-100, reduction="sum") / n


def _grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def _cp_step(
    cp_mesh: DeviceMesh,
    arch: str,
    batch: dict[str, Any],
    layout: str,
    method: str,
    n: int,
    checkpointed: bool = False,
) -> tuple[torch.Tensor, float, dict[str, torch.Tensor]]:
    """Gathered logits ``[B, S, V]``, the loss and the grads summed over the CP group."""
    model = tiny_hybrid(arch)
    if checkpointed:  # HF gradient checkpointing: the mixers are recomputed in backward()
        model.train()
        model.gradient_checkpointing_enable(
            gradient_checkpointing_kwargs={
                "use_reentrant": False,
                "context_fn": cpshard.attention.checkpoint_context_fn,
            }
        )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ctx, local, sharder = cpshard.prepare_cp_forward(
            model, cp_mesh, batch, layout=layout, attention=method
        )
    mixer_warnings = [w for w in caught if issubclass(w.category, CPMixerWarning)]
    # Mamba2 mixers on in-order shards run natively (no generic cost, no warning), where the
    # product serves the installed transformers' mixers natively (else generic, warned)
    native = (
        arch in _NATIVE
        and layout in ("contiguous", "auto")
        and "seq_lens" not in batch
        and native_served(arch)
    )
    want = 1 if cp_mesh.size() > 1 and not native else 0
    assert len(mixer_warnings) == want, [str(w) for w in caught]
    with ctx():
        logits = model(input_ids=local["input_ids"], position_ids=local["position_ids"]).logits
    loss = _loss(logits, local["labels"], n)
    loss.backward()
    grads = _grads(model)
    total = loss.detach().clone()
    group = cp_group(cp_mesh)
    if group is not None:
        for g in grads.values():
            dist.all_reduce(g, group=group)
        dist.all_reduce(total, group=group)
    full = sharder.gather_token_tensor(logits.detach(), trim=True, fill=0.0)
    # No hook outlives the ctx: the model runs as itself again.
    for site in cpshard.mixers.find_token_mixers(model):
        assert not site.module._forward_pre_hooks and not site.module._forward_hooks
    return full, float(total), grads


def _compare(
    got: tuple[torch.Tensor, float, dict[str, torch.Tensor]],
    want: tuple[torch.Tensor, float, dict[str, torch.Tensor]],
    what: str,
    real: torch.Tensor | None = None,
    fp32_kernel: bool = False,
) -> None:
    logits, loss, grads = got
    ref_logits, ref_loss, ref_grads = want
    if real is not None:
        logits, ref_logits = logits[real], ref_logits[real]
    _close(logits, ref_logits, f"{what} logits", fp32_kernel)
    # rounding of the fp32 logits some models return (Mamba casts them): 1e-6 relative
    assert abs(loss - ref_loss) <= 1e-6 * abs(ref_loss), (what, loss, ref_loss)
    assert grads.keys() == ref_grads.keys(), what
    for name, g in ref_grads.items():
        _close(grads[name], g, f"{what} grad {name}", fp32_kernel)


def hybrid_dense(
    cp_mesh: DeviceMesh, arch: str, layout: str, method: str, checkpointed: bool = False
) -> None:
    """Dense ``[2, 13]`` batch: CP == one process, forward and backward, in fp64."""
    ids = _ids(2, 13, 7)
    labels = cpshard.shift_labels(ids)
    n = int((labels != -100).sum())
    ref = tiny_hybrid(arch)
    ref_logits = ref(input_ids=ids).logits
    ref_loss = _loss(ref_logits, labels, n)
    ref_loss.backward()
    want = (ref_logits.detach(), float(ref_loss), _grads(ref))
    batch = {"input_ids": ids, "labels": labels}
    got = _cp_step(cp_mesh, arch, batch, layout, method, n, checkpointed)
    # native Gated DeltaNet: each rank's delta rule starts from a handed-over state
    # (the generic path runs the whole sequence on every rank: fp64-exact)
    split = (
        arch in _GDN
        and layout in ("contiguous", "auto")
        and cp_mesh.size() > 1
        and native_served(arch)
    )
    _compare(got, want, f"{arch} {layout} {method}", fp32_kernel=split)


def hybrid_checkpointed(cp_mesh: DeviceMesh, arch: str, layout: str = "round_robin") -> None:
    """HF gradient checkpointing: the recomputation in backward() runs the mixers exactly
    (``round_robin``: the generic path; ``contiguous``: a native one, exchanging again)."""
    hybrid_dense(cp_mesh, arch, layout, "all_gather", checkpointed=True)


def hybrid_packed(cp_mesh: DeviceMesh, arch: str, layout: str) -> None:
    """One packed row of 4 documents: CP == each document alone, forward and backward."""
    total = sum(_SEQ_LENS)
    ids = _ids(1, total, 9)
    labels = torch.full_like(ids, -100)
    ref = tiny_hybrid(arch)
    pieces, start = [], 0
    for length in _SEQ_LENS:
        doc = ids[:, start : start + length]
        labels[:, start : start + length - 1] = doc[:, 1:]
        pieces.append(ref(input_ids=doc).logits)
        start += length
    ref_logits = torch.cat(pieces, dim=1)
    n = int((labels != -100).sum())
    ref_loss = _loss(ref_logits, labels, n)
    ref_loss.backward()
    want = (ref_logits.detach(), float(ref_loss), _grads(ref))
    batch = {"input_ids": ids, "labels": labels, "seq_lens": [list(_SEQ_LENS)]}
    got = _cp_step(cp_mesh, arch, batch, layout, "all_gather", n)
    _compare(got, want, f"{arch} packed {layout}")


def hybrid_refusals(cp_mesh: DeviceMesh, arch: str) -> list[str]:
    """``strict=True`` refuses on every rank before any collective; the messages."""
    model = tiny_hybrid(arch)
    ids = _ids(1, 12, 3)
    messages = []
    batches: list[dict[str, Any]] = [{"input_ids": ids}]
    if cp_mesh.size() == 1:  # at cp=1 only a packed batch needs the mixers to change
        batches = [{"input_ids": ids, "seq_lens": [[5, 7]]}]
    # at cp > 1 round_robin shards cannot hand a state over: the generic path, refused
    layout = "round_robin" if cp_mesh.size() > 1 else "auto"
    for batch in batches:
        try:
            cpshard.prepare_cp_forward(model, cp_mesh, batch, layout=layout, strict=True)
        except ValueError as e:
            messages.append(str(e))
        else:
            raise AssertionError("strict=True accepted a hybrid model")
    # dense in-order shards: native, strict accepts (where the product serves this
    # transformers' Gated DeltaNet natively; else the generic path, refused like the rest)
    if cp_mesh.size() > 1 and arch in _GDN and native_served(arch):
        with warnings.catch_warnings():
            warnings.simplefilter("error", CPMixerWarning)
            cpshard.prepare_cp_forward(model, cp_mesh, {"input_ids": ids}, strict=True)
    if cp_mesh.size() == 1:  # a dense batch at cp=1 is left alone, even under strict
        ctx, local, _ = cpshard.prepare_cp_forward(model, cp_mesh, {"input_ids": ids}, strict=True)
        with ctx():
            got = model(input_ids=local["input_ids"], position_ids=local["position_ids"]).logits
        assert_close(got, model(input_ids=ids).logits)
    return messages


def mamba_without_prepare(cp_mesh: DeviceMesh) -> None:
    """``make_cp_batch_and_ctx(model=...)`` runs a pure SSM exactly (no attention to switch)."""
    ids = _ids(2, 11, 4)
    ref = tiny_hybrid("mamba")
    want = ref(input_ids=ids).logits
    want.sum().backward()
    model = tiny_hybrid("mamba")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", CPMixerWarning)
        ctx, local, sharder = cpshard.make_cp_batch_and_ctx(
            cp_mesh, {"input_ids": ids}, model=model, layout="contiguous"
        )
    with ctx():
        logits = model(input_ids=local["input_ids"]).logits
    (logits * (local["input_ids"] != 0)[..., None]).sum().backward()  # pads carry no loss
    assert_close(sharder.gather_token_tensor(logits.detach(), trim=True), want.detach())
    group = cp_group(cp_mesh)
    for name, p in model.named_parameters():
        assert p.grad is not None, name
        g = p.grad.clone()
        if group is not None:
            dist.all_reduce(g, group=group)
        ref_grad = dict(ref.named_parameters())[name].grad
        assert_close(g, ref_grad, rtol=1e-5, atol=1e-6, msg=lambda m, k=name: f"{k}: {m}")
    with pytest.raises(ValueError, match="strict=True"):
        cpshard.make_cp_batch_and_ctx(cp_mesh, {"input_ids": ids}, model=model, strict=True)


def gdn_module_alone(cp_mesh: DeviceMesh, arch: str, seq: int) -> None:
    """One Gated DeltaNet module, ``[2, seq, D]`` fp64: native CP == one process, fwd + bwd.

    The module is chosen by the public verdict (``strict=True`` accepts it: native, no generic
    cost) and runs under the batch's ctx on contiguous shards; the input gradient and every
    parameter gradient (summed over the CP group) match the one-process run. Where the product
    does not serve the installed transformers' Gated DeltaNet natively, ``strict=True`` refuses
    it and ``strict=False`` runs the generic path (warned), exact in fp64.
    """
    from torch import nn

    site = cpshard.mixers.find_token_mixers(tiny_hybrid(arch))[0]
    ref_module = site.module
    rows, hidden = 2, ref_module.hidden_size
    gen = torch.Generator().manual_seed(11)
    x = torch.randn(rows, seq, hidden, generator=gen, dtype=torch.float64)
    weight = torch.randn(rows, seq, hidden, generator=gen, dtype=torch.float64)
    xr = x.clone().requires_grad_()
    want = ref_module(xr)
    (want * weight).sum().backward()
    ref_grads = {n: p.grad.detach().clone() for n, p in ref_module.named_parameters()}

    module = copy.deepcopy(ref_module)
    module.zero_grad(set_to_none=True)
    holder = nn.Module()
    holder.layers = nn.ModuleList([module])  # one mixer site, found by its structure
    native = native_served(arch)
    if native or cp_mesh.size() == 1:
        plan = check_token_mixers(holder, cp_mesh.size(), strict=True, packed=False)
    else:
        with pytest.raises(ValueError, match="strict=True"):
            check_token_mixers(holder, cp_mesh.size(), strict=True, packed=False)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            plan = check_token_mixers(holder, cp_mesh.size(), strict=False, packed=False)
        assert [w.category for w in caught] == [CPMixerWarning], caught
        assert not plan.native and len(plan.sites) == 1, plan
    ids = torch.ones(rows, seq, dtype=torch.long)
    ctx, _, sharder = cpshard.make_cp_batch_and_ctx(cp_mesh, {"input_ids": ids}, layout=plan.layout)
    if cp_mesh.size() > 1:
        if native:
            assert plan.layout == "contiguous" and len(plan.gdn) == 1, plan
        ctx = with_token_mixers(ctx, plan, cp_mesh)
    local = sharder.shard_token_tensor(x, fill=0.0).requires_grad_()
    with ctx():
        out = module(local)
    (out * sharder.shard_token_tensor(weight, fill=0.0)).sum().backward()
    assert local.grad is not None
    got = sharder.gather_token_tensor(out.detach(), trim=True)
    # the delta rule computes in fp32: the native path hands states over, and the generic path
    # sums each rank's share of the parameter gradients (fp32-rounded) in another order
    split = cp_mesh.size() > 1
    _close(got, want.detach(), f"{arch} output", split)
    got_dx = sharder.gather_token_tensor(local.grad, trim=True)
    assert xr.grad is not None
    _close(got_dx, xr.grad, f"{arch} input grad", split)
    group = cp_group(cp_mesh)
    for name, p in module.named_parameters():
        assert p.grad is not None, name
        g = p.grad.clone()
        if group is not None:
            dist.all_reduce(g, group=group)
        _close(g, ref_grads[name], f"{arch} grad {name}", split)
    assert not module._forward_pre_hooks and not module._forward_hooks


def _mamba2_with_a_long_tail(chunk: int) -> Any:
    """One fp32 ``Mamba2Mixer`` whose time step follows input channel 0 alone.

    ``dt = softplus(x[..., 0])``: the caller makes it large on a rank's first tokens (their
    decays sum to ``~1e3``) and small after them (a memory of ~100 tokens), the case where a
    state summary taking differences of cumulative decay sums over a whole rank loses digits
    (``A dt ~ 1e3``: ``ulp = 6e-5``).
    """
    import transformers as tf

    cfg = tf.Mamba2Config(
        vocab_size=64, hidden_size=16, state_size=4, num_hidden_layers=1, expand=2,
        num_heads=4, head_dim=8, n_groups=2, chunk_size=chunk, conv_kernel=4, use_cache=False,
    )  # fmt: skip
    torch.manual_seed(0)
    (site,) = cpshard.mixers.find_token_mixers(tf.Mamba2ForCausalLM(cfg))
    module: Any = site.module.float()
    heads = module.num_heads
    with torch.no_grad():
        module.in_proj.weight[:, 0] = 0.0  # channel 0 drives nothing but dt
        module.in_proj.weight[-heads:] = 0.0
        module.in_proj.weight[-heads:, 0] = 1.0
        module.dt_bias.zero_()
        module.A_log.copy_(torch.linspace(-1.0, 0.5, heads))  # A in [-1.6, -0.37]
    return module


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    """``|got - want| / |want|`` (Frobenius norms, in fp64)."""
    got, want = got.detach().double(), want.detach().double()
    return float((got - want).norm() / want.norm())


def mamba2_module_alone(cp_mesh: DeviceMesh, seq: int, chunk: int) -> dict[str, float]:
    """One Mamba2 module, ``[1, seq, 16]`` fp32, native and generic CP vs one process.

    An eighth of each rank's tokens, after its first quarter, has a large time step (``A dt``
    sums to ~1e3 - 5e3 over them), the rest a small one (a memory of ~30-140 tokens: the state
    handed over reaches far into the next rank).
    Returns the relative errors (per tensor: output, input gradient, every parameter gradient
    summed over the CP group) of the native and the generic path against the one-process fp32
    run: ``"native out"``, ``"generic dx"``, ``"native grad <name>"``, ...
    """
    from torch import nn

    ref = _mamba2_with_a_long_tail(chunk)
    world = cp_mesh.size()
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(1, seq, ref.hidden_size, generator=gen)
    per = -(-seq // world)
    at = torch.arange(seq) % per
    big = (at >= per // 4) & (at < per // 4 + per // 8)
    x[0, :, 0] = torch.where(big, 100.0, -4.0)  # dt = 100 (A dt ~ -37 .. -160), else 0.018
    weight = torch.randn(1, seq, ref.hidden_size, generator=gen)
    xr = x.clone().requires_grad_()
    want = ref(xr)
    (want * weight).sum().backward()
    assert xr.grad is not None
    errors: dict[str, float] = {}
    group = cp_group(cp_mesh)
    for path in ("native", "generic"):
        module = copy.deepcopy(ref)
        module.zero_grad(set_to_none=True)
        holder = nn.Module()
        holder.layers = nn.ModuleList([module])
        plan = check_token_mixers(holder, world, strict=path == "native", packed=False)
        if path == "generic":  # the same module through the generic exact path
            plan = cpshard.mixers.MixerPlan(plan.sites, (), "contiguous")
        else:
            assert len(plan.native) == 1 and plan.layout == "contiguous", plan
        ids = torch.ones(1, seq, dtype=torch.long)
        ctx, _, sharder = cpshard.make_cp_batch_and_ctx(
            cp_mesh, {"input_ids": ids}, layout="contiguous"
        )
        ctx = with_token_mixers(ctx, plan, cp_mesh)
        local = sharder.shard_token_tensor(x, fill=0.0).requires_grad_()
        with ctx():
            out = module(local)
        (out * sharder.shard_token_tensor(weight, fill=0.0)).sum().backward()
        assert local.grad is not None
        errors[f"{path} out"] = _rel(sharder.gather_token_tensor(out.detach(), trim=True), want)
        errors[f"{path} dx"] = _rel(sharder.gather_token_tensor(local.grad, trim=True), xr.grad)
        for name, p in module.named_parameters():
            assert p.grad is not None, name
            g = p.grad.clone()
            assert group is not None
            dist.all_reduce(g, group=group)
            ref_grad = dict(ref.named_parameters())[name].grad
            assert ref_grad is not None
            errors[f"{path} grad {name}"] = _rel(g, ref_grad)
    return errors


def _saved_bytes(run: Any) -> int:
    """Bytes of the distinct storages autograd keeps for the backward while ``run()`` runs
    forward (``saved_tensors_hooks``: every tensor an op or a Function saves)."""
    seen: dict[tuple[int, int], int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        seen[(storage.data_ptr(), storage.nbytes())] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        run()
    return sum(seen.values())


def native_saved_bytes(cp_mesh: DeviceMesh, arch: str, seq: int) -> tuple[int, int]:
    """``(one process, this rank native)``: the bytes one natively served mixer keeps for its
    backward, on ``[1, seq, D]`` in one process and on this rank's contiguous shard.

    Deterministic (what autograd saves, not a measured peak): a rank keeps the module's own
    activations for its ``seq / C`` tokens plus the small state hand-off, not a state summary's
    intermediates beside them.
    """
    from torch import nn

    if arch == "mamba2":
        module: Any = _mamba2_with_a_long_tail(64)
    else:
        module = cpshard.mixers.find_token_mixers(tiny_hybrid(arch))[0].module
    x = torch.randn(1, seq, module.hidden_size, generator=torch.Generator().manual_seed(3))
    x = x.to(next(module.parameters()).dtype)
    one = _saved_bytes(lambda: module(x.clone().requires_grad_()))
    holder = nn.Module()
    holder.layers = nn.ModuleList([module])
    plan = check_token_mixers(holder, cp_mesh.size(), strict=True, packed=False)
    assert len(plan.native) == 1, plan
    ids = torch.ones(1, seq, dtype=torch.long)
    ctx, _, sharder = cpshard.make_cp_batch_and_ctx(
        cp_mesh, {"input_ids": ids}, layout="contiguous"
    )
    ctx = with_token_mixers(ctx, plan, cp_mesh)
    local = sharder.shard_token_tensor(x, fill=0.0).requires_grad_()
    out: list[torch.Tensor] = []

    def native() -> None:
        with ctx():
            out.append(module(local))

    mine = _saved_bytes(native)
    out[0].sum().backward()  # every rank runs the gathers' backward
    return one, mine
