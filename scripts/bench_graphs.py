"""Graph benchmark: an 8-node chain as a graph, as awaited calls, and direct.

python scripts/bench_graphs.py [--rounds 3] [--clients 64] [--repeats 20] [--json PATH]
"""

from __future__ import annotations

import argparse
import sys

from opsched._bench import write_json
from opsched._bench_graphs import bench_graphs, print_graph_report


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--clients", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--json", metavar="PATH")
    args = parser.parse_args()
    result = bench_graphs(args.rounds, args.clients, args.repeats)
    print_graph_report(result, sys.stdout)
    if args.json:
        write_json("graphs", result, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
