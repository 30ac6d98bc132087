"""``cpshard balance``: how evenly each layout spreads causal attention work over CP ranks.

Examples::

    cpshard balance --dist lognormal --tokens 32768 --cp 2 4 8 16 --seed 0 1 2
    cpshard balance --dist corpus --cp 8 --plot balance.png
    cpshard balance --seq-lens 100,200,3000 --cp 3

Per layout it prints one table row (columns defined below, and again under the table);
``--plot`` draws per-rank work, normalised by the mean, for every layout (matplotlib).

Owns the arguments and the table; the metrics are :mod:`cpshard.tools.balance`.
"""

from __future__ import annotations

import argparse
import sys
import textwrap
from typing import Any

from cpshard.layouts.documents import PackSpec
from cpshard.tools.balance import (
    COLUMNS,
    DISTRIBUTIONS,
    BalanceReport,
    all_plans,
    balance_report,
    sample_packed_batch,
)

__all__ = ["DESCRIPTION", "add_arguments", "add_parser", "column_legend", "format_table", "run"]


def column_legend() -> str:
    """One line per table column: its name and definition."""
    return "\n".join(
        textwrap.fill(f"{name}: {text}", width=96, initial_indent="  ", subsequent_indent="    ")
        for name, text in COLUMNS.items()
    )


DESCRIPTION = f"{__doc__}\nColumns:\n{column_legend()}\n"


def _seq_lens(text: str) -> list[int]:
    try:
        return [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"--seq-lens must be comma-separated integers like 100,200,3000, got {text!r}"
        ) from None


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Add the ``balance`` options to ``p`` (the sub-command's parser)."""
    p.add_argument("--dist", choices=DISTRIBUTIONS, default="lognormal", help="doc lengths")
    p.add_argument("--tokens", type=_positive, default=32768, help="tokens per packed batch")
    p.add_argument("--seed", type=int, nargs="+", default=[0], help="one batch per seed")
    p.add_argument("--seq-lens", type=_seq_lens, default=None, help="explicit doc lengths")
    p.add_argument("--cp", type=_positive, nargs="+", default=[8], help="CP sizes, e.g. 2 4 8")
    p.add_argument("--no-torch", action="store_true", help="skip torch's load balancers")
    p.add_argument("--plot", default=None, metavar="FILE.png", help="per-rank work bars")


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register ``balance`` on an ``argparse`` subparsers object; returns its parser."""
    p: argparse.ArgumentParser = subparsers.add_parser(
        "balance",
        help="layout balance on packed batches",
        description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_arguments(p)
    p.set_defaults(run=run)
    return p


def format_table(rows: list[tuple[str, BalanceReport]]) -> str:
    """Markdown table of ``(batch label, report)`` rows."""
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    for label, r in rows:
        lines.append(
            f"| {label} | {r.world_size} | {r.layout} | {r.imbalance:.4f} | "
            f"{100 * r.padding_overhead:.2f}% | {r.remote_kv_max:.3f} | {r.remote_kv_mean:.3f} | "
            f"{1e3 * r.solver_seconds:.2f} |"
        )
    return "\n".join(lines)


def _plot(path: str, label: str, reports: list[BalanceReport]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cps = sorted({r.world_size for r in reports})
    fig, axes = plt.subplots(len(cps), 1, figsize=(10, 2.6 * len(cps)), squeeze=False)
    for ax, c in zip(axes[:, 0], cps, strict=True):
        mine = [r for r in reports if r.world_size == c]
        width = 0.8 / c
        for i, r in enumerate(mine):
            mean = sum(r.work_per_rank) / c
            for k, w in enumerate(r.work_per_rank):
                ax.bar(i - 0.4 + (k + 0.5) * width, w / mean, width, color=f"C{k % 10}")
        ax.axhline(1.0, color="black", linewidth=0.8)
        ax.set_xticks(range(len(mine)))
        ax.set_xticklabels([f"{r.layout}\n{r.imbalance:.3f}" for r in mine], fontsize=8)
        ax.set_ylabel("work / mean")
        ax.set_title(f"{label}, C={c}: per-rank causal work (bars = ranks)", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def run(args: argparse.Namespace) -> int:
    """Run the ``balance`` subcommand; prints a markdown table, returns the exit status."""
    batches: list[tuple[str, PackSpec]] = []
    try:
        if args.seq_lens is not None:
            lens = args.seq_lens
            batches.append(("explicit", PackSpec.from_seq_lens([lens], max(sum(lens), 0))))
        else:
            for seed in args.seed:
                spec = sample_packed_batch(args.dist, args.tokens, seed)
                batches.append((f"{args.dist} {args.tokens} s{seed}", spec))
        # One untimed pass over every layout first: the first call of each code path pays one-off
        # costs (lazy imports, allocator growth, numpy/torch dispatch caches) that are not the
        # solver's, and would otherwise inflate the first batch's times.
        all_plans(batches[0][1], args.cp[0], include_torch=not args.no_torch)
        rows: list[tuple[str, BalanceReport]] = []
        for label, spec in batches:
            for c in args.cp:
                for plan in all_plans(spec, c, include_torch=not args.no_torch):
                    rows.append((label, balance_report(plan)))
    except ValueError as err:
        print(f"cpshard balance: error: {err}", file=sys.stderr)
        return 2
    print(format_table(rows))
    print(f"\ncolumns:\n{column_legend()}")
    if args.plot:
        first = batches[0][0]
        _plot(args.plot, first, [r for label, r in rows if label == first])
        print(f"wrote {args.plot}")
    return 0
