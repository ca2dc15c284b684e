"""Scheduler benchmark: throughput, idle latency, loop lag, stream scaling, steady state.

python scripts/bench_scheduler.py [--repeats 3] [--parts throughput,latency,...] [--json PATH]
"""

from __future__ import annotations

import argparse
import sys

from opsched._bench import write_json
from opsched._bench_scheduler import bench_scheduler, print_scheduler_report


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--parts", default="throughput,latency,responsiveness,scaling")
    parser.add_argument("--clients", type=int, default=256)
    parser.add_argument("--per-client", type=int, default=200)
    parser.add_argument("--json", metavar="PATH")
    args = parser.parse_args()
    result = bench_scheduler(
        args.repeats, tuple(args.parts.split(",")), args.clients, args.per_client
    )
    print_scheduler_report(result, sys.stdout)
    if args.json:
        write_json("scheduler", result, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
