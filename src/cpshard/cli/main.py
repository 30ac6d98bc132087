"""Entry point of the ``cpshard`` command: one argparse subcommand per module."""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from cpshard.cli import balance

__all__ = ["main"]


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``cpshard <subcommand> ...``; returns the process exit status."""
    parser = argparse.ArgumentParser(prog="cpshard", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    balance.add_parser(sub)
    args = parser.parse_args(argv)
    status: int = args.run(args)
    return status


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
