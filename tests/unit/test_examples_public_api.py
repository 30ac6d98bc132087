"""The examples use cpshard's public API only (no private modules such as cpshard._comm)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

EXAMPLES = sorted((Path(__file__).resolve().parents[2] / "examples").glob("*.py"))


def _private(module: str) -> bool:
    return module.startswith("cpshard") and any(p.startswith("_") for p in module.split("."))


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_example_imports_only_public_cpshard(path: Path) -> None:
    bad = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            names = [f"{node.module}.{a.name}" for a in node.names]
            bad += [n for n in [node.module, *names] if _private(n)]
        elif isinstance(node, ast.Import):
            bad += [a.name for a in node.names if _private(a.name)]
        elif (
            isinstance(node, ast.Attribute)
            and node.attr.startswith("_")
            and isinstance(node.value, ast.Name)
            and node.value.id == "cpshard"
        ):
            bad.append(f"cpshard.{node.attr}")
    assert not bad, f"{path.name} uses private cpshard names: {bad}"


def test_there_are_examples() -> None:
    assert {p.name for p in EXAMPLES} >= {"train_cp.py", "training_loops.py"}
