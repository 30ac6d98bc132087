"""Every private torch and transformers API cpshard uses, one named entry each.

A torch or transformers release may change a private API without notice; here each one is a
named function or constant, so an upgrade breaks at one known place and its entry says which
versions it was checked against. Private means a ``_``-prefixed component anywhere in the path:
a module (``torch._C``, ``torch.utils._python_dispatch``), a function or op
(``torch.ops.aten._flash_attention_forward``), a class (torch's ``_HeadTailLoadBalancer``) or an
attribute of a torch / transformers object (``module._forward_pre_hooks``,
``config._attn_implementation``), read directly, through ``getattr`` or as a name searched in
source text. Dunder names (``__self__``) and the documented namedtuple API (``_replace``) are
public. ``tests/unit/test_architecture.py`` fences this with one row of ``RULES`` (its
``private=("torch", "transformers")``): outside this module no module of :mod:`cpshard` names a
private torch or transformers API. Overriding a private hook of a trainer subclass
(:mod:`cpshard.integrations`) defines the name in cpshard and is not a call through this seam.

"checked against" names the versions whose behaviour the entry was run or read against: the
two supported stacks, torch 2.11 with transformers 5.17 and torch 2.13 with transformers 5.25;
``tests/unit/test_compat.py`` runs every entry but the CUDA ops on the installed stack. The fused
CUDA ops are checked against their schemas and meta kernels on CPU
(``tests/unit/test_cuda_kernel_calls.py`` binds every call to the op's schema); ``tests/gpu``
runs them on a GPU.

Owns only these seams, no policy. Transformers is never imported here (its entries take the
object they read); of ``torch.distributed`` only torch's private CP load balancers, lazily
(index generators, no communication).

Import rules: the rows of ``RULES`` in tests/unit/test_architecture.py that cover this module.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch

# Only under the private ``torch.utils._python_dispatch``; :class:`cpshard._comm.CommRecorder`
# subclasses it. checked against: torch 2.11, 2.13.
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = [
    "CPU_FLASH_AVAILABLE",
    "SDPA_BUILTIN",
    "TorchDispatchMode",
    "attn_implementation",
    "can_set_attn_implementation",
    "cpu_flash_attention",
    "cpu_flash_attention_backward",
    "cudnn_attention",
    "cudnn_attention_backward",
    "current_graph_task_id",
    "efficient_attention",
    "efficient_attention_backward",
    "flash_attention",
    "flash_attention_backward",
    "flash_varlen_attention",
    "flash_varlen_attention_backward",
    "flatten_mesh",
    "forward_pre_hooks",
    "function_mode_stack",
    "gradient_checkpointing_func",
    "has_attn_implementation",
    "in_checkpoint_forward",
    "member_signature",
    "non_persistent_buffers",
    "own_buffers",
    "own_members",
    "own_tensor",
    "queue_backward_callback",
    "root_mesh",
    "set_config_attn_implementation",
    "source_uses_attention_registry",
    "tensor_version",
    "torch_head_tail_indices",
    "torch_load_balancers_available",
    "torch_per_document_indices",
    "torch_ptrr_schedule",
    "trainer_token_count_methods",
]

Tensor = torch.Tensor

# --- torch: function modes, autograd, module and tensor internals -----------------------------

SDPA_BUILTIN: Callable[..., Any] = torch._C._nn.scaled_dot_product_attention
"""The C builtin behind ``F.scaled_dot_product_attention``: a ``TorchFunctionMode`` may see
either. checked against: torch 2.11, 2.13."""


def function_mode_stack() -> list[Any]:
    """The active ``TorchFunctionMode`` objects, outermost first.

    ``torch.overrides._get_current_function_mode_stack``. checked against: torch 2.11, 2.13.
    """
    from torch.overrides import _get_current_function_mode_stack

    return list(_get_current_function_mode_stack())  # type: ignore[no-untyped-call]


def in_checkpoint_forward() -> bool:
    """Whether the forward of a non-reentrant ``torch.utils.checkpoint`` is running here.

    Its saved-tensors hook (``torch.utils.checkpoint``'s private ``_checkpoint_hook``) is then the
    innermost default hook (``torch._C._autograd._top_saved_tensors_default_hooks``). Not
    traceable: callers skip it under ``torch.compile``. checked against: torch 2.11, 2.13.
    """
    hooks = torch._C._autograd._top_saved_tensors_default_hooks(False)
    if hooks is None:
        return False
    return "_checkpoint_hook" in getattr(hooks[0], "__qualname__", "")


def current_graph_task_id() -> int:
    """The id of the autograd graph task running now (``-1`` outside a backward pass).

    ``torch._C._current_graph_task_id``; the id alone can repeat across passes. checked against:
    torch 2.11, 2.13.
    """
    return int(torch._C._current_graph_task_id())


def queue_backward_callback(callback: Callable[[], None]) -> None:
    """Run ``callback`` when the running backward pass has finished (only if it succeeds).

    ``torch.autograd.Variable._execution_engine.queue_callback``; call it during a backward pass.
    checked against: torch 2.11, 2.13.
    """
    torch.autograd.Variable._execution_engine.queue_callback(callback)  # type: ignore[attr-defined]


def tensor_version(t: Tensor) -> int:
    """The in-place version counter of ``t`` (``t._version``): it grows with every in-place op.

    checked against: torch 2.11, 2.13.
    """
    return int(t._version)


def flatten_mesh(mesh: Any) -> Any:
    """The 1-D ``DeviceMesh`` over every rank of an n-D ``mesh``, in row-major order.

    ``DeviceMesh._flatten()`` (its default dim name joins the mesh's dim names): made once per
    root mesh and cached there by torch (a later call returns the same mesh, no new group). The
    2-D CP mesh's one flattened CP group (``cpshard._comm.split_cp_mesh``). checked against:
    torch 2.13.
    """
    return mesh._flatten()


def forward_pre_hooks(module: torch.nn.Module) -> list[Callable[..., Any]]:
    """The forward pre-hooks registered on ``module`` (``module._forward_pre_hooks``), in order.

    checked against: torch 2.11, 2.13.
    """
    return list(module._forward_pre_hooks.values())


_MODULE_GETATTR = torch.nn.Module.__getattr__


def class_answers(cls: type, name: str) -> bool:
    """Whether ``getattr(instance, name)`` can find ``name`` on an instance of module class
    ``cls`` beyond the instance's own ``__dict__``: a class attribute or property, or a
    ``__getattr__`` other than ``nn.Module``'s (which finds only parameters, buffers and
    submodules). Where it cannot, an attribute absent from the instance's ``__dict__`` is a
    miss: readers skip ``nn.Module.__getattr__``'s raised and caught ``AttributeError`` (~2 us,
    for hundreds of modules on every prepare). checked against: torch 2.11, 2.13.
    """
    return hasattr(cls, name) or getattr(cls, "__getattr__", None) is not _MODULE_GETATTR


def own_parameters(module: torch.nn.Module) -> list[tuple[str, torch.nn.Parameter]]:
    """``module``'s own parameters in registration order (``None`` entries skipped), read from
    ``module._parameters`` without the generator; the caller drops a parameter it has seen
    under another name (as ``named_parameters()`` does). checked against: torch 2.11, 2.13.
    """
    return [(name, p) for name, p in module._parameters.items() if p is not None]


def own_buffers(module: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    """``module``'s own buffers as ``named_buffers(recurse=False)`` lists them (``None`` skipped,
    a tensor under two names once, under its first), read from ``module._buffers`` without the
    generator. checked against: torch 2.11, 2.13.
    """
    out, ids = [], set()
    for name, t in module._buffers.items():
        if t is not None and id(t) not in ids:
            ids.add(id(t))
            out.append((name, t))
    return out


def own_tensor(module: torch.nn.Module, name: str, is_param: bool) -> Tensor:
    """``module``'s own parameter (``is_param``) or buffer registered as ``name``, read from
    ``module._parameters`` / ``module._buffers`` (``KeyError`` if absent). checked against:
    torch 2.11, 2.13.
    """
    table = module._parameters if is_param else module._buffers
    found = table[name]
    if found is None:
        raise KeyError(name)
    return found


def own_members(
    module: torch.nn.Module,
) -> tuple[list[tuple[str, torch.nn.Module]], list[str], list[str]]:
    """``(children, parameter names, buffer names)`` of ``module`` itself, as
    ``named_children()``, ``named_parameters(recurse=False)`` and
    ``named_buffers(recurse=False)`` give them (``None`` entries skipped, an object registered
    under two names listed under its first), read from ``module._modules``, ``_parameters`` and
    ``_buffers`` without their generators (~5 us each per module). checked against: torch 2.11,
    2.13.
    """
    children, seen = [], set()
    for name, child in module._modules.items():
        if child is not None and id(child) not in seen:
            seen.add(id(child))
            children.append((name, child))
    names: list[list[str]] = []
    for table in (module._parameters, module._buffers):
        ids: set[int] = set()
        kept = []
        for name, t in table.items():
            if t is not None and id(t) not in ids:
                ids.add(id(t))
                kept.append(name)
        names.append(kept)
    return children, names[0], names[1]


def non_persistent_buffers(module: torch.nn.Module) -> frozenset[str]:
    """The names of ``module``'s own buffers registered with ``persistent=False``
    (``module._non_persistent_buffers_set``): caches, not state. checked against: torch 2.11,
    2.13.
    """
    return frozenset(getattr(module, "_non_persistent_buffers_set", ()))


def member_signature(modules: Iterable[torch.nn.Module]) -> list[object]:
    """What a module tree is made of, module by module: each module's class, then the names and
    object ids of its children (``_modules``), parameters (``_parameters``) and buffers
    (``_buffers``), and the names in its non-persistent buffer set. Two signatures of the same
    live modules are equal exactly when none of them gained, lost, renamed or swapped a child,
    parameter or buffer, changed class, or changed a buffer's persistence. Reads the tables
    directly (~0.7 us a module). checked against: torch 2.11, 2.13.
    """
    out: list[object] = []
    extend = out.extend
    for m in modules:
        out.append(type(m))
        for table in (m._modules, m._parameters, m._buffers):
            out.append(len(table))
            extend(table)
            extend(map(id, table.values()))
        transient = m.__dict__.get("_non_persistent_buffers_set", ())
        if transient:
            extend(sorted(transient))
        out.append(len(transient))
    return out


def root_mesh(mesh: Any) -> Any:
    """The mesh a ``DeviceMesh`` was sliced from (``mesh["cp"]`` makes a new object on every
    call; its root is the mesh ``init_device_mesh`` / ``DeviceMesh.from_group`` built), ``mesh``
    itself for a root (``DeviceMesh._get_root_mesh``; a torch without it gives ``mesh``).
    checked against: torch 2.13.
    """
    get = getattr(mesh, "_get_root_mesh", None)
    root = get() if callable(get) else None
    return mesh if root is None else root


# --- torch: fused attention ops (ATen, private) -----------------------------------------------
# Every wrapper runs without dropout and passes the schema's arguments positionally in the
# order tests/unit/test_compat.py checks against the installed torch.

CPU_FLASH_AVAILABLE: bool = hasattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu")
"""Whether this torch build has the CPU flash op (``F.scaled_dot_product_attention``'s CPU kernel).
checked against: torch 2.11, 2.13."""


def cpu_flash_attention(
    q: Tensor, k: Tensor, v: Tensor, *, is_causal: bool, attn_mask: Tensor | None, scale: float
) -> tuple[Tensor, Tensor]:
    """``aten._scaled_dot_product_flash_attention_for_cpu``: ``(out, lse)``.

    ``attn_mask`` is an additive float mask of q's dtype (bool masks are rejected); the LSE is not
    differentiable and is 0 for fully masked rows. checked against: torch 2.11, 2.13.
    """
    o, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q, k, v, 0.0, is_causal, attn_mask=attn_mask, scale=scale
    )
    return o, lse


def cpu_flash_attention_backward(
    grad_out: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    *,
    is_causal: bool,
    attn_mask: Tensor | None,
    scale: float,
) -> tuple[Tensor, Tensor, Tensor]:
    """``aten._scaled_dot_product_flash_attention_for_cpu_backward``: ``(dq, dk, dv)``.

    checked against: torch 2.11, 2.13.
    """
    dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        grad_out, q, k, v, out, lse, 0.0, is_causal, attn_mask=attn_mask, scale=scale
    )
    return dq, dk, dv


def _philox_uint64(device: torch.device) -> tuple[Tensor, Tensor]:
    """The flash backwards' philox seed/offset arguments; read only with dropout (never here)."""
    seed = torch.empty(2, dtype=torch.uint64, device=device)
    offset = torch.empty((), dtype=torch.uint64, device=device)
    return seed, offset


def _philox_int64(device: torch.device) -> tuple[Tensor, Tensor]:
    """The memory-efficient and cuDNN backwards' philox seed/offset (unread without dropout)."""
    seed = torch.empty((), dtype=torch.int64, device=device)
    offset = torch.empty((), dtype=torch.int64, device=device)
    return seed, offset


def flash_attention(
    q: Tensor, k: Tensor, v: Tensor, *, is_causal: bool, scale: float
) -> tuple[Tensor, Tensor]:
    """``aten._scaled_dot_product_flash_attention`` (no debug mask): ``(out, lse)``.

    checked against: torch 2.11, 2.13 (schema and meta kernel).
    """
    res = torch.ops.aten._scaled_dot_product_flash_attention(
        q, k, v, 0.0, is_causal, False, scale=scale
    )
    return res[0], res[1]


def flash_attention_backward(
    grad_out: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    *,
    is_causal: bool,
    scale: float,
) -> tuple[Tensor, Tensor, Tensor]:
    """``aten._scaled_dot_product_flash_attention_backward`` (dense): ``(dq, dk, dv)``.

    checked against: torch 2.11, 2.13 (schema and meta kernel).
    """
    seed, offset = _philox_uint64(q.device)
    dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_backward(
        grad_out,
        q,
        k,
        v,
        out,
        lse,
        None,
        None,
        q.shape[2],
        k.shape[2],
        0.0,
        is_causal,
        seed,
        offset,
        scale=scale,
    )
    return dq, dk, dv


def efficient_attention(
    q: Tensor, k: Tensor, v: Tensor, bias: Tensor | None, *, is_causal: bool, scale: float
) -> tuple[Tensor, Tensor]:
    """``aten._scaled_dot_product_efficient_attention`` with its LSE: ``(out, lse)``.

    The LSE is padded to a multiple of 32 queries. checked against: torch 2.11, 2.13 (schema and
    meta kernel).
    """
    res = torch.ops.aten._scaled_dot_product_efficient_attention(
        q, k, v, bias, True, 0.0, is_causal, scale=scale
    )
    return res[0], res[1]


def efficient_attention_backward(
    grad_out: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    bias: Tensor | None,
    out: Tensor,
    lse: Tensor,
    *,
    is_causal: bool,
    scale: float,
) -> tuple[Tensor, Tensor, Tensor]:
    """``aten._scaled_dot_product_efficient_attention_backward`` (no bias gradient).

    Returns ``(dq, dk, dv)``. checked against: torch 2.11, 2.13 (schema and meta kernel).
    """
    seed, offset = _philox_int64(q.device)
    dq, dk, dv, _ = torch.ops.aten._scaled_dot_product_efficient_attention_backward(
        grad_out,
        q,
        k,
        v,
        bias,
        out,
        lse,
        seed,
        offset,
        0.0,
        [True, True, True, False],
        is_causal,
        scale=scale,
    )
    return dq, dk, dv


def cudnn_attention(
    q: Tensor, k: Tensor, v: Tensor, *, is_causal: bool, scale: float
) -> tuple[Tensor, Tensor]:
    """``aten._scaled_dot_product_cudnn_attention`` (no bias, no debug mask): ``(out, lse)``.

    The LSE is ``[B, H, Lq, 1]`` in torch 2.13. checked against: torch 2.11, 2.13 (schema and
    meta kernel).
    """
    res = torch.ops.aten._scaled_dot_product_cudnn_attention(
        q, k, v, None, True, 0.0, is_causal, False, scale=scale
    )
    return res[0], res[1]


def cudnn_attention_backward(
    grad_out: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    *,
    is_causal: bool,
    scale: float,
) -> tuple[Tensor, Tensor, Tensor]:
    """``aten._scaled_dot_product_cudnn_attention_backward`` (dense, no bias): ``(dq, dk, dv)``.

    checked against: torch 2.11, 2.13 (schema and meta kernel).
    """
    seed, offset = _philox_int64(q.device)
    dq, dk, dv = torch.ops.aten._scaled_dot_product_cudnn_attention_backward(
        grad_out,
        q,
        k,
        v,
        out,
        lse,
        seed,
        offset,
        None,
        None,
        None,
        q.shape[2],
        k.shape[2],
        0.0,
        is_causal,
        scale=scale,
    )
    return dq, dk, dv


def flash_varlen_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    cu_q: Tensor,
    cu_k: Tensor,
    max_q: int,
    max_k: int,
    *,
    causal: bool,
    scale: float,
) -> tuple[Tensor, Tensor]:
    """``aten._flash_attention_forward`` over packed runs (no debug mask): ``(out, lse)``.

    checked against: torch 2.11, 2.13 (schema and meta kernel).
    """
    res = torch.ops.aten._flash_attention_forward(
        q, k, v, cu_q, cu_k, max_q, max_k, 0.0, causal, False, scale=scale
    )
    return res[0], res[1]


def flash_varlen_attention_backward(
    grad_out: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    cu_q: Tensor,
    cu_k: Tensor,
    max_q: int,
    max_k: int,
    *,
    causal: bool,
    scale: float,
) -> tuple[Tensor, Tensor, Tensor]:
    """``aten._flash_attention_backward`` over packed runs: ``(dq, dk, dv)``.

    checked against: torch 2.11, 2.13 (schema and meta kernel).
    """
    seed, offset = _philox_uint64(q.device)
    dq, dk, dv = torch.ops.aten._flash_attention_backward(
        grad_out,
        q,
        k,
        v,
        out,
        lse,
        cu_q,
        cu_k,
        max_q,
        max_k,
        0.0,
        causal,
        seed,
        offset,
        scale=scale,
    )
    return dq, dk, dv


# --- torch: the private CP load balancers (index generators, measured by tools/balance.py) ------


def torch_load_balancers_available() -> bool:
    """Whether this torch build ships the three CP load balancers the entries below use.

    checked against: torch 2.11, 2.13.
    """
    try:
        from torch.distributed.tensor.experimental._context_parallel._load_balancer import (
            _HeadTailLoadBalancer,
            _PerDocumentHeadTailLoadBalancer,
            _PTRRLoadBalancer,
        )
    except ImportError:  # pragma: no cover - depends on the torch build
        return False
    return all((_HeadTailLoadBalancer, _PerDocumentHeadTailLoadBalancer, _PTRRLoadBalancer))


def torch_head_tail_indices(seq_len: int, world_size: int) -> Tensor:
    """torch's head-tail balancer: ``[seq_len]`` global indices, rank-major.

    ``_HeadTailLoadBalancer(...)._generate_indices()[0]``. checked against: torch 2.11, 2.13.
    """
    from torch.distributed.tensor.experimental._context_parallel._load_balancer import (
        _HeadTailLoadBalancer,
    )

    return _HeadTailLoadBalancer(seq_len, world_size, "cpu")._generate_indices()[0]


def torch_per_document_indices(doc_lens: list[int], world_size: int) -> Tensor:
    """torch's per-document head-tail balancer on one row of documents (each a multiple of 2C).

    ``_PerDocumentHeadTailLoadBalancer(...)._generate_indices()[0]``. checked against: torch 2.11,
    2.13.
    """
    from torch.distributed.tensor.experimental._context_parallel._load_balancer import (
        _PerDocumentHeadTailLoadBalancer,
    )

    lb = _PerDocumentHeadTailLoadBalancer([doc_lens], world_size, "cpu")
    return lb._generate_indices()[0]


def torch_ptrr_schedule(block_counts: Tensor, world_size: int) -> Tensor:
    """torch's PTRR scheduling of blocks by work: ``[C, blocks / C]`` block ids per rank.

    ``_PTRRLoadBalancer.ptrr_scheduling``. checked against: torch 2.11, 2.13.
    """
    from torch.distributed.tensor.experimental._context_parallel._load_balancer import (
        _PTRRLoadBalancer,
    )

    return _PTRRLoadBalancer.ptrr_scheduling(block_counts, world_size)


# --- transformers (never imported here: each entry reads the object it is given) ---------------


def attn_implementation(config: Any, default: Any = None) -> Any:
    """The attention implementation a transformers config selects (``config._attn_implementation``).

    Returns ``default`` for an object without one. checked against: transformers 5.17, 5.25.
    """
    return getattr(config, "_attn_implementation", default)


def has_attn_implementation(config: Any) -> bool:
    """Whether ``config`` is a transformers config carrying an attention implementation.

    checked against: transformers 5.17, 5.25.
    """
    return hasattr(config, "_attn_implementation")


def set_config_attn_implementation(config: Any, name: str) -> None:
    """Select attention ``name`` on a bare config (for models without ``set_attn_implementation``).

    checked against: transformers 5.17, 5.25.
    """
    config._attn_implementation = name


def can_set_attn_implementation(model_cls: type) -> bool | None:
    """transformers' own verdict whether ``model_cls``'s attention goes through its registry.

    ``PreTrainedModel._can_set_attn_implementation()`` (it reads the model file's source);
    ``None`` when the class has no such method. checked against: transformers 5.17, 5.25.
    """
    can = getattr(model_cls, "_can_set_attn_implementation", None)
    return bool(can()) if callable(can) else None


def source_uses_attention_registry(source: str) -> bool:
    """Whether a forward's source dispatches through transformers' attention registry.

    It names ``ALL_ATTENTION_FUNCTIONS`` or the config's ``_attn_implementation``, the marks
    ``_can_set_attn_implementation`` looks for per file. checked against: transformers 5.17, 5.25.
    """
    return "ALL_ATTENTION_FUNCTIONS" in source or "_attn_implementation" in source


def gradient_checkpointing_func(module: torch.nn.Module) -> Any:
    """The checkpoint function HF gradient checkpointing set on ``module``, or ``None``.

    ``module._gradient_checkpointing_func`` (a ``functools.partial`` of
    ``torch.utils.checkpoint.checkpoint`` with the user's kwargs). checked against: transformers
    5.17, 5.25.
    """
    return getattr(module, "_gradient_checkpointing_func", None)


def trainer_token_count_methods(trainer_cls: type) -> Iterable[Callable[..., Any]]:
    """The methods of a transformers ``Trainer`` class that count ``num_items_in_batch``.

    ``get_batch_samples`` and, where it exists, the private ``_get_num_items_in_batch``.
    checked against: transformers 5.17, 5.25.
    """
    methods = [trainer_cls.get_batch_samples]  # type: ignore[attr-defined]
    private = getattr(trainer_cls, "_get_num_items_in_batch", None)
    return methods if private is None else [*methods, private]
