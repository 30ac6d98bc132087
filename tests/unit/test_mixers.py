"""Token mixers outside attention: detection, the segment layout, the verdict (no process group)."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

from _wrappers import Forwarding
from cpshard.mixers import CPMixerWarning, check_token_mixers, find_token_mixers
from cpshard.mixers.generic import gather_segments, local_rows
from cpshard.mixers.segments import segment_plan
from cpshard.sharding.meta import TokenMeta, pad_document_ids


class _Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q_proj = nn.Linear(4, 4)


class _MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(4, 8)
        self.down = nn.Linear(8, 4)


class _Scan(nn.Module):
    """No convolution, no recognisable role: only its state parameter gives it away."""

    def __init__(self) -> None:
        super().__init__()
        self.A_log = nn.Parameter(torch.zeros(4))
        self.proj = nn.Linear(4, 4)


class _Shift(nn.Module):
    """A causal depthwise convolution over the sequence, with a neutral class name."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv1d(4, 4, 3, groups=4, padding=2)


class _Opaque(nn.Module):
    """A module cpshard cannot prove position-wise: counts as a mixer (conservative)."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(4))


class _Layer(nn.Module):
    def __init__(self, mixer: nn.Module | None) -> None:
        super().__init__()
        self.input_norm = nn.LayerNorm(4)
        self.self_attn = _Attention()
        self.mlp = _MLP()
        if mixer is not None:
            self.token_mixer = mixer


class _Model(nn.Module):
    def __init__(self, *mixers: nn.Module | None) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 4)
        self.layers = nn.ModuleList(_Layer(m) for m in mixers)


class _Config:
    def __init__(self, layer_types: list[str]) -> None:
        self.layer_types = layer_types


def test_pure_attention_model_has_no_mixers() -> None:
    assert find_token_mixers(_Model(None, None)) == ()


@pytest.mark.parametrize(
    ("mixer", "evidence"),
    [(_Scan(), "A_log"), (_Shift(), "convolution"), (_Opaque(), "not provably position-wise")],
)
def test_structure_finds_mixers_without_names(mixer: nn.Module, evidence: str) -> None:
    (site,) = find_token_mixers(_Model(None, mixer))
    assert site.name == "layers.1.token_mixer"
    assert site.module is mixer
    assert evidence in site.evidence


def test_int_attributes_read_as_getattr_does() -> None:
    """The detection's int attribute reads (no ``nn.Module.__getattr__`` miss path) answer as
    ``getattr(module, name, None)`` kept where an int, for instance and class attributes,
    properties, parameters, submodules, absent names, and a wrapper whose own ``__getattr__``
    forwards."""
    from cpshard.mixers.detect import _ASKED, _int_attributes, _Tree

    class _Cls(nn.Module):
        d_state = 16  # a class attribute

        @property
        def d_conv(self) -> int:
            return 4

    plain = _Cls()
    plain.ssm_state_size = 8
    plain.conv_kernel_size = nn.Parameter(torch.ones(2))
    plain.time_step_rank = nn.Linear(2, 2)
    plain.compress_rate = True  # a bool is an int
    wrapped = Forwarding(plain)
    tree = _Tree()
    for module in (plain, wrapped, nn.Linear(2, 2)):
        got = _int_attributes(module, tree)
        for name in _ASKED:
            value = getattr(module, name, None)
            want = value if isinstance(value, int) else None
            assert got.get(name) == want, (module, name)
        assert set(got) <= set(_ASKED)
    assert find_token_mixers(_Model(None, wrapped))[0].evidence.startswith("a recurrent-state")


def test_the_detections_walk_is_named_modules() -> None:
    """The detection's one-read-per-module walk lists what ``named_modules()`` lists, in its
    order: a submodule shared by two parents once (at its first name), ``None`` children
    skipped."""
    from cpshard.mixers.detect import _Tree

    shared = nn.Linear(2, 2)
    m = _Model(None, _Scan())
    m.layers[0].extra = shared
    m.layers[1].token_mixer.again = shared
    m.layers[1].register_module("empty", None)
    m.tail = nn.Sequential(shared, nn.ReLU(), m.embed)
    got = [(n, id(x)) for n, x in _Tree().walk(m)]
    assert got == [(n, id(x)) for n, x in m.named_modules()]
    assert [(n, id(x)) for n, x in _Tree().walk(m.layers[1])] == [
        (n, id(x)) for n, x in m.layers[1].named_modules()
    ]


def test_config_layer_type_without_a_module_raises() -> None:
    model = _Model(None, None)
    model.config = _Config(["full_attention", "linear_attention"])  # type: ignore[assignment]
    with pytest.raises(ValueError, match="layer 1 .* 'linear_attention' layer"):
        find_token_mixers(model)
    model.config = _Config(["full_attention", "moe"])  # type: ignore[assignment]
    assert find_token_mixers(model) == ()  # an MoE layer type is position-wise


def test_mixer_inside_attention_is_refused() -> None:
    model = _Model(None, None)
    model.layers[1].self_attn.k_conv = nn.Conv1d(4, 4, 3, groups=4)  # type: ignore[union-attr]
    (site,) = find_token_mixers(model)
    assert site.inside_attention
    with pytest.raises(ValueError, match="inside softmax attention"):
        check_token_mixers(model, 2, strict=False, packed=False)


def test_token_compressor_inside_attention_is_refused() -> None:
    """DeepSeek-V4's KV compressors pool windows of consecutive tokens into extra keys: at a
    tiny length no window closes (the model looked exact), at a real one the keys outgrow the
    shard mid-forward. Found by their window size and refused before any collective."""
    pytest.importorskip("transformers")
    from _hf_sweep import tiny_model

    try:
        model = tiny_model("deepseek_v4")
    except Exception as e:  # another transformers: nothing to check
        pytest.skip(f"no tiny deepseek_v4 here: {e}")
    sites = find_token_mixers(model)
    assert sites and all(s.inside_attention for s in sites)
    assert any("Compressor" in type(m).__name__ for s in sites for m in s.module.modules())
    assert any("token compressor" in s.evidence for s in sites)
    with pytest.raises(ValueError, match=r"inside softmax attention .*DeepseekV4Attention"):
        check_token_mixers(model, 2, strict=False, packed=False)
    assert check_token_mixers(model, 1, strict=False, packed=False).layout  # cp=1 dense: fine
    compressor = nn.Module()
    compressor.compress_rate = 1  # type: ignore[assignment]  # a window of one token: no mixing
    holder = _Model(None, None)
    holder.layers[0].self_attn.compressor = compressor  # type: ignore[union-attr]
    assert find_token_mixers(holder) == ()


def test_verdict() -> None:
    model = _Model(_Scan(), None)
    assert check_token_mixers(model, 1, strict=True, packed=False).sites == ()  # cp=1: unchanged
    with pytest.raises(ValueError, match=r"strict=True.*_Scan|_Scan.*strict=True"):
        check_token_mixers(model, 2, strict=True, packed=False)
    with pytest.raises(ValueError, match="across document boundaries"):
        check_token_mixers(model, 1, strict=True, packed=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert len(check_token_mixers(model, 1, strict=False, packed=True).sites) == 1
        assert not caught  # cp=1 packed: exact per document, nothing computed twice
        plan = check_token_mixers(model, 3, strict=False, packed=False)
        assert len(plan.sites) == 1
        assert plan.native == ()
        assert plan.layout == "auto"  # no native site: the caller's layout stays
    (w,) = caught
    assert issubclass(w.category, CPMixerWarning)
    assert "layers.0.token_mixer" in str(w.message) and "3x" in str(w.message)


def _meta(rank_map: torch.Tensor, docs: torch.Tensor, pads: torch.Tensor, rank: int) -> TokenMeta:
    stream = rank_map.reshape(1, -1)
    doc = pad_document_ids(docs, pads).index_select(1, stream[0])
    return TokenMeta(rank, rank_map.shape[0], stream, doc)


def test_segments_follow_documents_in_global_order() -> None:
    # 12 tokens, head-tail layout over 2 ranks, documents [0]*5 + [1]*4 + [2]*1, 2 pads at the end.
    rank_map = torch.tensor([[0, 1, 2, 9, 10, 11], [3, 4, 5, 6, 7, 8]])
    docs = torch.tensor([[0] * 5 + [1] * 4 + [2] + [0, 0]])
    pads = torch.zeros(1, 12, dtype=torch.bool)
    pads[0, 10:] = True
    x_global = torch.randn(2, 12, 3, dtype=torch.float64)
    want_rows = []
    for rank in range(2):
        meta = _meta(rank_map, docs, pads, rank)
        plan = segment_plan(meta, 2, torch.device("cpu"))
        assert plan.num_segments == 2 * 4 and plan.max_len == 5
        assert plan.lengths.tolist() == [5, 4, 1, 2] * 2
        # the gathered stream is rank-major: every rank's local rows, in order
        stream = x_global[:, rank_map.reshape(-1)]
        local = x_global[:, rank_map[rank]]
        flat = torch.cat([stream.reshape(24, 3), stream.new_zeros(1, 3)])
        seg = flat.index_select(0, plan.source.reshape(-1)).reshape(8, 5, 3)
        assert torch.equal(seg[0], x_global[0, :5])
        assert torch.equal(seg[1, :4], x_global[0, 5:9])
        assert torch.equal(seg[1, 4], torch.zeros(3, dtype=torch.float64))
        assert torch.equal(seg[6, :1], x_global[1, 9:10])
        want_rows.append(local)
        assert torch.equal(local_rows(seg, plan), local)
        assert not plan.trivial
    assert torch.equal(
        gather_segments(
            x_global,
            segment_plan(
                _meta(
                    torch.arange(12)[None],
                    torch.zeros(1, 12, dtype=torch.long),
                    torch.zeros(1, 12, dtype=torch.bool),
                    0,
                ),
                2,
                torch.device("cpu"),
            ),
            None,
        ),
        x_global,
    )


def test_one_document_per_row_at_cp1_is_trivial() -> None:
    meta = _meta(torch.arange(6)[None], torch.zeros(1, 6, dtype=torch.long),
                 torch.zeros(1, 6, dtype=torch.bool), 0)  # fmt: skip
    assert segment_plan(meta, 3, torch.device("cpu")).trivial


def test_native_serving_needs_in_order_single_document_shards() -> None:
    from cpshard.mixers.mamba2 import serves_native

    def meta(stream: torch.Tensor, docs: torch.Tensor, rank: int = 1) -> TokenMeta:
        return TokenMeta(rank, 2, stream[None], docs[None])

    order = torch.arange(8)
    one_doc = torch.zeros(8, dtype=torch.long)
    assert serves_native(meta(order, one_doc), 4)
    assert not serves_native(meta(torch.tensor([0, 1, 6, 7, 2, 3, 4, 5]), one_doc), 4)
    assert not serves_native(meta(order, torch.tensor([0, 0, 0, 1, 1, 1, 1, 1])), 4)
    trailing_pads = torch.tensor([0, 0, 0, 0, 0, 0, -7, -8])
    assert serves_native(meta(order, trailing_pads), 4)
    leading_pads = torch.tensor([-1, -2, 0, 0, 0, 0, 0, 0])
    assert not serves_native(meta(order, leading_pads), 4)
    assert not serves_native(meta(order, one_doc), 6)  # 4 local tokens < 5 halo tokens


@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "autocast_bf16"])
def test_recomputed_gradient_is_the_one_of_the_forward_it_replaces(autocast: bool) -> None:
    """A native mixer's state summary is recomputed in the backward: under autocast (a bf16
    Trainer) the recompute must run in the forward's precision, or the gradient belongs to
    another function than the value (silently). Bitwise equal to plain autograd."""
    from cpshard.mixers.recompute import recomputed

    gen = torch.Generator().manual_seed(0)
    x = torch.randn(6, 32, generator=gen, requires_grad=True)
    w = torch.randn(32, 16, generator=gen, requires_grad=True)
    up = torch.randn(6, 16, generator=gen)

    def fn(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return (torch.tanh(a @ b),)

    grads = []
    for run in (lambda: fn(x, w), lambda: recomputed(fn, x, w)):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            (out,) = run()
        grads.append(torch.autograd.grad(out, (x, w), up.to(out.dtype)))
    for got, want in zip(grads[1], grads[0], strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


@pytest.mark.parametrize("share", [False, True])
def test_the_detections_subtree_walks_are_named_modules(share: bool) -> None:
    """After the model's walk, the modules under any of its modules are those of that
    module's own ``named_modules()``, in order (slices of the model's walk, or, with a
    submodule shared by two parents, walks of their own)."""
    from cpshard.mixers.detect import _Tree

    inner = nn.Linear(2, 2)
    layers = nn.ModuleList(
        nn.Sequential(nn.Linear(2, 2), nn.Sequential(nn.ReLU(), inner if share else nn.Tanh()))
        for _ in range(3)
    )
    model = nn.Sequential(nn.Embedding(4, 2), layers, nn.Sequential(inner, nn.Linear(2, 2)))
    tree = _Tree()
    assert [n for n, _ in tree.walk(model)] == [n for n, _ in model.named_modules()]
    for module in model.modules():
        assert tree.modules(module) == [m for _, m in module.named_modules()]
