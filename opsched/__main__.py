"""The ``opsched`` command (also ``python -m opsched``)."""

from __future__ import annotations

import argparse
import sys

__all__ = ["main"]


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="opsched", description="An asyncio scheduler for batched NPU operators."
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    sub.add_parser("demo", help="run both operators on the seed documents' worked examples")
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run the command line; return the exit status."""
    args = _parser().parse_args(argv)
    if args.command == "demo":
        from opsched._demo import run_demo

        return run_demo(sys.stdout)
    raise AssertionError(args.command)  # argparse rejects unknown commands


if __name__ == "__main__":
    sys.exit(main())
