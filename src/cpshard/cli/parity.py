"""``cpshard parity``: proves that cp=N trains exactly like cp=1, per attention method and layout.

What is compared: for every row (model, dtype, batch kind, layout, attention method) the same
model, from the same init, trains --steps AdamW steps on the same real-text batches twice,
through the same code: once on N CP ranks (the cp=N side) and once in one process (the cp=1
reference). At EVERY step it compares
  - the global loss of the two runs: rel |dloss| = |loss_N - loss_1| / loss_1;
  - every parameter's gradient after the CP gradient sync against the cp=1 gradient on the SAME
    weights (rank 0 recomputes it each step): grad err = max|g_N - g_1| / max|g_1|. So a step's
    CP error is measured, not the rounding drift of two 50-step trajectories.
A "cp=1 vs native attention" row per batch kind checks the reference itself the same way
against the model's own attention without cpshard (e.g. HF dense rows with their attention
mask, packed rows one document at a time).

Where it runs: by default on --ranks forked local CPU ranks (gloo), started once and reused for
every row. Under torchrun (WORLD_SIZE set) on the launched ranks instead (NCCL on CUDA, gloo on
CPU), with the cp=1 reference on rank 0: `torchrun --nproc-per-node 4 -m cpshard parity --ranks 4`.

Exit status: 0 iff every row passed, 1 if any row failed, 2 on bad input (checked before any
work starts). Examples:

    cpshard parity                                    # the demo: 18 rows, 3 steps, 4 ranks
    cpshard parity --models all --steps 50 --json parity.json --plot parity.png  # thorough
    cpshard parity --models llama,tiny --dtypes float32,bfloat16 --ranks 2

This module owns the arguments; the rows, the runners, the driver loop, the report, the training
and the comparison are the :mod:`cpshard.parity` package.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

from cpshard.names import DENSE_LAYOUTS, METHOD_NAMES, PACKED_LAYOUTS
from cpshard.parity.driver import run_parity
from cpshard.parity.runners import DEFAULT_TIMEOUT_S, launched_world_size
from cpshard.parity.runs import GRAD_SYNCS, MODELS, TOLERANCES, ParityCase

__all__ = ["DESCRIPTION", "add_arguments", "run"]


def _tolerance_text() -> str:
    lines = ["Tolerances, at every step (see cpshard.parity.runs.TOLERANCES for why):"]
    for dtype, tol in TOLERANCES.items():
        lines.append(f"    {dtype}: rel |dloss| <= {tol.rel_loss:g}, grad err <= {tol.grad:g}")
    return "\n".join(lines)


DESCRIPTION = f"{__doc__}\n{_tolerance_text()}"
_PLOT_SUFFIXES = (".png", ".svg", ".pdf")
DEMO = "demo"
# The demo: every row of the HF model, and one row of each model kind that is not HF (the
# pre-embedding VLM, the model that owns its CP), as in the seed's table.
_DEMO_MODELS = ("llama", "vlm", "prefix")
_DEMO_ONE_ROW = frozenset({"vlm", "prefix"})


class UsageError(ValueError):
    """Bad command-line input: one line naming the flag, the rule and the fix (exit status 2)."""


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Arguments of ``cpshard parity``."""
    p.add_argument("--ranks", type=int, default=4, help="CP size N of the cp=N side")
    p.add_argument(
        "--models",
        "--model",
        default=DEMO,
        help=f"comma list of {', '.join(MODELS)}, or all (vlm: pre-embedding, layout chosen by "
        "the dispatcher; prefix: model-owned sharder), or demo: every llama row plus one vlm "
        "and one prefix row",
    )
    p.add_argument(
        "--methods", default=",".join(METHOD_NAMES), help="comma list of attention methods"
    )
    p.add_argument(
        "--layouts",
        default=",".join(DENSE_LAYOUTS + PACKED_LAYOUTS),
        help="comma list; round_robin/contiguous use dense rows, balanced/packed packed rows "
        "(models that own their CP layout ignore it)",
    )
    p.add_argument(
        "--dtypes", "--dtype", default="float32", help=f"comma list of {', '.join(TOLERANCES)}"
    )
    p.add_argument("--steps", type=int, default=3, help="AdamW steps per row (50: thorough)")
    p.add_argument("--seq-len", type=int, default=256, help="tokens per row of a batch")
    p.add_argument("--batch-size", type=int, default=2, help="rows per dense batch")
    p.add_argument("--seed", type=int, default=0, help="model init and batch sampling seed")
    p.add_argument("--json", default=None, metavar="PATH", help="write one record per row")
    p.add_argument(
        "--plot", default=None, metavar="PATH", help="loss curves and |dloss| per step (.png)"
    )
    p.add_argument(
        "--timeout",
        type=float,
        default=DEFAULT_TIMEOUT_S,
        help="seconds a rank may wait in one collective before the run fails",
    )
    p.add_argument(
        "--grad-sync",
        choices=GRAD_SYNCS,
        default="sum",
        help="gradient sync of the cp=N side; 'mean' and 'none' are known mistakes, to see the "
        "check fail",
    )
    p.add_argument(
        "--progress",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="progress bar with ETA on stderr",
    )


def _csv(text: str, allowed: Any, flag: str) -> list[str]:
    items = [s.strip() for s in text.split(",") if s.strip()]
    bad = [s for s in items if s not in allowed]
    if bad or not items:
        raise UsageError(
            f"{flag} {text!r}: unknown {', '.join(map(repr, bad)) or 'empty list'}; "
            f"use a comma list of {', '.join(allowed)}"
        )
    return items


def _check_writable(path: str, flag: str) -> None:
    p = Path(path)
    parent = p.parent if str(p.parent) else Path(".")
    if p.is_dir():
        raise UsageError(f"{flag} {path}: is a directory; give a file path like {p / 'out'}")
    if p.exists() and not os.access(p, os.W_OK):
        raise UsageError(f"{flag} {path}: file is not writable; choose another path")
    if not p.exists() and not (parent.is_dir() and os.access(parent, os.W_OK | os.X_OK)):
        raise UsageError(
            f"{flag} {path}: directory {parent} does not exist or is not writable; "
            f"create it or choose another path"
        )


def _validate(args: argparse.Namespace) -> dict[str, list[str]]:
    """Every check that does not need a rank; raises :class:`UsageError`."""
    chosen = args.models.strip()
    names = {
        "models": list(MODELS)
        if chosen == "all"
        else list(_DEMO_MODELS)
        if chosen == DEMO
        else _csv(args.models, MODELS, "--models"),
        "methods": _csv(args.methods, METHOD_NAMES, "--methods"),
        "layouts": _csv(args.layouts, DENSE_LAYOUTS + PACKED_LAYOUTS, "--layouts"),
        "dtypes": _csv(args.dtypes, TOLERANCES, "--dtypes"),
    }
    for flag, value, low in (
        ("--steps", args.steps, 1),
        ("--seq-len", args.seq_len, 2),
        ("--batch-size", args.batch_size, 1),
    ):
        if value < low:
            raise UsageError(f"{flag} {value}: must be >= {low}; pass {flag} {low} or more")
    if args.ranks < 1:
        raise UsageError(f"--ranks {args.ranks}: must be >= 1; pass --ranks 1 or more")
    if 2 * args.ranks > args.seq_len:
        raise UsageError(
            f"--ranks {args.ranks} is more than --seq-len {args.seq_len} allows: round_robin cuts "
            f"a row into 2 x ranks chunks of at least one token; use --ranks <= "
            f"{args.seq_len // 2} or --seq-len >= {2 * args.ranks}"
        )
    if not args.timeout > 0:
        raise UsageError(f"--timeout {args.timeout}: must be > 0 seconds; e.g. --timeout 120")
    if args.json is not None:
        _check_writable(args.json, "--json")
    if args.plot is not None:
        if Path(args.plot).suffix.lower() not in _PLOT_SUFFIXES:
            raise UsageError(
                f"--plot {args.plot}: unknown image type; end the path in "
                f"{', '.join(_PLOT_SUFFIXES)}"
            )
        _check_writable(args.plot, "--plot")
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            raise UsageError(
                "--plot needs matplotlib, which is not installed; pip install 'cpshard[plot]' "
                "or drop --plot"
            ) from None
    world = launched_world_size()
    if world is not None and world != args.ranks:
        raise UsageError(
            f"--ranks {args.ranks} but the launcher started WORLD_SIZE={world} ranks; pass "
            f"--ranks {world}, or launch with torchrun --nproc-per-node {args.ranks}"
        )
    return names


def run(args: argparse.Namespace) -> int:
    """Run every parity row; exit status 0 iff all passed, 1 if any failed, 2 on bad input."""
    try:
        names = _validate(args)
    except UsageError as err:
        print(f"cpshard parity: error: {err}", file=sys.stderr)
        return 2
    base = ParityCase(
        steps=args.steps,
        seq_len=args.seq_len,
        batch_size=args.batch_size,
        seed=args.seed,
        grad_sync=args.grad_sync,
    )
    return run_parity(
        base,
        models=names["models"],
        dtypes=names["dtypes"],
        layouts=names["layouts"],
        methods=names["methods"],
        ranks=args.ranks,
        one_row=_DEMO_ONE_ROW if args.models.strip() == DEMO else frozenset(),
        timeout_s=args.timeout,
        progress=args.progress,
        json_path=args.json,
        plot_path=args.plot,
    )
