"""Native CP for Mamba2 (SSD) mixers: each rank scans only its own tokens.

Serves transformers' ``Mamba2Mixer`` and every copy with the same forward (Bamba, Granite 4 /
GraniteMoeHybrid, Zamba2, Nemotron-H; checked on the source, not by name) when each rank holds
one in-order run of its row's single document (the ``contiguous`` layout of dense rows; pads
only at the end). The module runs its own code on its local tokens; cpshard hands it, through
a cache object for that one call, the two things that cross ranks:

* the **convolution halo**: the last ``k - 1`` pre-convolution inputs of the previous rank
  (one all-gather of ``[B, conv_dim, k - 1]``; zeros on rank 0);
* the **incoming state** ``h0 [B, H, P, N]``: the SSD recurrence is linear in its initial
  state, so each rank computes from a zero state its final state ``S_r`` and its decay
  ``M_r = exp(sum_t A dt_t)`` (:func:`summary`: chunk end states and chunk decays as the
  module's chunked scan computes its final state, no output), all ranks all-gather ``(M, S)``,
  and rank ``r`` folds ``h0 = sum_{j<r} (prod_{j<i<r} M_i) S_j``.

Both gathers are differentiable (their backward reduce-scatters the gradient), so the backward is
exact too. The summary keeps nothing for the backward but its inputs (the module's own
convolution input and projection; :func:`cpshard.mixers.recompute.recomputed` runs it again
there), so a rank holds the module's activations for its ``L = S / C`` tokens and little more.
Per rank: the module's own work on ``L`` tokens, plus a depthwise convolution and one
``O(L H P N)`` sum (twice: forward, and again in the backward); communication independent of
``L`` except the halo.

Used only where the module's pure-torch path runs (``mamba_ssm`` and ``causal_conv1d`` not
importable): the CUDA kernels manage the cache differently and are not verified here; there the
generic path serves.

Import rules: the rows of ``RULES`` in tests/unit/test_architecture.py that cover this module.
"""

from __future__ import annotations

import ast
import contextlib
import functools
import importlib
import importlib.util
import inspect
import textwrap
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed import ProcessGroup
from torch.utils.hooks import RemovableHandle

from cpshard._comm import all_gather_dim0
from cpshard.attention.context import active_mode
from cpshard.mixers.detect import MixerSite, hooks_on
from cpshard.mixers.recompute import recomputed
from cpshard.sharding.meta import TokenMeta

__all__ = [
    "Geometry",
    "NativeMamba2",
    "SeedCache",
    "conv_width",
    "is_native_mamba2",
    "native_input",
    "native_kwargs",
    "serves_native",
    "source_ast",
    "summary",
    "torch_path",
]

_REFERENCE_MODULE = "transformers.models.mamba2.modeling_mamba2"
_HELPERS = ("causal_conv1d_forward", "causal_conv1d_fn", "mamba2_scan_forward", "mamba2_chunk_scan")


def source_ast(fn: Any) -> str:
    """The AST of a function without its docstring and decorators (comparable across files).

    transformers wraps kernel-replaceable helpers in small modules: their ``forward`` is read.
    """
    if isinstance(fn, nn.Module):
        wrapper = inspect.unwrap(type(fn).forward)
        cells = dict(zip(wrapper.__code__.co_freevars, wrapper.__closure__ or (), strict=False))
        fn = cells["func"].cell_contents  # the torch body the wrapper falls back to
    tree = ast.parse(textwrap.dedent(inspect.getsource(inspect.unwrap(fn))))
    node = tree.body[0]
    assert isinstance(node, ast.FunctionDef)
    body = node.body
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
        body = body[1:]
    return ast.dump(ast.Module(body=body, type_ignores=[])) + ast.dump(node.args)


def torch_path(packages: Sequence[str]) -> bool:
    """Whether none of ``packages`` is importable (transformers then runs its torch bodies)."""
    return all(importlib.util.find_spec(p) is None for p in packages)


def is_native_mamba2(module: nn.Module) -> bool:
    """Whether ``module`` runs transformers' Mamba2 forward, so the native path can serve it."""
    try:
        ref_file = importlib.import_module(_REFERENCE_MODULE)
        own_file = importlib.import_module(type(module).__module__)
        if source_ast(type(module).forward) != source_ast(ref_file.Mamba2Mixer.forward):
            return False
        for name in _HELPERS:
            if source_ast(getattr(own_file, name)) != source_ast(getattr(ref_file, name)):
                return False
    except (ImportError, AttributeError, OSError, TypeError, SyntaxError):
        return False
    return torch_path(("mamba_ssm", "causal_conv1d"))


def conv_width(module: nn.Module) -> int:
    """The convolution width ``k`` of a Mamba2 mixer."""
    conv: Any = module.conv1d
    return int(conv.kernel_size[0])


def serves_native(meta: TokenMeta, kernel: int) -> bool:
    """Whether every rank holds one in-order run of a single document per row (pads last).

    Args:
        meta: The batch's token meta.
        kernel: The mixer's convolution width ``k`` (a rank needs ``k - 1`` halo tokens).
    """
    n, world = meta.local_len, meta.world_size
    if world < 2 or n < kernel - 1:
        return False
    stream = meta.positions.shape[-1]
    pos = meta.positions.to("cpu")
    if not torch.equal(pos, torch.arange(stream).expand_as(pos)):
        return False
    doc = meta.document_ids.to("cpu")
    real = doc >= 0
    # pads only after the last real token, and one document per row
    first_pad = torch.where(real.all(1), stream, (~real).int().argmax(1))
    after = torch.arange(stream).unsqueeze(0) >= first_pad.unsqueeze(1)
    if bool((real & after).any()):
        return False
    return bool((torch.where(real, doc, doc[:, :1]) == doc[:, :1]).all())


class _Call:
    """One forward of one mixer: the captured projection and the exchanged halo / state."""

    def __init__(self, module: nn.Module, group: ProcessGroup, rank: int, world: int) -> None:
        self.module: Any = module
        self.group = group
        self.rank = rank
        self.world = world
        self.proj: torch.Tensor | None = None
        self.ext: torch.Tensor | None = None

    def capture(self, _mod: nn.Module, _args: Any, output: torch.Tensor) -> None:
        self.proj = output

    def with_halo(self, pre: torch.Tensor) -> torch.Tensor:
        """``pre [B, cd, L]`` -> ``[B, cd, k - 1 + L]`` with the previous rank's last inputs."""
        k = conv_width(self.module)
        tail = pre[..., pre.shape[-1] - (k - 1) :].unsqueeze(0)  # [1, B, cd, k-1]
        tails = all_gather_dim0(tail.contiguous(), self.group, "sum")  # [C, B, cd, k-1]
        prev = tails[(self.rank - 1) % self.world] * float(self.rank > 0)
        self.ext = torch.cat([prev.to(pre.dtype), pre], dim=-1)
        return self.ext

    def h0(self) -> torch.Tensor:
        """The true incoming state ``[B, H, P, N]`` (fp32), from every rank's summary."""
        m = self.module
        assert self.ext is not None
        assert self.proj is not None
        dt = self.proj[..., self.proj.shape[-1] - m.num_heads :]
        conv = m.conv1d
        s_own, m_own = recomputed(
            functools.partial(summary, Geometry.of(m)),
            self.ext,
            dt,
            conv.weight,
            conv.bias,
            m.dt_bias,
            m.A_log,
        )
        s_all = all_gather_dim0(s_own.unsqueeze(0).contiguous(), self.group, "sum")
        m_all = all_gather_dim0(m_own.unsqueeze(0).contiguous(), self.group, "sum")
        h = torch.zeros_like(s_own)
        for j in range(self.rank):
            h = m_all[j][..., None, None] * h + s_all[j]
        # every rank's gathers stay in its graph, so every rank runs their backward
        return h + 0.0 * (s_all.sum() + m_all.sum())


@dataclass(frozen=True)
class Geometry:
    """The sizes and settings of a Mamba2 mixer that its state summary needs."""

    inner: int  # I = H * P
    groups: int  # G
    state: int  # N
    heads: int  # H
    head_dim: int  # P
    chunk: int  # Q, the module's chunk size
    limit: tuple[float, float]  # time_step_limit
    act: Callable[[torch.Tensor], torch.Tensor]

    @classmethod
    def of(cls, module: Any) -> Geometry:
        """The geometry of a Mamba2 mixer."""
        low, high = module.time_step_limit
        return cls(
            module.intermediate_size,
            module.n_groups,
            module.ssm_state_size,
            module.num_heads,
            module.head_dim,
            module.chunk_size,
            (float(low), float(high)),
            module.act,
        )


def summary(
    geo: Geometry,
    ext: torch.Tensor,
    dt: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    dt_bias: torch.Tensor,
    a_log: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """A rank's state summary: its zero-start final state and its total decay.

    Computed as transformers' chunked scan (``mamba2_chunk_scan``) computes a final state, in
    the module's chunks of ``Q`` tokens from the rank's first token: the decay of a token to its
    chunk's end from a cumulative sum inside the chunk, the chunks' end states combined with
    decays summed over whole chunks (the masked cumulative sum of ``segment_sum``). A cumulative
    sum over all ``L`` tokens instead (``exp(cs[L] - cs[t])``) subtracts two sums of size
    ``~L |A dt|``: their fp32 rounding (``ulp(L |A dt|)``, 1e-4 at ``L = 8192``) became a
    relative error of the state.

    Args:
        geo: The mixer's geometry.
        ext: The convolution input with the previous rank's halo, ``[B, conv_dim, k - 1 + L]``.
        dt: The time step projection, before ``dt_bias`` and softplus, ``[B, L, H]``.
        weight: The depthwise convolution weight ``[conv_dim, 1, k]``.
        bias: Its bias ``[conv_dim]`` or ``None``.
        dt_bias: ``[H]``.
        a_log: ``[H]`` (``A = -exp(A_log)``).

    Returns:
        ``S [B, H, P, N]`` (fp32): the final state from a zero start; ``M [B, H]`` (fp32): the
        factor the incoming state is carried to the end with.
    """
    conv = F.conv1d(ext.to(weight.dtype), weight, bias, groups=weight.shape[0])
    conv = geo.act(conv).to(ext.dtype).transpose(1, 2)  # [B, L, conv_dim]
    size = geo.groups * geo.state
    x, b, _ = torch.split(conv, [geo.inner, size, size], dim=-1)
    rows, n, q = x.shape[0], x.shape[1], geo.chunk
    dt = torch.clamp(F.softplus(dt + dt_bias.to(dt.dtype)), min=geo.limit[0], max=geo.limit[1])
    a = -torch.exp(a_log.float()) * dt.float()  # [B, L, H]
    xdt = x.float().reshape(rows, n, geo.heads, geo.head_dim) * dt[..., None].float()
    bh = b.float().reshape(rows, n, geo.groups, geo.state)
    bh = bh.repeat_interleave(geo.heads // geo.groups, dim=2, output_size=geo.heads)
    pad = (q - n % q) % q  # padded steps: A dt = 0, x = 0, B = 0 (they change nothing)
    c = (n + pad) // q
    a = F.pad(a, (0, 0, 0, pad)).reshape(rows, c, q, geo.heads).permute(0, 3, 1, 2)
    xdt = F.pad(xdt, (0, 0, 0, 0, 0, pad)).reshape(rows, c, q, geo.heads, geo.head_dim)
    bh = F.pad(bh, (0, 0, 0, 0, 0, pad)).reshape(rows, c, q, geo.heads, geo.state)
    cs = torch.cumsum(a, dim=-1)  # [B, H, c, Q], inside each chunk
    to_end = torch.exp(cs[..., -1:] - cs)  # a token's decay to its chunk's end
    b_decay = bh * to_end.permute(0, 2, 3, 1)[..., None]
    ends = torch.einsum("bclhn,bclhp->bchpn", b_decay, xdt)  # each chunk's own end state
    # decay from each chunk's end (and from the start: index 0) to the rank's end, as
    # segment_sum sums it: a masked cumulative sum over exactly the later chunks
    totals = F.pad(cs[..., -1], (1, 0))  # [B, H, c + 1]
    later = torch.ones(c + 1, c + 1, dtype=torch.bool, device=a.device).tril(-1)
    spans = totals[..., None].expand(*totals.shape, c + 1).masked_fill(~later, 0.0)
    carry = torch.exp(torch.cumsum(spans, dim=-2)[..., -1, :])  # [B, H, c + 1]
    s = torch.einsum("bhc,bchpn->bhpn", carry[..., 1:], ends)
    return s, carry[..., 0]


class SeedCache:
    """The cache interface a native mixer's forward reads, for one call: the convolution halo
    and the incoming state in, nothing recorded.

    Args:
        with_halo: ``[B, C, L]`` pre-convolution input -> the same with the previous rank's last
            ``k - 1`` columns prepended (``update_conv_state``).
        state: The incoming recurrent state (``get_recurrent_state``).
    """

    def __init__(
        self,
        with_halo: Callable[[torch.Tensor], torch.Tensor],
        state: Callable[[], torch.Tensor],
    ) -> None:
        self.with_halo = with_halo
        self.state = state

    def get_conv_state(self, layer_idx: int, state_idx: int = 0) -> torch.Tensor:
        # non-None: the forward then prepends the state through update_conv_state
        return torch.empty(0)

    def is_recording_past(self, layer_idx: int) -> bool:
        return False

    def update_conv_state(self, hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        return self.with_halo(hidden_states)

    def get_recurrent_state(self, layer_idx: int, state_idx: int = 0) -> torch.Tensor:
        return self.state()

    def get_recurrent_states_to_keep(self, layer_idx: int) -> int:
        return 0

    def update_recurrent_state(self, *args: Any, **kwargs: Any) -> None:
        return None


def native_input(
    module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], local_len: int
) -> torch.Tensor:
    """The ``hidden_states [B, L, D]`` a natively served mixer got (checked), before its forward.

    Raises:
        ValueError: not a ``[B, local_len, D]`` tensor, or an ``attention_mask`` was passed.
    """
    x = args[0] if args else kwargs.get("hidden_states")
    if not isinstance(x, torch.Tensor) or x.dim() != 3 or x.shape[1] != local_len:
        raise ValueError(
            f"{type(module).__name__} runs natively under CP and needs hidden_states "
            f"[B, L={local_len}, D], got "
            f"{tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__}"
        )
    if kwargs.get("attention_mask") is not None:
        raise ValueError(
            f"{type(module).__name__} got an attention_mask under CP; padding comes from "
            "the sharded batch"
        )
    return x


def native_kwargs(module: nn.Module, kwargs: dict[str, Any], cache: object) -> dict[str, Any]:
    """``kwargs`` for a natively served mixer's forward: its cache argument (``cache`` or
    ``cache_params``, as its signature names it) replaced by ``cache``, which hands it the halo
    and incoming state; no position / cache-position kwargs, no mask."""
    params = inspect.signature(module.forward).parameters
    name = "cache" if "cache" in params else "cache_params"
    new_kwargs = {
        k: v
        for k, v in kwargs.items()
        if k not in ("cache", "cache_params", "position_ids", "cache_position")
    }
    new_kwargs[name] = cache
    new_kwargs["attention_mask"] = None
    return new_kwargs


class NativeMamba2:
    """Scoped hooks that run Mamba2 mixers natively under CP for one batch.

    Args:
        sites: Mixers for which :func:`is_native_mamba2` holds.
        group: The CP group.
        meta: The batch's token meta (:func:`serves_native` must hold).
    """

    def __init__(self, sites: Sequence[MixerSite], group: ProcessGroup, meta: TokenMeta) -> None:
        self.sites = tuple(sites)
        self.group = group
        self.meta = meta
        self._calls: dict[int, list[tuple[_Call, RemovableHandle] | None]] = {}

    def _active(self) -> bool:
        mode = active_mode()
        return mode is not None and mode.meta is self.meta

    def pre(
        self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
        """Forward pre-hook: a one-call cache carrying the halo and the incoming state."""
        stack = self._calls.setdefault(id(module), [])
        if not self._active():
            stack.append(None)
            return None
        native_input(module, args, kwargs, self.meta.local_len)  # checked before any hook
        call = _Call(module, self.group, self.meta.rank, self.meta.world_size)
        in_proj: nn.Module = call.module.in_proj
        handle = in_proj.register_forward_hook(call.capture)
        stack.append((call, handle))
        return args, native_kwargs(module, kwargs, SeedCache(call.with_halo, call.h0))

    def post(self, module: nn.Module, args: Any, kwargs: Any, output: Any) -> Any:
        """Forward hook: drop the call's projection hook."""
        entry = self._calls[id(module)].pop()
        if entry is not None:
            entry[1].remove()
        return output

    def installed(self) -> contextlib.AbstractContextManager[None]:
        """Register the hooks on every site for the span of the block, then remove them."""
        return hooks_on(self.sites, self.pre, self.post)
