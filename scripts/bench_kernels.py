"""Kernel benchmark: fast kernels vs a numpy copy of the same bytes (thin wrapper).

python scripts/bench_kernels.py [--sizes 4M,16M] [--dtypes FLOAT] [--ops glu,gn] [--json PATH]
"""

from __future__ import annotations

import argparse
import sys

from opsched._bench import KERNEL_SIZES, bench_kernels, print_kernel_table, write_json


def _size(text: str) -> int:
    units = {"K": 1 << 10, "M": 1 << 20}
    return int(text[:-1]) * units[text[-1].upper()] if text[-1].upper() in units else int(text)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default=",".join(str(s) for s in KERNEL_SIZES))
    parser.add_argument("--dtypes", default="FLOAT,FLOAT16,BFLOAT16")
    parser.add_argument("--ops", default="glu,gn")
    parser.add_argument("--json", metavar="PATH")
    args = parser.parse_args()
    rows = bench_kernels(
        tuple(_size(s) for s in args.sizes.split(",")),
        tuple(args.dtypes.split(",")),
        tuple(args.ops.split(",")),
    )
    print_kernel_table(rows, sys.stdout)
    if args.json:
        write_json("kernels", rows, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
