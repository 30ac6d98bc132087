"""The import rules of the package (ARCHITECTURE.md), checked on the source with ``ast``.

:data:`RULES` is one table: each row names the modules it applies to (a module or a package and
everything under it), the dotted import prefixes they must not use, the prefixes allowed anyway,
the modules it exempts and why. A new rule is one more row. Every import counts: top-level,
lazy (inside a function), relative, and attribute chains through an imported name
(``import torch`` then ``torch.distributed.barrier()``).

A row may also fence the *private* names of packages (``private``): a dotted name under one of
them with a ``_``-prefixed component (``torch._C``, ``torch.ops.aten._flash_attention_forward``,
``from torch.overrides import _get_current_function_mode_stack``), and any ``_``-prefixed
attribute the package itself does not define, read on any object (``config._attn_implementation``,
``getattr(m, "_forward_pre_hooks")``, the name as a string): such a name can only come from a
third party. Dunders, the namedtuple API (``_replace``) and cpshard's own tags (``_cpshard*``) are
not private. Only :mod:`cpshard._compat` may use them (one named, version-checked entry each).

More checks of the package's shape: every module says what it is (a module docstring) and points
at this table for its import rules (one line, :data:`POINTER`; the rules are written only here
and in ARCHITECTURE.md's diagram), and the layout and method names are spelled as a collection
only in :mod:`cpshard.names`.
"""

from __future__ import annotations

import ast
import functools
import re
from dataclasses import dataclass
from pathlib import Path

import pytest

from cpshard.names import LAYOUT_NAMES, METHOD_NAMES

SRC = Path(__file__).resolve().parents[2] / "src"


@dataclass(frozen=True)
class Rule:
    """Modules under ``scope`` (minus ``exempt``) never import anything under ``forbid``.

    An import under one of ``allow`` is fine even though a ``forbid`` prefix matches it. Nor do
    they use a private name of a package in ``private`` (see the module docstring).
    """

    scope: str
    forbid: tuple[str, ...]
    why: str
    allow: tuple[str, ...] = ()
    exempt: tuple[str, ...] = ()
    private: tuple[str, ...] = ()


# torch.distributed names that only name a type (annotations, isinstance checks): importing them
# communicates nothing, so any module may. Every function, submodule or ``import
# torch.distributed`` (collectives, process-group and mesh creation) lives in cpshard._comm.
TYPE_NAMES = (
    "torch.distributed.ProcessGroup",
    "torch.distributed.device_mesh.DeviceMesh",
    "torch.distributed.tensor.DTensor",
)
# torch's private CP load balancers: index generators (no communication) that tools/balance.py
# measures through cpshard._compat, the one module that names them.
TORCH_BALANCERS = ("torch.distributed.tensor.experimental._context_parallel._load_balancer",)
# The one module that names private torch / transformers APIs.
COMPAT = "cpshard._compat"

# Modules that import (almost) nothing of cpshard: (module, what it may import besides itself and
# names, why).
LEAVES: tuple[tuple[str, tuple[str, ...], str], ...] = (
    ("cpshard.attention.merge", (), "torch only"),
    ("cpshard.attention.pieces", (), "torch and numpy only; the plan and the run counts use it"),
    ("cpshard.attention.softcap", ("cpshard.attention.merge",), "the merge only"),
    (
        "cpshard.attention.visibility",
        ("cpshard.attention.pieces", "cpshard.layouts.index"),
        "the run table and the layouts' index helpers only",
    ),
    (
        "cpshard.attention.pad_runs",
        ("cpshard.attention.pieces", "cpshard.layouts.index"),
        "the run table and the layouts' index helpers only",
    ),
    (
        "cpshard.attention.grouped_runs",
        ("cpshard.attention.visibility",),
        "the runs' counting structures only",
    ),
    ("cpshard.layouts.documents", (), "PackSpec parses the document structure, torch only"),
    ("cpshard.layouts.index", (), "index helpers every layout shares, torch and numpy only"),
    ("cpshard.mixers.recompute", (), "torch only: a function recomputed in its backward"),
    ("cpshard.mixers.segments", ("cpshard.sharding.meta",), "the token meta only"),
    ("cpshard.models.decoder", (), "torch only"),
    (
        "cpshard.module_tree",
        (COMPAT,),
        "the model's module tree the model checks share: torch and the private-API seam only",
    ),
    ("cpshard.sharding.gather", ("cpshard._comm",), "the token gather's one collective"),
    (
        "cpshard.sharding.meta",
        ("cpshard.layouts.placement",),
        "the per-token facts attention reads: torch and the placement they derive from",
    ),
    ("cpshard.tools.corpus", (), "the shipped text corpus"),
)
# Modules that plan or cost on the host: they never import the collectives.
HOST_ONLY = (
    "cpshard.attention.auto",
    "cpshard.attention.calibration",
    "cpshard.attention.cost",
    "cpshard.attention.grouped_runs",
    "cpshard.attention.pad_runs",
    "cpshard.attention.plan",
    "cpshard.attention.selective_plan",
    "cpshard.attention.visibility",
    "cpshard.tools.plan_cost",
)

RULES: tuple[Rule, ...] = (
    Rule("cpshard.names", ("cpshard", "torch", "numpy"), "names.py is a leaf (typing only)"),
    Rule(
        "cpshard._version",
        ("cpshard", "torch"),
        "_version.py is read by the build (setuptools' attr:), so it imports nothing",
    ),
    Rule(
        "cpshard.layouts",
        ("cpshard", "torch.distributed"),
        "layouts are pure index math: they import only layouts and names",
        allow=("cpshard.layouts", "cpshard.names"),
    ),
    Rule(
        "cpshard._comm",
        ("cpshard",),
        "_comm is a leaf but for the private-API seam",
        allow=("cpshard._comm", COMPAT),
    ),
    Rule(
        "cpshard",
        ("torch.distributed",),
        "only cpshard._comm uses torch.distributed; other modules import only its type names",
        allow=TYPE_NAMES,
        exempt=("cpshard._comm", COMPAT),
    ),
    Rule(
        COMPAT,
        ("cpshard", "torch.distributed", "transformers"),
        "the private-API seam sits at the bottom: nothing of cpshard, of torch.distributed only "
        "the private load balancers (index generators), and transformers never (its entries "
        "read the objects they are given, so `import cpshard` needs no transformers)",
        allow=(COMPAT, *TORCH_BALANCERS),
    ),
    Rule(
        "cpshard",
        (),
        "private torch / transformers APIs are named only in cpshard._compat (one entry each, "
        "saying which versions it was checked against): an upgrade breaks one known place",
        exempt=(COMPAT,),
        private=("torch", "transformers"),
    ),
    Rule(
        "cpshard",
        ("cpshard.tools", "cpshard.parity", "cpshard.cli", "cpshard.models"),
        "the core (and `import cpshard`) never imports tools, parity, cli or models",
        exempt=(
            "cpshard.tools",
            "cpshard.parity",
            "cpshard.cli",
            "cpshard.models",
            "cpshard.__main__",
            "cpshard.launch",
        ),
    ),
    Rule(
        "cpshard",
        ("cpshard.tools",),
        "tools serve parity and the cli (cpshard.launch re-exports the launcher)",
        exempt=("cpshard.tools", "cpshard.parity", "cpshard.cli", "cpshard.launch"),
    ),
    Rule(
        "cpshard.models",
        ("cpshard.tools", "cpshard.parity", "cpshard.cli"),
        "models sit on the core, below tools and parity",
    ),
    Rule(
        "cpshard",
        ("cpshard.integrations", "trl", "accelerate"),
        "the trainer integrations are optional (trl, accelerate): only they import those",
        exempt=("cpshard.integrations",),
    ),
    Rule(
        "cpshard.tools",
        ("cpshard.parity", "cpshard.cli"),
        "parity and the cli are built on tools, not the reverse",
    ),
    Rule("cpshard.parity", ("cpshard.cli",), "the cli only parses the arguments of a parity run"),
    Rule(
        "cpshard.parity.plan",
        ("cpshard",),
        "the rows of a run come from the model table: no collective, no rank",
        allow=("cpshard.names", "cpshard.parity.plan", "cpshard.parity.runs"),
    ),
    Rule(
        "cpshard.parity.report",
        ("cpshard",),
        "the report formats records: nothing of cpshard (matplotlib lazily, for --plot)",
        allow=("cpshard.parity.report",),
    ),
    Rule("cpshard.launch", ("cpshard.cli",), "the one launcher lives in cpshard.tools.launch"),
    Rule(
        "cpshard.sharding.consistency",
        ("cpshard",),
        "the batch fingerprint is a leaf of sharding: it imports only _comm",
        allow=("cpshard._comm", "cpshard.sharding.consistency"),
    ),
    Rule(
        "cpshard.sharding.pad_id",
        ("cpshard",),
        "the pad-id rule is a leaf the dispatcher calls (torch only)",
        allow=("cpshard.sharding.pad_id",),
    ),
    Rule(
        "cpshard.guards",
        ("cpshard.dispatch", "cpshard.loss", "cpshard.mixers"),
        "the dispatcher and the losses call the guards, which sit on attention and sharding",
    ),
    Rule(
        "cpshard.guards.step",
        ("cpshard",),
        "the step record the losses read imports only _comm, the module tree (and the "
        "private-API seam)",
        allow=("cpshard._comm", COMPAT, "cpshard.guards.step", "cpshard.module_tree"),
    ),
    Rule(
        "cpshard.loss",
        ("cpshard",),
        "the losses work with any sharder: only _comm and the step record",
        allow=("cpshard._comm", "cpshard.guards.step"),
    ),
    Rule("cpshard.sharding", ("cpshard.dispatch",), "the dispatcher calls the sharders"),
    Rule(
        "cpshard.attention",
        ("cpshard.dispatch", "cpshard.guards"),
        "the dispatcher and the model guard sit above attention",
    ),
    *(
        Rule(
            f"cpshard.attention.{m}",
            ("cpshard",),
            "the kernels and their merge are attention math: nothing of cpshard outside attention "
            "but the private-API seam",
            allow=("cpshard.attention", COMPAT),
        )
        for m in ("blockwise", "cuda_kernels", "kernels", "merge", "pieces", "softcap")
    ),
    Rule("cpshard.sharding", ("cpshard.attention",), "dispatch composes the two contexts"),
    Rule(
        "cpshard.mixers",
        ("cpshard.dispatch", "cpshard.guards"),
        "the dispatcher calls the mixer verdict and composes its hooks into ctx",
    ),
    Rule(
        "cpshard.mixers.detect",
        ("cpshard",),
        "detection reads module structure (its own members through cpshard._compat, the module "
        "tree) and config facts only",
        allow=("cpshard.mixers.detect", "cpshard._compat", "cpshard.module_tree"),
    ),
    Rule("cpshard.attention", ("cpshard.mixers",), "the mixers' hooks sit above attention"),
    *(
        Rule(m, ("cpshard",), f"{m} is a leaf: {why}", allow=(m, "cpshard.names", *ok))
        for m, ok, why in LEAVES
    ),
    *(
        Rule(m, ("cpshard._comm",), "host-side planning and cost: never a collective")
        for m in HOST_ONLY
    ),
    Rule(
        "cpshard.options",
        ("cpshard.dispatch", "cpshard.guards", "cpshard.mixers", "cpshard._comm"),
        "the prepare options are plain checked values below the dispatcher that builds them",
    ),
)


def _under(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def _chain(node: ast.Attribute) -> tuple[str, list[str]] | None:
    parts: list[str] = []
    cur: ast.expr = node
    while isinstance(cur, ast.Attribute):
        parts.append(cur.attr)
        cur = cur.value
    return (cur.id, parts[::-1]) if isinstance(cur, ast.Name) else None


def imports_of(source: str, module: str, is_package: bool = False) -> list[tuple[int, str]]:
    """Every dotted name ``module`` imports or reaches through an imported name, with its line.

    ``from a.b import c`` gives ``a.b.c``; relative imports are resolved against ``module``;
    ``import torch`` then ``torch.distributed.barrier`` gives ``torch.distributed.barrier``.
    """
    tree = ast.parse(source)
    package = module if is_package else module.rpartition(".")[0]
    found: list[tuple[int, str]] = []
    bound: dict[str, str] = {}  # local name -> the dotted name it stands for
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                found.append((node.lineno, a.name))
                if a.asname:
                    bound[a.asname] = a.name
                else:
                    root = a.name.partition(".")[0]
                    bound[root] = root
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                anchor = ".".join(parts[: len(parts) - (node.level - 1)])
                base = f"{anchor}.{base}" if base else anchor
            for a in node.names:
                full = base if a.name == "*" else f"{base}.{a.name}"
                found.append((node.lineno, full))
                if a.name != "*":
                    bound[a.asname or a.name] = full
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and (chain := _chain(node)) and chain[0] in bound:
            found.append((node.lineno, ".".join([bound[chain[0]], *chain[1]])))
    return found


def _private(part: str) -> bool:
    """A ``_``-prefixed name that is not a dunder."""
    return part.startswith("_") and not (part.startswith("__") and part.endswith("__"))


# ``_``-prefixed names that are public API: namedtuple's documented methods.
PUBLIC_UNDERSCORE = frozenset({"_replace", "_asdict", "_fields", "_make"})
_IDENTIFIER = re.compile(r"_[A-Za-z_]\w*")


def defined_names(source: str) -> set[str]:
    """Every name ``source`` defines: functions, classes, variables, arguments, attributes of
    ``self`` / ``cls``."""
    out: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            out.add(node.name)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            out.add(node.id)
        elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
            if node.value.id in ("self", "cls"):
                out.add(node.attr)
        elif isinstance(node, ast.arg):
            out.add(node.arg)
    return out


def foreign_private_names(source: str, own: frozenset[str]) -> list[tuple[int, str]]:
    """``(line, "._name")`` for every private attribute ``source`` reads that ``own`` lacks.

    Read as ``x._name``, through ``getattr`` / ``hasattr`` / ``setattr`` / ``delattr``, or spelled
    as a string (an attribute name in waiting, or a name searched in source text); parts of
    f-strings do not count.
    """
    tree = ast.parse(source)
    in_fstring = {id(c) for n in ast.walk(tree) if isinstance(n, ast.JoinedStr) for c in n.values}
    found = []
    for node in ast.walk(tree):
        name = None
        if isinstance(node, ast.Attribute):
            self_attr = isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")
            name = None if self_attr else node.attr
        elif (
            isinstance(node, ast.Constant)
            and isinstance(node.value, str)
            and id(node) not in in_fstring
            and _IDENTIFIER.fullmatch(node.value)
        ):
            name = node.value
        if (
            name is not None
            and _private(name)
            and name not in own
            and name not in PUBLIC_UNDERSCORE
            and not name.startswith("_cpshard")
        ):
            found.append((node.lineno, "." + name))
    return found


@functools.cache
def own_names() -> frozenset[str]:
    """The names the package defines, the private-API seam left out (its names are not ours)."""
    return frozenset(
        n for m, p, _ in _modules() if m != COMPAT for n in defined_names(p.read_text())
    )


def violations(
    source: str,
    module: str,
    is_package: bool = False,
    rules: tuple[Rule, ...] = RULES,
    own: frozenset[str] | None = None,
) -> list[tuple[str, int, str, str]]:
    """``(module, line, import, why)`` for every import of ``module`` that a rule forbids.

    ``own``: the names the package defines (default: read from the source tree), which the
    ``private`` rows take for cpshard's own rather than a third party's.
    """
    out = []
    names = imports_of(source, module, is_package)
    for rule in rules:
        if not _under(module, rule.scope) or any(_under(module, e) for e in rule.exempt):
            continue
        for line, name in names:
            if any(_under(name, f) for f in rule.forbid) and not any(
                _under(name, a) for a in rule.allow
            ):
                out.append((module, line, name, rule.why))
            parts = name.split(".")
            if parts[0] in rule.private and any(_private(p) for p in parts):
                out.append((module, line, name, rule.why))
        if rule.private:
            mine = own_names() if own is None else own
            out += [(module, ln, n, rule.why) for ln, n in foreign_private_names(source, mine)]
    return sorted(set(out))


def _modules() -> list[tuple[str, Path, bool]]:
    mods = []
    for path in sorted((SRC / "cpshard").rglob("*.py")):
        parts = list(path.relative_to(SRC).with_suffix("").parts)
        is_package = parts[-1] == "__init__"
        mods.append((".".join(parts[:-1] if is_package else parts), path, is_package))
    return mods


def _tree_violations() -> list[tuple[str, int, str, str]]:
    return [v for m, p, pkg in _modules() for v in violations(p.read_text(), m, pkg)]


def test_the_package_keeps_its_import_rules() -> None:
    bad = _tree_violations()
    assert not bad, "import rules broken (see ARCHITECTURE.md):\n" + "\n".join(
        f"  {m} line {line}: imports {name} -- rule: {why}" for m, line, name, why in bad
    )


def test_the_checker_sees_the_whole_package() -> None:
    names = {m for m, _, _ in _modules()}
    assert {"cpshard", "cpshard._comm", "cpshard.layouts", "cpshard.sharding.sharder"} <= names
    assert {
        "cpshard.tools",
        "cpshard.cli.main",
        "cpshard.attention.ring",
        "cpshard.parity.runs",
    } <= names
    assert len(names) > 40


def _names(source: str, module: str, rules: tuple[Rule, ...] = RULES) -> list[str]:
    return sorted({v[2] for v in violations(source, module, rules=rules)})


@pytest.mark.parametrize(
    ("module", "source", "expected"),
    [
        # layouts: nothing of torch.distributed, nothing of cpshard but layouts and names
        ("cpshard.layouts.x", "import torch.distributed as dist\n", ["torch.distributed"]),
        ("cpshard.layouts.x", "from .. import _comm\n", ["cpshard._comm"]),
        ("cpshard.layouts.x", "from cpshard.sharding.meta import TokenMeta\n", None),
        ("cpshard.layouts.x", "from .index import padded_length\nimport cpshard.names\n", []),
        # torch.distributed: type names anywhere, the rest only in _comm
        ("cpshard.sharding.x", "from torch.distributed.device_mesh import DeviceMesh\n", []),
        ("cpshard.sharding.x", "import torch\ntorch.distributed.barrier()\n", None),
        ("cpshard.dispatch", "from torch.distributed import all_reduce\n", None),
        ("cpshard._comm", "import torch.distributed as dist\n", []),
        ("cpshard._compat", "from " + TORCH_BALANCERS[0] + " import _PTRRLoadBalancer\n", []),
        ("cpshard.tools.x", "from " + TORCH_BALANCERS[0] + " import _PTRRLoadBalancer\n", None),
        ("cpshard._compat", "import torch.distributed as dist\n", ["torch.distributed"]),
        # private torch / transformers names: only in the seam, which imports nothing above it
        ("cpshard.attention.x", "import torch\ntorch._C._nn.scaled_dot_product_attention\n", None),
        ("cpshard.attention.x", "import torch\ntorch.ops.aten._flash_attention_forward(q)\n", None),
        (
            "cpshard.guards.x",
            "from torch.overrides import _get_current_function_mode_stack\n",
            None,
        ),
        ("cpshard.loss", "from torch.utils._python_dispatch import TorchDispatchMode\n", None),
        ("cpshard.x", "import transformers.utils._private as p\n", None),
        ("cpshard.guards.x", "def f(config):\n    return config._attn_implementation\n", None),
        ("cpshard.guards.x", "def f(m):\n    return getattr(m, '_forward_pre_hooks')\n", None),
        ("cpshard.guards.x", "def f(p):\n    return p.grad._version\n", ["._version"]),
        ("cpshard.guards.x", "def f(t):\n    return t._base\n", ["._base"]),
        ("cpshard.attention.x", "def f(src):\n    return '_attn_implementation' in src\n", None),
        ("cpshard._compat", "import torch\ntorch._C._nn.scaled_dot_product_attention\n", []),
        ("cpshard._compat", "def f(m):\n    return m._forward_pre_hooks\n", []),
        ("cpshard._compat", "import transformers\n", ["transformers"]),
        ("cpshard._compat", "from cpshard.names import LAYOUT_NAMES\n", None),
        ("cpshard._comm", "from cpshard._compat import TorchDispatchMode\n", []),
        # not private: cpshard's own names and tags, dunders, the namedtuple API
        (
            "cpshard.attention.x",
            "from cpshard.attention import cuda_kernels as ck\nck._groups\n",
            [],
        ),
        ("cpshard.attention.x", "p._replace(qi=1)\nt._cpshard_batch\nf.__self__\nself._x\n", []),
        # core never imports tools / cli / models, even lazily
        ("cpshard.dispatch", "def f():\n    from cpshard.parity.runs import MODELS\n", None),
        ("cpshard", "from cpshard import models\n", ["cpshard.models"]),
        ("cpshard.guards.model", "import cpshard.cli.main\n", ["cpshard.cli.main"]),
        ("cpshard.cli.x", "from cpshard.parity.runs import MODELS\n", []),
        ("cpshard.parity.x", "from cpshard.cli.parity import run\n", None),
        ("cpshard.tools.x", "from cpshard.parity.runners import LocalRunner\n", None),
        ("cpshard.parity.report", "from cpshard.parity.runs import MODELS\n", None),
        # leaves and host-side planning
        ("cpshard.attention.merge", "from cpshard.attention.kernels import f\n", None),
        ("cpshard.attention.plan", "from cpshard import _comm\n", ["cpshard._comm"]),
    ],
)
def test_the_checker_flags_what_the_rules_forbid(
    module: str, source: str, expected: list[str] | None
) -> None:
    got = _names(source, module)
    if expected is None:  # must flag something
        assert got, f"{module}: {source!r} passed the rules"
    else:
        assert got == expected


def test_a_new_rule_is_one_row() -> None:
    src = "def shard():\n    from cpshard.loss import count_tokens\n"
    assert _names(src, "cpshard.sharding.batch") == []
    row = Rule("cpshard.sharding", ("cpshard.loss",), "a made-up rule for this test")
    assert _names(src, "cpshard.sharding.batch", (*RULES, row)) == ["cpshard.loss.count_tokens"]


POINTER = (
    "Import rules: the rows of ``RULES`` in tests/unit/test_architecture.py that cover this module."
)
# The sub-commands' docstrings are their --help text (cpshard.cli.main): no pointer there.
HELP_TEXTS = {f"cpshard.cli.{m}" for m in ("balance", "layouts", "parity", "plan")}


# cpshard's own definitions of a torch / transformers private name, on purpose: the trainer
# integrations override these hooks of the trainers they subclass (cpshard.integrations).
OVERRIDES = frozenset(
    {"_get_train_sampler", "_generate_single_turn", "_get_per_token_logps_and_entropies"}
)


def test_no_own_private_name_shadows_a_torch_or_transformers_one() -> None:
    """The private-name rule takes a ``_name`` cpshard defines for cpshard's own wherever it is
    read. A cpshard name that is also a private name of a torch / transformers class would hide
    reads of that class's private attribute (``t._base`` of a tensor) from the rule: no such
    name, but for the trainer hooks cpshard overrides."""
    transformers = pytest.importorskip("transformers")
    import torch

    classes: list[type] = [
        torch.Tensor, torch.nn.Module, torch.nn.Parameter, torch.autograd.Function,
        transformers.PreTrainedModel, transformers.PretrainedConfig, transformers.Trainer,
        transformers.TrainingArguments,
    ]  # fmt: skip
    theirs = {n for c in classes for n in dir(c) if _private(n)}
    assert "_base" in theirs and "_version" in theirs  # the check sees what it must
    shadowing = (own_names() & theirs) - OVERRIDES
    assert not shadowing, (
        f"cpshard defines {sorted(shadowing)}, which torch / transformers classes also define as "
        "private names: rename cpshard's, so that reading theirs stays visible to the rule"
    )


def test_every_module_docstring_points_at_the_rule_table() -> None:
    """The import rules are written once, here: a module's docstring says only where they are."""
    bad = []
    for m, p, _ in _modules():
        doc = ast.get_docstring(ast.parse(p.read_text())) or ""
        lines = [line for line in doc.splitlines() if line.lstrip().startswith("Import rule")]
        want = [] if m in HELP_TEXTS else [POINTER]
        if lines != want:
            bad.append(f"  {m}: {lines or 'no pointer'}")
    assert not bad, f"each module's docstring holds exactly the line {POINTER!r}:\n" + "\n".join(
        bad
    )


def test_every_module_has_a_docstring() -> None:
    bare = [m for m, p, _ in _modules() if not ast.get_docstring(ast.parse(p.read_text()))]
    assert not bare, f"modules without a docstring (say what it owns and may import): {bare}"


_NAMES = frozenset(LAYOUT_NAMES) | frozenset(METHOD_NAMES)


def name_collections(source: str) -> list[tuple[int, tuple[str, ...]]]:
    """Tuples, lists and sets of two or more layout / method names written out in ``source``."""
    out = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Tuple | ast.List | ast.Set) and len(node.elts) >= 2:
            values = [e.value if isinstance(e, ast.Constant) else None for e in node.elts]
            if all(isinstance(v, str) and v in _NAMES for v in values):
                out.append((node.lineno, tuple(str(v) for v in values)))
    return out


def _tree_name_collections() -> list[tuple[str, int, tuple[str, ...]]]:
    return [
        (m, line, names)
        for m, p, _ in _modules()
        if m != "cpshard.names"
        for line, names in name_collections(p.read_text())
    ]


def test_layout_and_method_names_are_listed_only_in_names_py() -> None:
    found = _tree_name_collections()
    assert not found, "import the tuples from cpshard.names instead:\n" + "\n".join(
        f"  {m} line {line}: {names}" for m, line, names in found
    )


def test_name_collections_finds_spelled_out_names() -> None:
    src = (
        'A = ("ring", "ulysses")\n'
        'if x in ["packed", "balanced", "none"]: pass\n'
        'B = ("none", "cp1")\n'  # not all names: another vocabulary
        'C = ("ring",)\n'  # one name is a value, not a list
    )
    assert name_collections(src) == [(1, ("ring", "ulysses")), (2, ("packed", "balanced", "none"))]
