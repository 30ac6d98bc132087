"""The module tree a prepare's model checks share, kept between prepares (no process group).

Whatever changes between two prepares of one model must reach the checks exactly as a fresh walk
would see it (a kept memo that hides a change is a silently skipped check), and the kept tree
must not keep the model or a replaced module or tensor alive.
"""

from __future__ import annotations

import gc
import weakref
from collections.abc import Callable, Iterator

import pytest
import torch
from test_mixers import _Config, _Model, _Shift
from torch import nn

from cpshard.attention.pieces import _gc_paused
from cpshard.guards.model import check_gradient_checkpointing, install_model_guard
from cpshard.guards.step import model_fingerprint
from cpshard.mixers import find_token_mixers
from cpshard.models import TinyDecoder, TinyDecoderConfig
from cpshard.module_tree import ModuleTree

_CFG = TinyDecoderConfig(vocab_size=50, hidden_size=8, num_layers=3, num_heads=2, num_kv_heads=1)


def _model() -> TinyDecoder:
    return TinyDecoder.from_config(_CFG, seed=0)


@pytest.fixture
def no_gc() -> Iterator[None]:
    """Reference counting alone: a cycle through the model would keep it alive."""
    gc.collect()
    with _gc_paused():
        yield


def _swap_child(m: TinyDecoder) -> None:
    m.blocks[1].up = nn.Sequential(nn.Linear(8, 256))


def _add_child(m: TinyDecoder) -> None:
    m.blocks[0].extra = nn.Identity()


def _rename(m: TinyDecoder) -> None:
    layer = m.blocks[2]
    layer.renamed = layer.up
    del layer.up


def _swap_parameter(m: TinyDecoder) -> None:
    m.embed.weight = nn.Parameter(m.embed.weight.detach().clone())


def _add_buffer(m: TinyDecoder) -> None:
    m.blocks[0].register_buffer("steps", torch.zeros(2))


def _buffer_persistence(m: TinyDecoder) -> None:
    m.blocks[0].register_buffer("steps", torch.zeros(2))
    m.blocks[0].register_buffer("steps", m.blocks[0].steps, persistent=False)


def _swap_class(m: TinyDecoder) -> None:
    cls = type(m.blocks[1])
    m.blocks[1].__class__ = type("Subclassed", (cls,), {})


def _append_layer(m: TinyDecoder) -> None:
    m.blocks.append(nn.Linear(8, 8))


CHANGES: list[Callable[[TinyDecoder], None]] = [
    _swap_child, _add_child, _rename, _swap_parameter, _add_buffer, _buffer_persistence,
    _swap_class, _append_layer,
]  # fmt: skip


def test_an_unchanged_tree_is_kept_with_its_memo() -> None:
    model = _model()
    tree = ModuleTree.of(model, None)
    assert tree.names == [n for n, _ in model.named_modules()]
    assert all(a is b for a, b in zip(tree.modules(), model.modules(), strict=True))
    calls = []
    assert tree.memo("x", 1, lambda: calls.append(1) or "made") == "made"
    model.train(False)  # state, not structure
    with torch.no_grad():
        model.embed.weight.add_(1.0)  # values, not structure
    kept = ModuleTree.of(model, tree)
    assert kept is tree
    assert kept.memo("x", 1, lambda: calls.append(2) or "again") == "made" and calls == [1]
    assert kept.memo("x", 2, lambda: calls.append(3) or "other key") == "other key"
    assert ModuleTree.of(_model(), tree) is not tree  # another model


@pytest.mark.parametrize("change", CHANGES, ids=lambda f: f.__name__)
def test_any_change_of_structure_walks_again(change: Callable[[TinyDecoder], None]) -> None:
    model = _model()
    tree = ModuleTree.of(model, None)
    tree.memo("x", (), lambda: "stale")
    change(model)
    fresh = ModuleTree.of(model, tree)
    assert fresh is not tree
    assert fresh.names == [n for n, _ in model.named_modules()]
    assert all(a is b for a, b in zip(fresh.modules(), model.modules(), strict=True))
    assert fresh.memo("x", (), lambda: "new") == "new"


def test_the_kept_tree_holds_nothing_alive(no_gc: None) -> None:
    """The guard keeps the tree on the model: a strong reference to a module or tensor would
    keep a replaced one (or, through a cycle, the model) alive."""
    model = _model()
    install_model_guard(model, 2)  # the tree on the model's guard, with every memo filled
    tree = install_model_guard(model, 2)
    find_token_mixers(model, tree)
    model_fingerprint(model, read_values=True, tree=tree)
    # not even a weak one to a tensor: torch.utils.swap_tensors (nn.Module.to of DTensor
    # parameters, or with torch's swap flag on) refuses a tensor that has one
    assert not [w for t in (*model.parameters(), *model.buffers()) for w in weakref.getweakrefs(t)]
    old_mlp = weakref.ref(model.blocks[1].up)
    old_weight = weakref.ref(model.embed.weight)
    _swap_child(model)
    _swap_parameter(model)
    assert old_mlp() is None and old_weight() is None
    whole = weakref.ref(model)
    del model, tree
    assert whole() is None


def test_a_dead_module_walks_again() -> None:
    """A module of the kept walk was freed (its id may now be another object's): walk again."""
    model = _model()
    tree = ModuleTree.of(model, None)
    model.blocks[1] = nn.Linear(8, 8)  # the old layer and its children die
    assert ModuleTree.of(model, tree) is not tree
    with pytest.raises(RuntimeError, match="was freed"):
        tree.modules()


def _mixers(model: nn.Module, tree: ModuleTree | None) -> list[tuple[str, nn.Module, str]]:
    return [(s.name, s.module, s.evidence) for s in find_token_mixers(model, tree)]


def test_mixer_sites_from_the_kept_tree_equal_a_fresh_detection() -> None:
    """Every change the detection reads reaches it through the kept tree: a mixer inserted into
    a layer, a state attribute set on a module, the config's layer types."""
    model = _Model(None, None, None)  # three layers of attention and an MLP
    tree = ModuleTree.of(model, None)
    assert _mixers(model, tree) == _mixers(model, None) == []
    model.layers[1].mlp = _Shift()  # a structure change: a new tree
    tree = ModuleTree.of(model, tree)
    assert _mixers(model, tree) == _mixers(model, None)
    assert [n for n, _, _ in _mixers(model, tree)] == ["layers.1.mlp"]
    assert ModuleTree.of(model, tree) is tree  # unchanged: the kept sites
    assert _mixers(model, tree) == _mixers(model, None)
    model.layers[2].mlp.ssm_state_size = 16  # an attribute, no structure change
    assert ModuleTree.of(model, tree) is tree
    assert [n for n, _, _ in _mixers(model, tree)] == ["layers.1.mlp", "layers.2.mlp"]
    assert _mixers(model, tree) == _mixers(model, None)
    model.config = _Config(["attention", "mamba", "attention"])  # layer 1 is a mixer: found
    assert _mixers(model, tree) == _mixers(model, None)
    model.config = _Config(["mamba", "attention", "attention"])  # layer 0 has none: refused
    for t in (tree, None):
        with pytest.raises(ValueError, match="layer 0"):
            find_token_mixers(model, t)


def _fingerprints_agree(model: nn.Module, tree: ModuleTree) -> None:
    for values in (True, False):
        kept = model_fingerprint(model, read_values=values, tree=tree)
        fresh = model_fingerprint(model, read_values=values)
        assert kept.layout == fresh.layout and kept.names == fresh.names
        assert torch.equal(kept.values, fresh.values) and torch.equal(kept.keys, fresh.keys)


@pytest.mark.parametrize("mixed", [False, True], ids=["plain", "mixed"])
def test_the_fingerprint_from_the_kept_tree_reads_every_change(mixed: bool) -> None:
    """Values, storages, shapes, dtypes, layouts and the trainable pattern change without the
    tree changing: each reaches the kept tree's fingerprint as a fresh one's. ``plain``: only
    contiguous real tensors (one view each, the fast path); ``mixed``: a complex, a transposed,
    a meta and an empty entry too."""
    g = torch.Generator().manual_seed(0)
    model = _model()
    steps: list[Callable[[], object]] = [
        lambda: model.embed.weight.data.add_(1.0),  # in place: the same storage
        lambda: setattr(model.embed.weight, "data", model.embed.weight.data * 2),  # new storage
        lambda: model.blocks[0].up.weight.requires_grad_(False),
        # the same shape and dtype, no longer contiguous (a sample is no longer one view)
        lambda: setattr(model.head.weight, "data", model.head.weight.data.t().contiguous().t()),
        lambda: setattr(model.head.weight, "data", model.head.weight.data.contiguous()),
        lambda: setattr(model.embed.weight, "data", model.embed.weight.data[:, :4].clone()),
        lambda: model.blocks[1].to(torch.float64),
    ]
    if mixed:
        model.register_buffer("c", torch.randn(4, dtype=torch.complex64, generator=g))
        model.t = nn.Parameter(torch.randn(70, 50, generator=g).t())  # not contiguous
        model.register_buffer("m", torch.zeros(5, device="meta"))
        model.register_buffer("e", torch.zeros(0))
        model.register_buffer("cache", torch.ones(3), persistent=False)
        steps += [
            lambda: setattr(model.t, "data", model.t.data.t().contiguous()),  # now contiguous
            lambda: model.c.mul_(2),
        ]
    tree = ModuleTree.of(model, None)
    first = model_fingerprint(model, read_values=True, tree=tree)
    _fingerprints_agree(model, tree)
    for step in steps:
        step()
        assert ModuleTree.of(model, tree) is tree
        _fingerprints_agree(model, tree)
    assert model_fingerprint(model, read_values=True, tree=tree).layout != first.layout


def test_gradient_checkpointing_enabled_after_a_prepare_is_seen_through_the_kept_tree() -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    model = LlamaForCausalLM(LlamaConfig(
        vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1,
    ))  # fmt: skip
    tree = install_model_guard(model, 2)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    assert ModuleTree.of(model, tree) is tree  # flags, not structure
    with pytest.raises(ValueError, match="checkpoints without cpshard's recompute context"):
        check_gradient_checkpointing(model, tree)
    with pytest.raises(ValueError, match="checkpoints without cpshard's recompute context"):
        install_model_guard(model, 2)
