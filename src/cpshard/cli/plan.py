"""``cpshard plan``: plan a cluster run from a laptop: work, bytes and modelled time per method.

Examples::

    cpshard plan --dist lognormal --tokens 1048576 --cp 8 16 32 64 --bandwidth 450 50
    cpshard plan --seq-lens 100,200,3000 --cp 8 --plot plan.png
    cpshard plan --dist corpus --tokens 65536 --cp 8 --layouts balanced --no-plan-time

For each batch, CP size, layout and attention method it prints one row: pairs per rank (max and
max/mean), K/V bytes moved per rank against the bytes of the remote keys the queries can see,
rank 0's plan build time, and the modelled time of one layer's attention (forward + backward) at
each ``--bandwidth`` (GB/s; e.g. 450 inside an NVLink node, 50 across InfiniBand). The model
(``cpshard.attention.cost``): compute = visible pairs x 4 D Hq FLOP (backward 2.5x) over
``--tflops``; communication = bytes over the bandwidth plus a latency per collective; all_gather
and selective overlap their exchange with the own-keys compute, ring each hop with one block's
compute, ulysses nothing; the slowest rank sets the step. It ignores kernel efficiency,
topology (one bandwidth for every pair of ranks) and contention. The layer shape is
``--heads``/``--kv-heads``/``--head-dim`` in bf16. ``--plot`` draws the modelled times (matplotlib).

Owns the arguments and the table; the numbers are :mod:`cpshard.tools.plan_cost`.
"""

from __future__ import annotations

import argparse
import sys
import textwrap

from cpshard.attention.cost import CostModel
from cpshard.cli.balance import _positive, _seq_lens
from cpshard.layouts.documents import PackSpec
from cpshard.names import DENSE_LAYOUTS, PACKED_LAYOUTS
from cpshard.tools.balance import DISTRIBUTIONS, all_plans, sample_packed_batch
from cpshard.tools.plan_cost import PLAN_COLUMNS, MethodRow, method_rows

__all__ = ["DESCRIPTION", "add_arguments", "format_table", "run"]

_LAYOUTS = (*DENSE_LAYOUTS, *PACKED_LAYOUTS)


def column_legend() -> str:
    """One line per table column: its name and definition."""
    return "\n".join(
        textwrap.fill(f"{name}: {text}", width=96, initial_indent="  ", subsequent_indent="    ")
        for name, text in PLAN_COLUMNS.items()
    )


DESCRIPTION = f"{__doc__}\nColumns:\n{column_legend()}\n"


def _layouts(text: str) -> list[str]:
    got = [v.strip() for v in text.split(",") if v.strip()]
    bad = [v for v in got if v not in _LAYOUTS]
    if bad or not got:
        raise argparse.ArgumentTypeError(
            f"--layouts takes a comma list of {','.join(_LAYOUTS)}, got {text!r}"
        )
    return got


def _rate(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {value}")
    return value


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Add the ``plan`` options to ``p`` (the sub-command's parser)."""
    p.add_argument("--dist", choices=DISTRIBUTIONS, default="lognormal", help="doc lengths")
    p.add_argument("--tokens", type=_positive, default=1048576, help="tokens per packed batch")
    p.add_argument("--seed", type=int, nargs="+", default=[0], help="one batch per seed")
    p.add_argument("--seq-lens", type=_seq_lens, default=None, help="explicit doc lengths")
    p.add_argument("--cp", type=_positive, nargs="+", default=[8, 16, 32, 64], help="CP sizes")
    p.add_argument("--layouts", type=_layouts, default=list(_LAYOUTS), help="comma list")
    p.add_argument("--bandwidth", type=_rate, nargs="+", default=[450.0, 50.0], help="GB/s")
    p.add_argument("--tflops", type=_rate, default=400.0, help="attention TFLOP/s per rank")
    p.add_argument("--latency-us", type=float, default=20.0, help="per collective or ring step")
    p.add_argument("--heads", type=_positive, default=32, help="query heads of the layer")
    p.add_argument("--kv-heads", type=_positive, default=8, help="key/value heads")
    p.add_argument("--head-dim", type=_positive, default=128, help="head dim")
    p.add_argument("--no-plan-time", action="store_true", help="skip building rank 0's plans")
    p.add_argument("--plot", default=None, metavar="PATH", help="modelled-time bars (png)")


def format_table(rows: list[tuple[str, MethodRow]], bandwidths: list[float]) -> str:
    """Markdown table of ``(batch label, row)``."""
    head = [c for c in PLAN_COLUMNS if c != "model ms @ BW"]
    head += [f"model ms @ {bw:g} GB/s" for bw in bandwidths]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for label, r in rows:
        plan_ms = "-" if r.plan_seconds is None else f"{1e3 * r.plan_seconds:.1f}"
        cells = [
            label, str(r.world), r.layout, r.method, f"{r.pairs_max:.3g}",
            f"{r.pairs_max / max(r.pairs_mean, 1e-12):.3f}", f"{r.moved_bytes / 1e6:.3g}",
            f"{r.received_bytes / 1e6:.3g}", f"{r.moved_over_received:.3g}", plan_ms,
            *(f"{1e3 * s:.3g}" for s in r.modelled_seconds),
        ]  # fmt: skip
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _plot(path: str, label: str, rows: list[MethodRow], bandwidths: list[float]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cps = sorted({r.world for r in rows})
    fig, axes = plt.subplots(len(cps), len(bandwidths), figsize=(6 * len(bandwidths),
                             2.8 * len(cps)), squeeze=False)  # fmt: skip
    for i, c in enumerate(cps):
        mine = [r for r in rows if r.world == c]
        layouts = list(dict.fromkeys(r.layout for r in mine))
        methods = list(dict.fromkeys(r.method for r in mine))
        width = 0.8 / len(methods)
        for j, bw in enumerate(bandwidths):
            ax = axes[i, j]
            for m_i, m in enumerate(methods):
                ys = [next(r.modelled_seconds[j] for r in mine if r.layout == lay and
                           r.method == m) * 1e3 for lay in layouts]  # fmt: skip
                xs = [x - 0.4 + (m_i + 0.5) * width for x in range(len(layouts))]
                ax.bar(xs, ys, width, label=m, color=f"C{m_i}")
            ax.set_xticks(range(len(layouts)))
            ax.set_xticklabels(layouts, fontsize=8)
            ax.set_ylabel("modelled ms / layer")
            ax.set_title(f"{label}, C={c}, {bw:g} GB/s", fontsize=9)
            ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def run(args: argparse.Namespace) -> int:
    """Run the ``plan`` subcommand; prints a markdown table, returns the exit status."""
    bandwidths = [float(b) for b in args.bandwidth]
    try:
        model = CostModel(
            link_bandwidth=bandwidths[0] * 1e9, compute_rate=args.tflops * 1e12,
            latency=args.latency_us * 1e-6, q_heads=args.heads, kv_heads=args.kv_heads,
            head_dim=args.head_dim, itemsize=2,
        )  # fmt: skip
        batches: list[tuple[str, PackSpec]] = []
        if args.seq_lens is not None:
            lens = args.seq_lens
            batches.append(("explicit", PackSpec.from_seq_lens([lens], max(sum(lens), 0))))
        else:
            for seed in args.seed:
                spec = sample_packed_batch(args.dist, args.tokens, seed)
                batches.append((f"{args.dist} {args.tokens} s{seed}", spec))
        rows: list[tuple[str, MethodRow]] = []
        for label, spec in batches:
            for c in args.cp:
                for plan in all_plans(spec, c, include_torch=False):
                    if plan.layout not in args.layouts:
                        continue
                    for row in method_rows(
                        plan, model, [b * 1e9 for b in bandwidths],
                        time_plans=not args.no_plan_time,
                    ):  # fmt: skip
                        rows.append((label, row))
    except ValueError as err:
        print(f"cpshard plan: error: {err}", file=sys.stderr)
        return 2
    print(format_table(rows, bandwidths))
    print(f"\ncolumns:\n{column_legend()}")
    if args.plot:
        first = batches[0][0]
        _plot(args.plot, first, [r for label, r in rows if label == first], bandwidths)
        print(f"wrote {args.plot}")
    return 0
