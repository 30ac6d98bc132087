"""Native CP for Gated DeltaNet mixers: each rank runs the delta rule over its own tokens only.

Serves transformers' ``Qwen3NextGatedDeltaNet`` (fused ``in_proj_qkvz`` / ``in_proj_ba``) and
``Qwen3_5GatedDeltaNet`` (separate ``in_proj_qkv`` / ``in_proj_z`` / ``in_proj_b`` /
``in_proj_a``), and any module whose forward and helpers are the same source as one of them
(Qwen3.5-MoE's copy, for instance; checked on the source, not by name), when each rank holds one
in-order run of its row's single document (the ``contiguous`` layout of dense rows; pads only at
the end). OLMo-Hybrid's variant (another forward: ``b_proj`` after the convolution,
``allow_neg_eigval``) is not served here: it takes the generic path.

The module runs its own code on its local tokens; cpshard hands it, through a cache object for
that one call, the two things that cross ranks:

* the **convolution halo**: the last ``k - 1`` pre-convolution ``q, k, v`` columns of the
  previous rank (one all-gather of ``[B, conv_dim, k - 1]``; zeros on rank 0);
* the **incoming state** ``S0 [B, H_v, d_k, d_v]``: the gated delta rule
  ``S_t = exp(g_t) (I - beta_t k_t k_t^T) S_{t-1} + beta_t k_t v_t^T`` is affine in its initial
  state, so a rank's final state is ``M_r S0 + F_r`` with ``M_r [B, H_v, d_k, d_k]`` the product
  of its transitions and ``F_r`` its zero-start final state. Both come from one run of the
  module's own chunked kernel: values ``[v | 0]`` and initial state ``[0 | I]`` (the rule acts
  on each value column separately) end in ``[F_r | M_r]``. All ranks all-gather that summary and
  rank ``r`` folds ``S0 = M_{r-1}(... (M_1 F_0 + F_1) ...) + F_{r-1}``.

The module reads its recurrent state before it projects its input, the halo only once the
convolution input exists: the cache hands out a zero state tensor first, and fills it in place
(``copy_``, as transformers' own cache stores states) when the convolution asks for its halo,
from the captured ``b, a`` projections and the convolution this file recomputes from the halo.
Both gathers are differentiable (their backward reduce-scatters the gradient), so the backward
is exact too. The summary is computed one key head (with its value heads) at a time, and keeps
nothing for the backward but its inputs (the module's convolution input, its ``b, a``
projections, parameters; :func:`cpshard.mixers.recompute.recomputed` runs each part again
there): a rank holds the module's activations for its ``L = S / C`` tokens and one head's
summary intermediates at most. Per rank: the module's own work on ``L`` tokens, plus one
depthwise convolution and one kernel run with ``d_v + d_k`` value columns (twice: forward, and
again in the backward); communication independent of ``L`` except the halo
(``C * B * H_v * d_k * (d_k + d_v)`` summary elements received).

Used only where the module's pure-torch path runs (``fla`` and ``causal_conv1d`` not
importable): the CUDA kernels manage the cache differently and are not verified here; there the
generic path serves.

Import rules: the rows of ``RULES`` in tests/unit/test_architecture.py that cover this module.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed import ProcessGroup
from torch.utils.hooks import RemovableHandle

from cpshard._comm import all_gather_dim0
from cpshard.attention.context import active_mode
from cpshard.mixers.detect import MixerSite, hooks_on
from cpshard.mixers.mamba2 import (
    SeedCache,
    conv_width,
    native_input,
    native_kwargs,
    serves_native,
    source_ast,
    torch_path,
)
from cpshard.mixers.recompute import recomputed
from cpshard.sharding.meta import TokenMeta

__all__ = ["NativeGatedDeltaNet", "gdn_form", "is_native_gdn", "serves_native_gdn"]

# form -> (reference file, reference class, projections whose outputs give b and a)
_FORMS: dict[str, tuple[str, str, tuple[str, ...]]] = {
    "fused": (
        "transformers.models.qwen3_next.modeling_qwen3_next",
        "Qwen3NextGatedDeltaNet",
        ("in_proj_qkvz", "in_proj_ba"),
    ),
    "split": (
        "transformers.models.qwen3_5.modeling_qwen3_5",
        "Qwen3_5GatedDeltaNet",
        ("in_proj_b", "in_proj_a"),
    ),
}
_HELPERS = (
    "apply_mask_to_padding_states",
    "causal_conv1d_forward",
    "causal_conv1d_fn",
    "l2norm",
    "torch_chunk_gated_delta_rule",
)


def gdn_form(module: nn.Module) -> str | None:
    """Which reference Gated DeltaNet forward ``module`` runs (``"fused"``, ``"split"``), if any.

    ``None`` when its forward or one of the helpers it calls differs from both references, when
    the references cannot be imported, or when a CUDA kernel package (``fla``, ``causal_conv1d``)
    is importable (transformers would then not run the torch bodies this path is checked on).
    """
    if not torch_path(("fla", "causal_conv1d")):
        return None
    try:
        own_file = importlib.import_module(type(module).__module__)
        forward = source_ast(type(module).forward)
    except (ImportError, AttributeError, OSError, TypeError, SyntaxError):
        return None
    for form, (file_name, class_name, _) in _FORMS.items():
        try:
            ref_file = importlib.import_module(file_name)
            if forward != source_ast(getattr(ref_file, class_name).forward):
                continue
            if all(
                source_ast(getattr(own_file, h)) == source_ast(getattr(ref_file, h))
                for h in _HELPERS
            ):
                return form
        except (ImportError, AttributeError, OSError, TypeError, SyntaxError):
            continue
    return None


def is_native_gdn(module: nn.Module) -> bool:
    """Whether ``module`` runs a reference Gated DeltaNet forward (the native path serves it)."""
    return gdn_form(module) is not None


def serves_native_gdn(meta: TokenMeta, module: nn.Module) -> bool:
    """Whether the batch's shards allow the native path for this Gated DeltaNet.

    Each rank must hold one in-order run of a single document per row (pads last, see
    :func:`cpshard.mixers.mamba2.serves_native`) of at least ``max(2, k - 1)`` tokens: a
    one-token call takes the module's decode branch, which reads no halo.
    """
    return meta.local_len >= 2 and serves_native(meta, conv_width(module))


class _Call:
    """One forward of one mixer: the captured projections, the halo and the incoming state."""

    def __init__(
        self, module: nn.Module, form: str, group: ProcessGroup, rank: int, world: int
    ) -> None:
        self.module: Any = module
        self.form = form
        self.group = group
        self.rank = rank
        self.world = world
        self.file: Any = importlib.import_module(type(module).__module__)
        self.captured: dict[str, torch.Tensor] = {}
        self.slot: torch.Tensor | None = None
        self.filled = False

    def capture(self, name: str) -> Callable[[nn.Module, Any, torch.Tensor], None]:
        """A forward hook that keeps the output of the projection ``name``."""

        def hook(_mod: nn.Module, _args: Any, output: torch.Tensor) -> None:
            self.captured[name] = output

        return hook

    def state_slot(self, rows: int, device: torch.device) -> torch.Tensor:
        """The state tensor ``[B, H_v, d_k, d_v]`` (fp32) handed out now and filled later."""
        m = self.module
        if self.slot is None:
            shape = (rows, m.num_v_heads, m.head_k_dim, m.head_v_dim)
            self.slot = torch.zeros(shape, dtype=torch.float32, device=device)
        return self.slot

    def with_halo(self, pre: torch.Tensor) -> torch.Tensor:
        """``pre [B, cd, L]`` -> ``[B, cd, k - 1 + L]`` with the previous rank's last inputs.

        Also computes the incoming state into the slot handed out by :meth:`state_slot`.
        """
        k = conv_width(self.module)
        tail = pre[..., pre.shape[-1] - (k - 1) :].unsqueeze(0)  # [1, B, cd, k-1]
        tails = all_gather_dim0(tail.contiguous(), self.group, "sum")  # [C, B, cd, k-1]
        prev = tails[(self.rank - 1) % self.world] * float(self.rank > 0)
        ext = torch.cat([prev.to(pre.dtype), pre], dim=-1)
        h0 = self._incoming(ext, pre.shape[-1])
        slot = self.state_slot(h0.shape[0], h0.device)
        slot.copy_(h0)  # the forward passes this very tensor to its delta rule
        self.filled = True
        return ext

    def _b_a(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The per-head ``b, a`` projections ``[B, L, H_v]`` the forward computed."""
        m, got = self.module, self.captured
        if self.form == "fused":
            *_, b, a = m.fix_query_key_value_ordering(got["in_proj_qkvz"], got["in_proj_ba"])
            return b, a
        return got["in_proj_b"], got["in_proj_a"]

    def _incoming(self, ext: torch.Tensor, n: int) -> torch.Tensor:
        """The true incoming state ``[B, H_v, d_k, d_v]`` (fp32), from every rank's summary.

        Args:
            ext: The convolution input with its halo, ``[B, conv_dim, k - 1 + L]``.
            n: Local tokens ``L``.
        """
        m = self.module
        b, a = self._b_a()
        # one key head (and its value heads) at a time: each part's recomputation in the
        # backward holds one part's kernel intermediates, not all heads' at once
        parts = [
            recomputed(
                functools.partial(_summary, m, self.file, n, head),
                ext,
                b,
                a,
                m.conv1d.weight,
                m.conv1d.bias,
                m.A_log,
                m.dt_bias,
            )[0]
            for head in range(m.num_k_heads)
        ]
        summary = torch.cat(parts, dim=1)  # [B, H_v, d_k, d_v + d_k]
        rows, hv, dk, dv = summary.shape[0], m.num_v_heads, m.head_k_dim, m.head_v_dim
        gathered = all_gather_dim0(summary.unsqueeze(0).contiguous(), self.group, "sum")
        h: torch.Tensor = summary.new_zeros(rows, hv, dk, dv)
        for j in range(self.rank):
            f_j = gathered[j][..., :dv]  # [B, H_v, d_k, d_v]
            m_j = gathered[j][..., dv:]  # [B, H_v, d_k, d_k]
            h = m_j @ h + f_j
        # every rank's gathers stay in its graph, so every rank runs their backward
        return h + 0.0 * gathered.sum()


def _head_channels(m: Any, head: int, t: torch.Tensor, dim: int) -> torch.Tensor:
    """Key head ``head``'s q, k and v channels (``2 d_k + r d_v``) of the convolution, from
    ``t``'s ``conv_dim`` channels along ``dim`` (q | k | v, head-major in each).

    Three slices from the module's sizes, concatenated: no index tensor to build and copy to
    the device on every forward and recomputation.
    """
    dk, dv = m.head_k_dim, m.head_v_dim
    r = m.num_v_heads // m.num_k_heads
    return torch.cat(
        [
            t.narrow(dim, head * dk, dk),
            t.narrow(dim, m.key_dim + head * dk, dk),
            t.narrow(dim, 2 * m.key_dim + head * r * dv, r * dv),
        ],
        dim=dim,
    )


def _summary(
    m: Any,
    file: Any,
    n: int,
    head: int,
    ext: torch.Tensor,
    b: torch.Tensor,
    a: torch.Tensor,
    conv_weight: torch.Tensor,
    conv_bias: torch.Tensor | None,
    a_log: torch.Tensor,
    dt_bias: torch.Tensor,
) -> tuple[torch.Tensor]:
    """Key head ``head``'s part of a rank's summary ``[F | M]``: ``[B, r, d_k, d_v + d_k]``
    (fp32) for its ``r = H_v / H_k`` value heads, from the module's own chunked kernel: values
    ``[v | 0]`` from state ``[0 | I]`` end in ``[F | M]`` (the rule acts on each value column,
    and each head, separately).

    Args:
        m: The Gated DeltaNet module (sizes, activation).
        file: Its modeling file (``causal_conv1d_fn``, ``torch_chunk_gated_delta_rule``).
        n: Local tokens ``L``.
        head: The key head.
        ext: The convolution input with its halo, ``[B, conv_dim, k - 1 + L]``.
        b: ``[B, L, H_v]``, before the sigmoid (``beta``).
        a: ``[B, L, H_v]``, before ``dt_bias`` and softplus (the log decay ``g``).
        conv_weight: ``[conv_dim, 1, k]``.
        conv_bias: ``[conv_dim]`` or ``None``.
        a_log: ``[H_v]``.
        dt_bias: ``[H_v]``.
    """
    dk, dv = m.head_k_dim, m.head_v_dim
    r = m.num_v_heads // m.num_k_heads
    heads = slice(head * r, (head + 1) * r)
    weight = _head_channels(m, head, conv_weight.squeeze(1), 0)
    bias = None if conv_bias is None else _head_channels(m, head, conv_bias, 0)
    conv = file.causal_conv1d_fn(
        _head_channels(m, head, ext, 1), weight, bias, activation=m.activation
    )
    conv = conv[:, :, -n:].transpose(1, 2)  # [B, L, 2 d_k + r d_v]
    q, k, v = conv.split([dk, dk, r * dv], dim=-1)
    rows = q.shape[0]
    q = q.reshape(rows, n, 1, dk)
    k = k.reshape(rows, n, 1, dk)
    v = v.reshape(rows, n, r, dv)
    beta = b[..., heads].sigmoid()
    g = -a_log[heads].float().exp() * F.softplus(a[..., heads].float() + dt_bias[heads])
    wide = torch.cat([v, v.new_zeros(rows, n, r, dk)], dim=-1)
    eye = torch.eye(dk, dtype=torch.float32, device=v.device).expand(rows, r, dk, dk)
    start = torch.cat([eye.new_zeros(rows, r, dk, dv), eye], dim=-1)
    _, summary = file.torch_chunk_gated_delta_rule(
        q,
        k,
        wide,
        g=g,
        beta=beta,
        initial_state=start,
        output_final_state=True,
        use_qk_l2norm_in_kernel=True,
    )
    return (summary,)


class NativeGatedDeltaNet:
    """Scoped hooks that run Gated DeltaNet mixers natively under CP for one batch.

    Args:
        sites: Mixers for which :func:`is_native_gdn` holds.
        group: The CP group.
        meta: The batch's token meta (:func:`serves_native_gdn` must hold for each site).
    """

    def __init__(self, sites: Sequence[MixerSite], group: ProcessGroup, meta: TokenMeta) -> None:
        self.sites = tuple(sites)
        self.group = group
        self.meta = meta
        self._forms: dict[type, str] = {}
        self._calls: dict[int, list[tuple[_Call, list[RemovableHandle]] | None]] = {}

    def _active(self) -> bool:
        mode = active_mode()
        return mode is not None and mode.meta is self.meta

    def _form(self, module: nn.Module) -> str:
        cls = type(module)
        if cls not in self._forms:
            form = gdn_form(module)
            if form is None:
                raise ValueError(f"{cls.__name__} does not run a reference Gated DeltaNet forward")
            self._forms[cls] = form
        return self._forms[cls]

    def pre(
        self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
        """Forward pre-hook: a one-call cache carrying the halo and the incoming state."""
        stack = self._calls.setdefault(id(module), [])
        if not self._active():
            stack.append(None)
            return None
        x = native_input(module, args, kwargs, self.meta.local_len)
        for name in ("cu_seq_lens_q", "cu_seq_lens_k", "seq_idx"):
            if kwargs.get(name) is not None:
                raise ValueError(
                    f"{type(module).__name__} got {name!r} under CP: packed-sequence kwargs "
                    "cannot follow a sequence shard; give cpshard the batch's seq_lens instead"
                )
        form = self._form(module)
        call = _Call(module, form, self.group, self.meta.rank, self.meta.world_size)
        handles = [
            getattr(module, name).register_forward_hook(call.capture(name))
            for name in _FORMS[form][2]
        ]
        stack.append((call, handles))
        return args, native_kwargs(
            module,
            kwargs,
            SeedCache(call.with_halo, functools.partial(call.state_slot, x.shape[0], x.device)),
        )

    def post(self, module: nn.Module, args: Any, kwargs: Any, output: Any) -> Any:
        """Forward hook: drop the call's projection hooks; check the state reached the rule."""
        entry = self._calls[id(module)].pop()
        if entry is None:
            return output
        call, handles = entry
        for h in handles:
            h.remove()
        if not call.filled:
            raise RuntimeError(
                f"{type(module).__name__} ran without asking for its convolution halo, so "
                "cpshard could not hand it its incoming state; run this model at cp=1"
            )
        return output

    def installed(self) -> contextlib.AbstractContextManager[None]:
        """Register the hooks on every site for the span of the block, then remove them."""
        return hooks_on(self.sites, self.pre, self.post)
