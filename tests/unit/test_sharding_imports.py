"""Import rules of the sharding layer, read from the source (no import side effects)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import cpshard

_SRC = Path(cpshard.__file__).parent
_FORBIDDEN = {
    "sharding": ("cpshard.attention", "cpshard.dispatch", "cpshard.tools", "cpshard.cli",
                 "cpshard.models"),
    "layouts": ("torch.distributed", "cpshard._comm", "cpshard.attention", "cpshard.dispatch",
                "cpshard.sharding", "cpshard.guards", "cpshard.tools", "cpshard.cli",
                "cpshard.models"),
}  # fmt: skip


def _imports(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
            names.update(f"{node.module}.{a.name}" for a in node.names)
    return names


@pytest.mark.parametrize("package", sorted(_FORBIDDEN))
def test_package_never_imports_the_layers_above(package: str) -> None:
    files = sorted((_SRC / package).glob("*.py"))
    assert files
    bad = {
        f"{path.name}: {name}"
        for path in files
        for name in _imports(path)
        if any(name == f or name.startswith(f + ".") for f in _FORBIDDEN[package])
    }
    assert not bad, f"cpshard.{package} imports what its import rule forbids: {sorted(bad)}"
