"""Write docs/benchmarks.md and the README's benchmark summary from a result file.

    python scripts/bench_report.py docs/benchmarks/results.json          # write both
    python scripts/bench_report.py docs/benchmarks/results.json --check  # exit 1 if stale

The result file comes from ``opsched bench all --json docs/benchmarks/results.json``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from opsched.cli.bench_report import generate

ROOT = Path(__file__).resolve().parent.parent


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("result", help="a result file of `opsched bench all --json`")
    parser.add_argument("--check", action="store_true", help="only say whether they are current")
    args = parser.parse_args()
    changed = generate(args.result, ROOT, check=args.check)
    for name in changed:
        print(f"{name}: {'out of date' if args.check else 'written'}")
    return 1 if args.check and changed else 0


if __name__ == "__main__":
    sys.exit(main())
