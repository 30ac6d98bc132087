"""One prepare pipeline behind both entry points: options validated once, every check run once.

The pipeline (:func:`cpshard.dispatch.run_prepare`) calls its checks only through a
:class:`cpshard.dispatch.PrepareChecks`; here each check is a counting wrapper of the real one,
so the counts are the real calls (and the source walk below proves the dispatcher reaches no
check function past that object).
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.testing import assert_close

import cpshard
from _counting import CHECK_NAMES, counting_checks
from cpshard import dispatch
from cpshard.attention.cost import CostModel
from cpshard.dispatch import run_prepare
from cpshard.models.decoder import TinyDecoder, TinyDecoderConfig
from cpshard.models.global_prefix import GlobalPrefixConfig, GlobalPrefixDecoder
from cpshard.options import PrepareOptions

CFG = TinyDecoderConfig(
    vocab_size=40, hidden_size=16, num_layers=1, num_heads=2, num_kv_heads=1, intermediate_size=32
)


def _dense() -> dict[str, torch.Tensor]:
    ids = torch.arange(22).reshape(2, 11) % 39
    return {"input_ids": ids, "labels": cpshard.shift_labels(ids)}


def _packed() -> dict[str, Any]:
    ids = torch.arange(10).reshape(1, 10)
    return {"input_ids": ids, "seq_lens": [[3, 5, 2]]}


def _model() -> TinyDecoder:
    torch.manual_seed(0)
    return TinyDecoder(CFG)


@pytest.mark.parametrize(
    ("entry", "batch", "expected"),
    [
        ("make", _dense, ["cp_mesh", "batch_mapping", "padding_token_id"]),
        ("make", _packed, ["cp_mesh", "batch_mapping", "padding_token_id"]),
        ("make+model", _dense, ["cp_mesh", "token_mixers", "batch_mapping", "padding_token_id"]),
        ("prepare", _dense, ["cp_mesh", "token_mixers", "batch_mapping", "padding_token_id"]),
        ("prepare", _packed, ["cp_mesh", "token_mixers", "batch_mapping", "padding_token_id"]),
        ("prepare+hook", _dense, ["cp_mesh", "batch_mapping", "padding_token_id", "model_sharder"]),
    ],
)
def test_every_check_runs_once_in_pipeline_order(
    entry: str, batch: Callable[[], dict[str, Any]], expected: list[str]
) -> None:
    checks, calls = counting_checks()
    model: torch.nn.Module | None = None
    options = PrepareOptions(padding_token_id=39)
    if entry == "make+model":
        model = _model()
    elif entry == "prepare":
        model, options = _model(), PrepareOptions(padding_token_id=39, num_chunks=1)
    elif entry == "prepare+hook":
        gp = GlobalPrefixConfig(text=CFG, num_global_tokens=2, block_size=2)
        model = GlobalPrefixDecoder.from_config(gp, seed=0)
        options = PrepareOptions(padding_token_id=39, num_chunks=2)
    ctx, local, sharder = run_prepare(model, None, batch(), options, checks)
    assert calls == expected
    # The public entry point runs the same pipeline: the same shard.
    if entry.startswith("prepare"):
        assert model is not None
        _, public, _ = cpshard.prepare_cp_forward(
            model, None, batch(), padding_token_id=39, num_chunks=options.num_chunks or 1
        )
    else:
        _, public, _ = cpshard.make_cp_batch_and_ctx(
            None, batch(), padding_token_id=39, model=model
        )
    assert sorted(public) == sorted(local)
    for key, value in local.items():
        assert_close(public[key], value)


def test_a_check_that_fails_stops_the_pipeline_before_the_next() -> None:
    checks, calls = counting_checks()
    with pytest.raises(ValueError, match="padding_token_id must be a non-negative"):
        run_prepare(None, None, _dense(), PrepareOptions(padding_token_id=-1), checks)
    assert calls == ["cp_mesh", "batch_mapping", "padding_token_id"]
    checks, calls = counting_checks()
    with pytest.raises(TypeError, match="batch must be a dict"):
        run_prepare(None, None, [1], PrepareOptions(), checks)  # type: ignore[arg-type]
    assert calls == ["cp_mesh", "batch_mapping"]


def _check_references(tree: ast.Module) -> tuple[list[int], list[int]]:
    """Lines that name a check function: in ``PrepareChecks`` or ``_valid_cp_mesh``, elsewhere."""
    names = {"check_batch_mapping", "check_padding_token_id", "check_token_mixers",
             "check_model_sharder", "_valid_cp_mesh", "validate_cp_mesh"}  # fmt: skip
    spans = [
        (n.lineno, n.end_lineno or n.lineno)
        for n in ast.walk(tree)
        if isinstance(n, ast.ClassDef | ast.FunctionDef)
        and n.name in ("PrepareChecks", "_valid_cp_mesh")
    ]
    inside: list[int] = []
    outside: list[int] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Name):
            name = node.id
        elif isinstance(node, ast.Attribute):
            name = node.attr
        else:
            continue
        if name in names and isinstance(node.ctx, ast.Load):
            in_span = any(a <= node.lineno <= b for a, b in spans)
            (inside if in_span else outside).append(node.lineno)
    return sorted(inside), sorted(outside)


def test_the_dispatcher_runs_its_checks_only_through_prepare_checks() -> None:
    tree = ast.parse(Path(inspect.getfile(dispatch)).read_text())
    inside, outside = _check_references(tree)
    assert len(inside) == len(CHECK_NAMES) + 1  # each default, and _valid_cp_mesh's own call
    assert outside == [], f"dispatch.py calls a check past PrepareChecks at lines {outside}"
    # The walk does see a stray call.
    stray = ast.parse("class PrepareChecks:\n    a = check_batch_mapping\ncheck_batch_mapping(b)\n")
    assert _check_references(stray) == ([2], [3])


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"layout": "zigzag"}, ValueError, r"layout must be one of .*got layout='zigzag'"),
        ({"attention": "flash"}, ValueError, r"attention must be one of .*got attention='flash'"),
        ({"num_chunks": 0}, ValueError, "num_chunks must be >= 1, got num_chunks=0"),
        ({"attention_cost": 1e9}, TypeError, "attention_cost must be a .*CostModel or None"),
        ({"cp_sharder": "contiguous"}, TypeError, "cp_sharder must be a cpshard.CPSharder"),
    ],
)
def test_invalid_options_are_found_once_and_raised_by_the_pipeline(
    kwargs: dict[str, Any], error: type[Exception], match: str
) -> None:
    options = PrepareOptions(**kwargs)  # built whatever the values: the pipeline raises
    problem = options.problem()
    assert isinstance(problem, error) and re.search(match, str(problem)), problem
    assert PrepareOptions().problem() is None
    with pytest.raises(error, match=match):
        run_prepare(_model() if options.runs_model_hook else None, None, _dense(), options)


def test_options_are_frozen_and_fingerprint_what_each_entry_point_takes() -> None:
    options = PrepareOptions(attention="ring", attention_cost=CostModel())
    with pytest.raises(dataclasses.FrozenInstanceError):
        options.layout = "none"  # type: ignore[misc]
    assert not options.runs_model_hook
    assert sorted(options.fingerprinted()) == [
        "attention_cost", "cp_sharder", "extra_token_keys", "loss_mask", "pad_multiple", "strict",
    ]  # fmt: skip
    hooked = PrepareOptions(num_chunks=2)
    assert hooked.runs_model_hook and hooked.fingerprinted()["num_chunks"] == 2
    assert "cp_sharder" not in hooked.fingerprinted()


def test_prepare_cp_forward_needs_a_model() -> None:
    with pytest.raises(TypeError, match="prepare_cp_forward needs the model"):
        cpshard.prepare_cp_forward(None, None, _dense())  # type: ignore[arg-type]


def test_both_public_signatures_map_onto_the_options() -> None:
    """Every keyword of both entry points is an option field (or the model of make_cp)."""
    fields = {f.name for f in dataclasses.fields(PrepareOptions)}
    for fn, own in (
        (cpshard.make_cp_batch_and_ctx, {"model"}),
        (cpshard.prepare_cp_forward, set()),
    ):
        params = inspect.signature(fn).parameters
        keywords = {n for n, p in params.items() if p.kind is p.KEYWORD_ONLY}
        assert keywords - own <= fields, keywords - own - fields
        for name in keywords - own:
            if name == "num_chunks":
                continue  # None in the options: make_cp_batch_and_ctx runs no model hook
            default = next(f.default for f in dataclasses.fields(PrepareOptions) if f.name == name)
            assert params[name].default == default, name


def test_extra_token_keys_a_given_sharder_would_ignore_are_refused() -> None:
    """A given or model-owned sharder runs its own shard_batch, which never sees the keys: they
    would stay unsharded beside the local tokens (silently misaligned)."""
    batch = {**_dense(), "adv": torch.ones(2, 11)}
    keys = {"adv": cpshard.TokenKey()}
    template = cpshard.closed_form_sharder(cpshard.NoneLayout())
    with pytest.raises(ValueError, match=r"extra_token_keys=\['adv'\] would be ignored: the cp_"):
        cpshard.make_cp_batch_and_ctx(None, batch, cp_sharder=template, extra_token_keys=keys)
    owner = GlobalPrefixDecoder.from_config(
        GlobalPrefixConfig(text=CFG, num_global_tokens=2, block_size=2), seed=0
    )
    with pytest.raises(ValueError, match=r"would be ignored: the model's own sharder"):
        cpshard.prepare_cp_forward(owner, None, batch, extra_token_keys=keys)
    # declared where the sharder is built, the key is sharded with the tokens
    declared = cpshard.closed_form_sharder(cpshard.NoneLayout(), extra_token_keys=keys)
    _, local, _ = cpshard.make_cp_batch_and_ctx(None, batch, cp_sharder=declared)
    assert local["adv"].shape == local["input_ids"].shape
