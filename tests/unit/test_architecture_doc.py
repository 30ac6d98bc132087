"""ARCHITECTURE.md's diagram of who imports whom is true of the source, arrow by arrow.

The diagram is the fenced block of ``A --> B, C`` lines: ``A`` imports only what its line names
(``core``: any line below the ``core`` rule; ``nothing of cpshard``: no other line), every arrow
drawn stands for at least one real import, each line imports only lines below it, and every
module of the package sits on a line (the public face ``cpshard/__init__.py``, ``__main__.py``
and the ``launch.py`` re-export excepted). Any module may import ``names``. The real imports come
from the same ``ast`` walk as the import rules.
"""

from __future__ import annotations

import re
from pathlib import Path

from test_architecture import _modules, imports_of

ARCHITECTURE = Path(__file__).resolve().parents[2] / "ARCHITECTURE.md"
# Described in the table instead.
UNDRAWN = {"cpshard", "cpshard.__main__", "cpshard.launch"}
PACKAGES = (
    "cli",
    "parity",
    "tools",
    "models",
    "integrations",
    "attention",
    "sharding",
    "layouts",
    "mixers",
    "guards",
)


def node_of(module: str) -> str | None:
    """The diagram line of a module (``cpshard.guards.model`` -> ``guards``)."""
    if module in UNDRAWN:
        return None
    parts = module.split(".")[1:]
    return parts[0] if parts[0] in PACKAGES or len(parts) == 1 else None


def parse_diagram(text: str) -> tuple[list[str], dict[str, list[str]], int]:
    """The lines in order, the targets each line names, and the index of the first core line."""
    block = text.split("```\n", 2)[1] if "```\n" in text else ""
    order: list[str] = []
    targets: dict[str, list[str]] = {}
    core = -1
    for line in block.splitlines():
        if re.fullmatch(r"-+ core -+", line.strip()):
            core = len(order)
        elif m := re.match(r"(\S+)\s+-->\s+([^#]*)", line):
            order.append(m[1])
            named = m[2].strip()
            targets[m[1]] = [] if named == "nothing of cpshard" else named.split(", ")
    return order, targets, core


def real_edges() -> set[tuple[str, str, str]]:
    """``(importing module, imported module, its diagram line)`` for every cpshard import."""
    mods = {m for m, _, _ in _modules()}
    edges = set()
    for module, path, is_package in _modules():
        for _, name in imports_of(path.read_text(), module, is_package):
            parts = name.split(".")
            while parts and ".".join(parts) not in mods:
                parts.pop()
            if parts:
                edges.add((module, ".".join(parts), node_of(".".join(parts)) or ".".join(parts)))
    return edges


def diagram_errors(text: str, edges: set[tuple[str, str, str]], modules: set[str]) -> list[str]:
    """Everything the diagram in ``text`` says that the imports ``edges`` contradict."""
    order, targets, core = parse_diagram(text)
    if core < 0 or not order:
        return ["no diagram (a fenced block of `A --> B` lines with a `core` rule) found"]

    def expand(name: str) -> set[str]:
        if name == "core":
            return set(order[core:])
        return {name}

    errors = [
        f"`{n}` is drawn but no module sits there"
        for n in order
        if n not in {node_of(m) for m in modules}
    ]
    errors += [
        f"{m} sits on no line of the diagram"
        for m in sorted(modules)
        if m not in UNDRAWN and node_of(m) not in order
    ]
    for src, named in targets.items():
        for t in named:
            if not expand(t) or not expand(t) <= set(order):
                errors.append(f"`{src} --> {t}`: `{t}` is not a line of the diagram")
            elif min(order.index(n) for n in expand(t)) <= order.index(src):
                errors.append(f"`{src} --> {t}`: `{t}` is not below `{src}`")
            elif not any(node_of(a) == src and n in expand(t) for a, _, n in edges):
                errors.append(f"`{src} --> {t}` is drawn but `{src}` imports nothing of it")
    for a, b, n in sorted(edges):
        src = node_of(a)
        drawn = src in targets and any(n in expand(t) for t in targets[src])
        if src in targets and n not in (src, "names") and not drawn:
            errors.append(f"{a} imports {b}, but the diagram draws no `{src} --> {n}`")
    return errors


def test_the_diagram_is_the_import_graph() -> None:
    modules = {m for m, _, _ in _modules()}
    errors = diagram_errors(ARCHITECTURE.read_text(), real_edges(), modules)
    assert not errors, "ARCHITECTURE.md disagrees with the imports:\n" + "\n".join(errors)


def test_architecture_md_fits_one_screen() -> None:
    # one screen of a laptop terminal: the table grows a row per folder
    assert len(ARCHITECTURE.read_text().splitlines()) <= 72


DOC = """text
```
cli        --> tools, core
tools      --> core          # a comment
----- core -----
sharding   --> layouts
layouts    --> nothing of cpshard
```
"""
MODS = {"cpshard.cli.main", "cpshard.tools.x", "cpshard.sharding.s", "cpshard.layouts.l"}


def _edge(a: str, b: str) -> tuple[str, str, str]:
    return (a, b, node_of(b) or b)


def test_diagram_errors_accepts_a_true_diagram() -> None:
    edges = {
        _edge("cpshard.cli.main", "cpshard.tools.x"),
        _edge("cpshard.cli.main", "cpshard.layouts.l"),
        _edge("cpshard.tools.x", "cpshard.sharding.s"),
        _edge("cpshard.sharding.s", "cpshard.layouts.l"),
        _edge("cpshard.layouts.l", "cpshard.names"),  # names: always allowed
    }
    assert diagram_errors(DOC, edges, MODS) == []


def test_diagram_errors_flags_undrawn_missing_and_upward_arrows() -> None:
    edges = {
        _edge("cpshard.cli.main", "cpshard.tools.x"),
        _edge("cpshard.layouts.l", "cpshard.sharding.s"),  # undrawn, and upward
    }
    errors = diagram_errors(DOC, edges, MODS | {"cpshard.loss"})
    assert any("layouts.l imports cpshard.sharding.s" in e for e in errors)
    assert any("`cli --> core` is drawn" in e for e in errors)  # cli imports no core module
    assert any("`sharding --> layouts` is drawn" in e for e in errors)
    assert any("cpshard.loss sits on no line" in e for e in errors)
    upward = DOC.replace("layouts    --> nothing of cpshard", "layouts    --> sharding")
    assert any(
        "`layouts --> sharding`: `sharding` is not below" in e
        for e in diagram_errors(upward, edges, MODS)
    )
