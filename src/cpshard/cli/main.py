"""Entry point of the ``cpshard`` command: one sub-command per module."""

from __future__ import annotations

import argparse
import importlib
from collections.abc import Sequence

__all__ = ["main"]

# sub-command name -> module under cpshard.cli with add_arguments(parser) and run(args) -> int
_COMMANDS = {
    "parity": (
        "cpshard.cli.parity",
        "loss and gradient parity, cp=N vs one process, per attention method and layout",
    ),
    "layouts": ("cpshard.cli.layouts", "shard a batch in every layout on local ranks and back"),
    "balance": (
        "cpshard.cli.balance",
        "layout balance (causal work, padding, remote K/V) on packed batches",
    ),
}


def build_parser() -> argparse.ArgumentParser:
    """The ``cpshard`` argument parser with every sub-command."""
    parser = argparse.ArgumentParser(
        prog="cpshard", description="Context parallelism you can check: layouts, parity, balance."
    )
    sub = parser.add_subparsers(dest="command", required=True)
    for name, (module, help_text) in _COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        importlib.import_module(module).add_arguments(p)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``cpshard`` command; returns the exit status."""
    args = build_parser().parse_args(argv)
    module = importlib.import_module(_COMMANDS[args.command][0])
    status: int = module.run(args)
    return status


if __name__ == "__main__":
    raise SystemExit(main())
