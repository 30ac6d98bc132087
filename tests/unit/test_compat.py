"""Every entry of :mod:`cpshard._compat` still works on the installed torch / transformers.

An upgrade that moves or changes a private API fails here, entry by entry, before any CP path
meets it. Run on both stacks (torch 2.11 + transformers 5.17, torch 2.13 + transformers 5.25):
the versions each entry's docstring says it was checked against. The fused CUDA ops are bound to
their schemas in ``tests/unit/test_cuda_kernel_calls.py`` (meta tensors) and run in ``tests/gpu``.
"""

from __future__ import annotations

import ast
import functools
import inspect
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode
from torch.utils.checkpoint import checkpoint

from cpshard import _compat


def test_every_entry_says_which_versions_it_was_checked_against() -> None:
    tree = ast.parse(Path(inspect.getfile(_compat)).read_text())
    bare = [
        n.name
        for n in tree.body
        if isinstance(n, ast.FunctionDef)
        and not n.name.startswith("_")
        and "checked against:" not in (ast.get_docstring(n) or "")
    ]
    assert not bare, f"entries without 'checked against:' versions: {bare}"
    assert set(_compat.__all__) <= set(dir(_compat))


def test_sdpa_builtin_is_what_the_functional_calls() -> None:
    seen = []

    class Spy(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            seen.append(func)
            return func(*args, **(kwargs or {}))

    q = torch.randn(1, 1, 3, 4)
    assert _compat.function_mode_stack() == []
    with Spy() as spy:
        assert spy in _compat.function_mode_stack()
        F.scaled_dot_product_attention(q, q, q)
    assert F.scaled_dot_product_attention in seen or _compat.SDPA_BUILTIN in seen


def test_checkpoint_forward_is_seen() -> None:
    inside = []

    def body(x: torch.Tensor) -> torch.Tensor:
        inside.append(_compat.in_checkpoint_forward())
        return x * 2

    x = torch.ones(2, requires_grad=True)
    checkpoint(body, x, use_reentrant=False).sum().backward()
    assert inside[0] is True
    assert _compat.in_checkpoint_forward() is False


def test_autograd_task_id_callback_and_version() -> None:
    events: list[object] = []

    class Probe(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):  # type: ignore[no-untyped-def,override]
            return x.clone()

        @staticmethod
        def backward(ctx, g):  # type: ignore[no-untyped-def,override]
            events.append(_compat.current_graph_task_id())
            _compat.queue_backward_callback(functools.partial(events.append, "done"))
            return g

    x = torch.ones(2, requires_grad=True)
    Probe.apply(x).sum().backward()
    assert isinstance(events[0], int) and events[0] >= 0
    assert events[-1] == "done"
    assert _compat.current_graph_task_id() == -1
    t = torch.zeros(2)
    v = _compat.tensor_version(t)
    t.add_(1)
    assert _compat.tensor_version(t) == v + 1


def test_forward_pre_hooks_in_order() -> None:
    m = torch.nn.Linear(2, 2)

    def a(*_: object) -> None:
        return None

    def b(*_: object) -> None:
        return None

    m.register_forward_pre_hook(a)
    m.register_forward_pre_hook(b)
    assert _compat.forward_pre_hooks(m) == [a, b]


def test_non_persistent_buffers() -> None:
    m = torch.nn.Module()
    m.register_buffer("state", torch.zeros(1))
    m.register_buffer("cache", torch.zeros(1), persistent=False)
    assert _compat.non_persistent_buffers(m) == frozenset({"cache"})
    assert _compat.non_persistent_buffers(torch.nn.Linear(2, 2)) == frozenset()


def test_cpu_flash_ops_match_sdpa() -> None:
    assert _compat.CPU_FLASH_AVAILABLE
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 2, 5, 8, requires_grad=True) for _ in range(3))
    out, lse = _compat.cpu_flash_attention(q, k, v, is_causal=True, attn_mask=None, scale=0.5)
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=0.5)
    torch.testing.assert_close(out, ref)
    assert lse.shape == (1, 2, 5)
    g = torch.randn_like(out)
    dq, dk, dv = _compat.cpu_flash_attention_backward(
        g, q, k, v, out, lse, is_causal=True, attn_mask=None, scale=0.5
    )
    rq, rk, rv = torch.autograd.grad(ref, (q, k, v), g)
    for a, b in ((dq, rq), (dk, rk), (dv, rv)):
        torch.testing.assert_close(a, b)


def test_torch_load_balancers() -> None:
    assert _compat.torch_load_balancers_available()
    idx = _compat.torch_head_tail_indices(8, 2)
    assert idx.reshape(-1).tolist() == [0, 1, 6, 7, 2, 3, 4, 5]
    per_doc = _compat.torch_per_document_indices([4, 4], 2)
    assert sorted(per_doc.reshape(-1).tolist()) == list(range(8))
    groups = _compat.torch_ptrr_schedule(torch.tensor([4, 3, 2, 1]), 2)
    assert groups.shape == (2, 2)
    assert sorted(groups.reshape(-1).tolist()) == [0, 1, 2, 3]


def test_transformers_entries() -> None:
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(
        hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, vocab_size=32,
    )  # fmt: skip
    model = transformers.LlamaForCausalLM(cfg)
    assert _compat.has_attn_implementation(cfg)
    assert not _compat.has_attn_implementation(object())
    assert _compat.attn_implementation(object(), "x") == "x"
    _compat.set_config_attn_implementation(cfg, "eager")
    assert _compat.attn_implementation(cfg) == "eager"
    assert _compat.can_set_attn_implementation(type(model)) is True
    assert _compat.can_set_attn_implementation(torch.nn.Linear) is None
    attention = type(model.model.layers[0].self_attn)
    assert _compat.source_uses_attention_registry(inspect.getsource(attention.forward))
    assert not _compat.source_uses_attention_registry(inspect.getsource(torch.nn.Linear.forward))
    assert _compat.gradient_checkpointing_func(model.model) is None
    enable = getattr(model, "activation_checkpointing_enable", None)  # 5.25; 5.17: the old name
    if enable is not None:
        enable(activation_checkpointing_kwargs={"use_reentrant": False})
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    funcs = {_compat.gradient_checkpointing_func(m) for m in model.modules()} - {None}
    assert funcs and all(isinstance(f, functools.partial) for f in funcs)
    methods = list(_compat.trainer_token_count_methods(transformers.Trainer))
    assert methods[0] is transformers.Trainer.get_batch_samples
    assert all(callable(m) for m in methods)


def test_own_members() -> None:
    """As named_children / named_parameters / named_buffers (recurse=False): None entries
    skipped, an object under two names listed once, under its first."""
    m = torch.nn.Module()
    m.a = torch.nn.Linear(2, 2)
    m.b = m.a
    m.register_module("c", None)
    m.d = torch.nn.Conv1d(2, 2, 3)
    m.w = torch.nn.Parameter(torch.ones(2))
    m.v = m.w
    m.register_parameter("none", None)
    m.register_buffer("buf", torch.zeros(3))
    m.register_buffer("buf2", m.buf, persistent=False)
    m.register_buffer("nobuf", None)
    children, params, buffers = _compat.own_members(m)
    assert children == list(m.named_children())
    assert params == [n for n, _ in m.named_parameters(recurse=False)] == ["w"]
    assert buffers == [n for n, _ in m.named_buffers(recurse=False)] == ["buf"]
    assert _compat.own_members(torch.nn.Linear(2, 2)) == ([], ["weight", "bias"], [])


def test_member_signature() -> None:
    """Equal for the same live tree; unequal once a module's class, child, parameter, buffer or
    buffer persistence changes (values and flags do not count)."""
    m = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.ReLU())
    m.register_buffer("b", torch.zeros(2))
    base = _compat.member_signature(m.modules())
    with torch.no_grad():
        m[0].weight.add_(1.0)
    m.train(False)
    assert _compat.member_signature(m.modules()) == base
    changes = [
        lambda: setattr(m[0], "weight", torch.nn.Parameter(m[0].weight.detach().clone())),
        lambda: m.__setitem__(1, torch.nn.ReLU()),
        lambda: m.register_buffer("b", m.b, persistent=False),
        lambda: setattr(m[1], "__class__", torch.nn.Tanh),
    ]
    for change in changes:
        before = _compat.member_signature(m.modules())
        change()
        assert _compat.member_signature(m.modules()) != before


def test_own_tensor() -> None:
    m = torch.nn.Linear(2, 2)
    m.register_buffer("buf", torch.zeros(3))
    m.register_buffer("nobuf", None)
    assert _compat.own_tensor(m, "weight", True) is m.weight
    assert _compat.own_tensor(m, "buf", False) is m.buf
    for name, is_param in (("nobuf", False), ("buf", True), ("weight", False)):
        with pytest.raises(KeyError):
            _compat.own_tensor(m, name, is_param)


def test_own_buffers() -> None:
    """As named_buffers(recurse=False): None skipped, a tensor under two names once (first)."""
    m = torch.nn.Module()
    m.register_buffer("a", torch.zeros(2), persistent=False)
    m.register_buffer("b", m.a)
    m.register_buffer("c", None)
    m.register_buffer("d", torch.ones(1))
    m.sub = torch.nn.Linear(2, 2)
    m.sub.register_buffer("e", torch.ones(1))
    got = _compat.own_buffers(m)
    assert [(n, id(t)) for n, t in got] == [(n, id(t)) for n, t in m.named_buffers(recurse=False)]
    assert [n for n, _ in got] == ["a", "d"]
