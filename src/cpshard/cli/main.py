"""Entry point of the ``cpshard`` command: one sub-command per module.

Owns the sub-command table. Every sub-command module is imported to build the parser (each adds
its own arguments and ``--help`` text); the chosen one's ``run`` then does the work.

Import rules: the rows of ``RULES`` in tests/unit/test_architecture.py that cover this module.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence
from typing import NoReturn

from cpshard._version import __version__

__all__ = ["build_parser", "main"]

# sub-command name -> module under cpshard.cli with add_arguments(parser) and run(args) -> int;
# its DESCRIPTION (if any) is the sub-command's --help text.
_COMMANDS = {
    "parity": (
        "cpshard.cli.parity",
        "loss and gradient parity, cp=N vs one process, per attention method and layout",
    ),
    "layouts": (
        "cpshard.cli.layouts",
        "shard a dense and a packed batch in every layout on local ranks and back",
    ),
    "balance": (
        "cpshard.cli.balance",
        "layout balance (causal work, padding, remote K/V) on packed batches",
    ),
    "plan": (
        "cpshard.cli.plan",
        "per layout and attention method: pairs, bytes moved vs needed, modelled step time",
    ),
}


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Show every option's default, keep the descriptions' own line breaks."""


class OneLineErrorParser(argparse.ArgumentParser):
    """Bad arguments end in one line on stderr (what, and where to look) and exit status 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message}; see `{self.prog} --help`\n")


def build_parser() -> argparse.ArgumentParser:
    """The ``cpshard`` argument parser with every sub-command."""
    return _build()[0]


def _build() -> tuple[argparse.ArgumentParser, dict[str, argparse.ArgumentParser]]:
    parser = OneLineErrorParser(
        prog="cpshard",
        description="Context parallelism you can check: layouts, parity, balance.",
        formatter_class=HelpFormatter,
    )
    parser.add_argument(
        "--version", action="version", version=f"%(prog)s {__version__}", help="print the version"
    )
    sub = parser.add_subparsers(dest="command", required=True)
    subparsers: dict[str, argparse.ArgumentParser] = {}
    for name, (module_name, help_text) in _COMMANDS.items():
        module = importlib.import_module(module_name)
        p = sub.add_parser(
            name,
            help=help_text,
            description=getattr(module, "DESCRIPTION", None) or help_text,
            formatter_class=HelpFormatter,
        )
        module.add_arguments(p)
        subparsers[name] = p
    return parser, subparsers


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``cpshard`` command; returns the exit status."""
    parser, subparsers = _build()
    args, extra = parser.parse_known_args(argv)
    if extra:  # reported by the sub-command's parser, so the message points at its --help
        subparsers[args.command].error(f"unrecognized arguments: {' '.join(extra)}")
    module = importlib.import_module(_COMMANDS[args.command][0])
    status: int = module.run(args)
    sys.stdout.flush()
    return status


if __name__ == "__main__":
    raise SystemExit(main())
