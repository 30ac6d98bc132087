"""Find every module of a model that mixes tokens and is not attention.

CP shards the sequence; attention is routed to CP attention, but any *other* module that mixes
tokens (an SSM scan, a gated delta rule, a short causal convolution, a token shift, a linear
recurrence) would run over this rank's shard alone, from a zero state: silently wrong. This
module finds such modules from three kinds of facts, none of them a list of class names:

* **module structure**: a 1-D convolution (``nn.Conv1d`` and subclasses: depthwise causal convs
  over the sequence), parameters or buffers of recurrences and state-space scans (``A_log``,
  ``dt_bias``, ``time_decay``, ...), recurrent-state attributes (``ssm_state_size``,
  ``conv_kernel_size``, ...), a sequence pad/shift module (``nn.ZeroPad*``, ``nn.ConstantPad*``),
  a token compressor's window size (``compress_rate``: DeepSeek-V4 pools windows of tokens into
  extra keys, which a rank's shard cannot form);
* **the config's layer facts**: ``layer_types``, ``layers_block_type``, ``block_types``,
  ``hybrid_override_pattern``: a layer whose type names a mixer (``mamba``,
  ``linear_attention``, ``conv``, ...) must hold one;
* **conservatism**: inside a decoder layer, a direct child that is neither attention nor provably
  position-wise (a tree of linear layers, norms, activations, embeddings, dropout; or an MLP /
  MoE block by its role) is treated as a mixer.

The unit reported is the decoder layer's direct child that contains the evidence (the module
the layer calls with ``hidden_states``), or the flagged module itself outside decoder layers.

Import rules: the rows of ``RULES`` in tests/unit/test_architecture.py that cover this module.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from torch import nn
from torch.utils.hooks import RemovableHandle

from cpshard import _compat
from cpshard.module_tree import ModuleTree

__all__ = ["MixerSite", "decoder_layers", "find_token_mixers", "hooks_on", "layer_kinds"]

# Parameters / buffers of recurrences: SSM (A_log, dt_bias), RWKV (time_decay, time_first,
# time_mix_*, time_maa_*), RG-LRU (recurrent_param), lightning attention (slope_rate), ...
_STATE_PARAM = re.compile(
    r"^(A_log|dt_bias|time_decay|time_first|time_faaaa|time_mix_\w*|time_maa\w*|"
    r"recurrent_param|slope_rate|log_decay|conv_weight|ssm_\w*)$"
)
# Attributes that only a module with a recurrent / convolution state carries.
_STATE_ATTRS = (
    "ssm_state_size",
    "conv_kernel_size",
    "d_state",
    "d_conv",
    "time_step_rank",
    "L_cache",
    "conv_L_cache",
    "linear_conv_kernel_dim",
)
# Attributes of a module that pools each window of consecutive tokens into one entry (DeepSeek-V4's
# KV compressors): its windows follow the global sequence, not a rank's shard.
_COMPRESS_ATTRS = ("compress_rate",)
_ASKED = _STATE_ATTRS + _COMPRESS_ATTRS  # the int attributes the detection reads
_ASKED_SET = frozenset(_ASKED)
# Class-name roles, only read inside decoder layers and only as supporting evidence.
_MIXER_NAME = re.compile(
    r"mamba|ssm|mixer|delta|recurren|rwkv|lstm|shortconv|retention|lightning|linearattention|"
    r"hyena|rglru|lru|scan|hgrn|gla|conv",
    re.IGNORECASE,
)
_ATTENTION_NAME = re.compile(r"attention|attn", re.IGNORECASE)
# A class-name *suffix* naming a position-wise role (MLP, MoE block, experts, norm, ...).
_POSITIONWISE_NAME = re.compile(
    r"(mlp|moe|moeblock|experts?|feedforward|feed_forward|ffn|router|norm|embedding|embeddings|"
    r"dropout|identity|activation|gate|linear|dense)$",
    re.IGNORECASE,
)
_POSITIONWISE_LEAVES = (
    nn.Linear,
    nn.Embedding,
    nn.LayerNorm,
    nn.GroupNorm,
    nn.RMSNorm,
    nn.Dropout,
    nn.Identity,
    nn.GELU,
    nn.SiLU,
    nn.ReLU,
    nn.Tanh,
    nn.Sigmoid,
    nn.Softplus,
)
# Config keys that list one layer type per layer.
_LAYER_TYPE_KEYS = ("layer_types", "layers_block_type", "block_types", "layers_block_types")
# A layer type that names a token mixer outside softmax attention (NemotronH's pattern uses "M").
_MIXER_KINDS = re.compile(
    r"mamba|linear|conv|recurren|rwkv|ssm|delta|lightning|hybrid|lstm|retention|^m$",
    re.IGNORECASE,
)


@dataclass(frozen=True)
class MixerSite:
    """One module that mixes tokens and is not attention.

    Attributes:
        name: Qualified module name (``model.layers.0.linear_attn``).
        module: The module (called by its layer with ``hidden_states [B, L, D]`` first).
        evidence: Why it counts as a token mixer (for the warning / error text).
        inside_attention: The mixing sits inside a softmax-attention module (e.g. a short
            convolution over its keys): no exact path (attention over a gathered sequence is not
            CP attention), so cpshard refuses it at cp > 1.
    """

    name: str
    module: nn.Module
    evidence: str
    inside_attention: bool = False

    @property
    def class_name(self) -> str:
        """The module's class name."""
        return type(self.module).__name__


def decoder_layers(model: nn.Module) -> tuple[str, nn.ModuleList] | None:
    """The model's layer stack: its largest ``nn.ModuleList`` (``(qualified name, list)``).

    Returns ``None`` when the model holds no ``ModuleList`` of two or more modules.
    """
    return _largest_list(_Tree().walk(model))


def _largest_list(walk: list[tuple[str, nn.Module]]) -> tuple[str, nn.ModuleList] | None:
    """:func:`decoder_layers` from a walk of the model (``named_modules()`` order)."""
    best: tuple[str, nn.ModuleList] | None = None
    for name, module in walk:
        if not isinstance(module, nn.ModuleList) or len(module) < 2:
            continue
        if best is None or len(module) > len(best[1]):
            best = (name, module)
    return best


def layer_kinds(config: object, num_layers: int) -> list[str] | None:
    """The config's per-layer type strings (``layer_types`` and alike), or ``None``.

    ``hybrid_override_pattern`` (``"M*M-"``) is read one character per layer.
    """
    for key in _LAYER_TYPE_KEYS:
        try:
            value = getattr(config, key, None)
        except Exception:  # a property that cannot be computed for this config
            value = None
        if isinstance(value, Sequence) and not isinstance(value, str) and len(value) == num_layers:
            return [str(v) for v in value]
    pattern = getattr(config, "hybrid_override_pattern", None)
    if isinstance(pattern, str) and len(pattern) == num_layers:
        return list(pattern)
    return None


def _is_mixer_kind(kind: str) -> bool:
    return _MIXER_KINDS.search(kind) is not None


class _Tree:
    """The module facts one detection reads, each module's read once: its own members
    (:func:`cpshard._compat.own_members`) and walks in ``named_modules()`` order. Made per
    :func:`find_token_mixers` call (nothing outlives it)."""

    def __init__(self) -> None:
        self._members: dict[int, tuple[list[tuple[str, nn.Module]], list[str], list[str]]] = {}
        self._asks: dict[type, frozenset[str]] = {}
        # the first full walk, and each of its modules' subtree as a slice of it (where no
        # module is reached twice: then a subtree's walk is that slice)
        self._walked: list[tuple[str, nn.Module]] = []
        self._spans: dict[int, tuple[int, int]] = {}

    def members(
        self, module: nn.Module
    ) -> tuple[list[tuple[str, nn.Module]], list[str], list[str]]:
        """``(children, parameter names, buffer names)`` of ``module`` itself."""
        got = self._members.get(id(module))
        if got is None:
            got = _compat.own_members(module)
            self._members[id(module)] = got
        return got

    def asked(self, cls: type) -> frozenset[str]:
        """The names of :data:`_ASKED` that ``getattr`` can find on an instance of ``cls``
        beyond the instance's ``__dict__`` (:func:`cpshard._compat.class_answers`)."""
        got = self._asks.get(cls)
        if got is None:
            got = frozenset(n for n in _ASKED if _compat.class_answers(cls, n))
            self._asks[cls] = got
        return got

    def walk(self, root: nn.Module) -> list[tuple[str, nn.Module]]:
        """``list(root.named_modules())``: pre-order, each module once (at its first name).

        The first walk also records each module's subtree as a slice of its list, where no
        module is reached twice (:meth:`modules` then slices instead of walking again)."""
        out: list[tuple[str, nn.Module]] = []
        memo: set[int] = set()
        first = not self._walked  # only the first walk records the subtrees
        spans: dict[int, tuple[int, int]] = {}
        shared = False
        stack: list[tuple[str, nn.Module, bool]] = [("", root, False)]
        while stack:
            name, module, leaving = stack.pop()
            if leaving:  # every module under it is listed: its subtree ends here
                spans[id(module)] = (spans[id(module)][0], len(out))
                continue
            if id(module) in memo:
                shared = True
                continue
            memo.add(id(module))
            if first:
                spans[id(module)] = (len(out), -1)
                stack.append((name, module, True))
            out.append((name, module))
            for child_name, child in reversed(self.members(module)[0]):
                stack.append((f"{name}.{child_name}" if name else child_name, child, False))
        if first:
            self._walked = out
            self._spans = {} if shared else spans
        return out

    def modules(self, root: nn.Module) -> list[nn.Module]:
        """The modules of :meth:`walk` of ``root`` (without their names): a slice of the first
        walk where ``root`` is in it and no module is shared, else a walk of its own."""
        span = self._spans.get(id(root))
        if span is None:
            return [m for _, m in self.walk(root)]
        return [m for _, m in self._walked[span[0] : span[1]]]


def _structural_evidence(module: nn.Module, tree: _Tree) -> str | None:
    """Evidence of token mixing from this module's own children, parameters and attributes."""
    children, params, buffers = tree.members(module)
    for child_name, child in children:
        if isinstance(child, nn.Conv1d):
            return f"a 1-D convolution over the sequence ({child_name}: {type(child).__name__})"
        if isinstance(child, nn.ZeroPad1d | nn.ZeroPad2d | nn.ConstantPad1d | nn.ConstantPad2d):
            return f"a sequence shift ({child_name}: {type(child).__name__})"
    for n in params + buffers:
        if _STATE_PARAM.match(n):
            return f"a recurrence / state-space parameter ({n})"
    ints = _int_attributes(module, tree)
    if not ints:
        return None
    for attr in _STATE_ATTRS:
        if attr in ints:
            return f"a recurrent-state attribute ({attr})"
    for attr in _COMPRESS_ATTRS:
        rate = ints.get(attr)
        if isinstance(rate, int) and not isinstance(rate, bool) and rate > 1:
            return f"a token compressor pooling windows of {rate} consecutive tokens ({attr})"
    return None


def _int_attributes(module: nn.Module, tree: _Tree) -> dict[str, int]:
    """``{name: getattr(module, name)}`` for the names of :data:`_ASKED` whose value is an
    ``int`` (``bool`` included); without the miss path of ``nn.Module.__getattr__`` (a raised
    and caught ``AttributeError``; the detection asks ~9 absent names of every module on every
    prepare): an instance attribute, else ``getattr`` only where the class can answer
    (:meth:`_Tree.asked`). Most modules have none of the names: one set intersection answers
    for them."""
    own = module.__dict__
    names = _ASKED_SET.intersection(own.keys()) | tree.asked(type(module))
    if not names:
        return {}
    out: dict[str, int] = {}
    for name in names:
        value = own[name] if name in own else getattr(module, name, None)
        if isinstance(value, int):
            out[name] = value
    return out


def _deep_evidence(module: nn.Module, tree: _Tree) -> str | None:
    for sub in tree.modules(module):
        found = _structural_evidence(sub, tree)
        if found is not None:  # named as the walk of this module names it
            sub_name = next(n for n, m in tree.walk(module) if m is sub)
            where = f"{sub_name}: " if sub_name else ""
            return where + found
    return None


def _provably_positionwise(module: nn.Module, tree: _Tree) -> bool:
    """A tree of position-wise leaves, or a block whose role (MLP, MoE, norm) is position-wise."""
    if _POSITIONWISE_NAME.search(type(module).__name__):
        return True
    leaves = [m for m in tree.modules(module) if not tree.members(m)[0]]
    return bool(leaves) and all(
        isinstance(m, _POSITIONWISE_LEAVES) or _POSITIONWISE_NAME.search(type(m).__name__)
        for m in leaves
    )


def _is_attention(module: nn.Module) -> bool:
    name = type(module).__name__
    return bool(_ATTENTION_NAME.search(name)) and not _MIXER_NAME.search(name)


def _walk_outside(
    walk: list[tuple[str, nn.Module]], model: nn.Module, inside: set[int]
) -> Iterator[tuple[str, nn.Module]]:
    for name, module in walk:
        if id(module) not in inside and module is not model:
            yield name, module


def find_token_mixers(model: nn.Module, tree: ModuleTree | None = None) -> tuple[MixerSite, ...]:
    """Every module of ``model`` that mixes tokens and is not attention (see the module doc).

    Args:
        model: Any ``nn.Module`` (an HF causal LM, a custom decoder).
        tree: ``model``'s :class:`~cpshard.module_tree.ModuleTree` of this call, whose memo
            keeps the sites while the tree, the config's layer types and the modules' state
            attributes are unchanged (``None``: detect from scratch).

    Returns:
        The sites, in module order; empty for a pure-attention model.

    Raises:
        ValueError: the config says a layer mixes tokens outside attention but no module of that
            layer can be identified as the mixer (cpshard cannot run it exactly).
    """
    if tree is None:
        return _detect(model)
    modules = tree.modules()
    n_layers = tree.memo("decoder layers", (), lambda: _layer_count(modules, tree.names))
    kinds = layer_kinds(getattr(model, "config", None), n_layers) if n_layers else None
    key = (None if kinds is None else tuple(kinds), _state_attributes(modules))
    kept = tree.memo("token mixers", key, lambda: _site_rows(model, modules))
    return tuple(MixerSite(name, modules[i], why, inside) for name, i, why, inside in kept)


def _state_attributes(modules: list[nn.Module]) -> tuple[tuple[int, tuple[Any, ...]], ...]:
    """``(index, sorted int attributes)`` of every module with an int attribute the detection
    reads (:func:`_int_attributes`), in walk order: the values it reads beyond the structure."""
    asks = _Tree()
    out = []
    for i, m in enumerate(modules):
        if _ASKED_SET.isdisjoint(m.__dict__) and not asks.asked(type(m)):
            continue  # most modules: none of the names, on the instance or its class
        found = _int_attributes(m, asks)
        if found:
            out.append((i, tuple(sorted(found.items()))))
    return tuple(out)


def _layer_count(modules: list[nn.Module], names: list[str]) -> int:
    """The length of :func:`decoder_layers`' list (0: none), from a walk of the model."""
    found = _largest_list(list(zip(names, modules, strict=True)))
    return 0 if found is None else len(found[1])


_SiteRow = tuple[str, int, str, bool]


def _site_rows(model: nn.Module, modules: list[nn.Module]) -> tuple[_SiteRow, ...]:
    """:func:`_detect`'s sites as ``(name, index into modules, evidence, inside_attention)``:
    nothing of the model held (a memo value of its module tree)."""
    at: dict[int, int] = {}
    for i, m in enumerate(modules):
        at.setdefault(id(m), i)
    return tuple((s.name, at[id(s.module)], s.evidence, s.inside_attention) for s in _detect(model))


def _detect(model: nn.Module) -> tuple[MixerSite, ...]:
    tree = _Tree()
    walk = tree.walk(model)
    found = _largest_list(walk)
    sites: list[MixerSite] = []
    inside: set[int] = set()
    if found is not None:
        prefix, layers = found
        kinds = layer_kinds(getattr(model, "config", None), len(layers))
        for i, layer in enumerate(layers):
            inside.update(id(m) for m in tree.modules(layer))
            kind = kinds[i] if kinds is not None else None
            name = f"{prefix}.{i}" if prefix else str(i)
            layer_sites = list(_layer_sites(name, layer, kind, tree))
            if kind is not None and _is_mixer_kind(kind) and not layer_sites:
                raise ValueError(
                    f"the config says layer {i} of {type(model).__name__} is a "
                    f"{kind!r} layer (not softmax attention), but cpshard cannot tell which "
                    f"module of {type(layer).__name__} mixes the tokens, so it cannot run it "
                    "exactly under CP; run this model at cp=1"
                )
            sites.extend(layer_sites)
    # Outside the layer stack: structural evidence only (class names of wrappers say nothing).
    taken: list[str] = []
    for name, module in _walk_outside(walk, model, inside):
        if any(name.startswith(t + ".") for t in taken):
            continue
        evidence = _structural_evidence(module, tree)
        if evidence is not None:
            taken.append(name)
            sites.append(MixerSite(name, module, evidence))
    return tuple(sites)


def _layer_sites(
    prefix: str, layer: nn.Module, kind: str | None, tree: _Tree
) -> Iterator[MixerSite]:
    own = _structural_evidence(layer, tree)
    if own is not None:  # the layer itself carries the state: it is the unit
        yield MixerSite(prefix, layer, own)
        return
    for child_name, child in tree.members(layer)[0]:
        name = f"{prefix}.{child_name}"
        evidence = _deep_evidence(child, tree)
        if evidence is not None:
            yield MixerSite(name, child, evidence, inside_attention=_is_attention(child))
        elif _provably_positionwise(child, tree):
            continue
        elif _MIXER_NAME.search(type(child).__name__):
            yield MixerSite(name, child, f"its role ({type(child).__name__})")
        elif _is_attention(child):
            continue
        else:
            layer_kind = f" in a {kind!r} layer" if kind is not None else ""
            yield MixerSite(
                name, child, f"not provably position-wise and not attention{layer_kind}"
            )


@contextlib.contextmanager
def hooks_on(
    sites: Sequence[MixerSite], pre: Callable[..., Any], post: Callable[..., Any]
) -> Iterator[None]:
    """``pre`` / ``post`` as forward (pre-)hooks with kwargs on every site's module for the span of
    the block (``post`` also runs when the forward raises), then removed."""
    handles: list[RemovableHandle] = []
    try:
        for site in sites:
            handles.append(site.module.register_forward_pre_hook(pre, with_kwargs=True))
            handles.append(
                site.module.register_forward_hook(post, with_kwargs=True, always_call=True)
            )
        yield
    finally:
        for h in handles:
            h.remove()
