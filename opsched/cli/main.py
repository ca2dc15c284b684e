"""The ``opsched`` command (also ``python -m opsched``)."""

from __future__ import annotations

import argparse
import shlex
import sys
from typing import Any

import opsched
from opsched import SchedulerConfig
from opsched._errors import AclnnError
from opsched.cli import plot as _plot
from opsched.cli.bench_kernels import KERNEL_SIZES
from opsched.cli.bench_scheduler import PARTS
from opsched.cli.bench_targets import GROUPS as TARGET_GROUPS
from opsched.cli.stress import StressOptions, run_stress
from opsched.core.trace import load_trace, summarize
from opsched.ops.products import table_rows

__all__ = ["main"]

#: Where ``opsched demo`` writes its trace unless ``--trace`` says otherwise.
DEMO_TRACE = "opsched-demo.trace.json"


def _common() -> argparse.ArgumentParser:
    """Options every subcommand takes."""
    common = argparse.ArgumentParser(add_help=False)
    group = common.add_argument_group("common options")
    group.add_argument(
        "--config",
        metavar="NAME|PATH",
        help="scheduler profile: default, throughput, latency, or a TOML file's path",
    )
    group.add_argument(
        "--device",
        default="cpu",
        help="cpu (numpy on worker threads), reference (inline), torch:cpu, torch:cuda[:N], "
        "torch:npu[:N]",
    )
    group.add_argument(
        "--product",
        help="check every request against this Ascend product's support table "
        "(see opsched products; default: the config's, generic)",
    )
    group.add_argument(
        "--trace",
        metavar="PATH",
        help="write the scheduler's timeline here (Chrome trace / Perfetto JSON)",
    )
    group.add_argument(
        "--log-format",
        choices=("console", "json"),
        default="console",
        help="how -v prints the scheduler's events (to stderr)",
    )
    group.add_argument(
        "-v",
        "--verbose",
        action="count",
        default=0,
        help="-v: failures, evictions, pool growth; -vv: every launch too",
    )
    return common


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="opsched", description="An asyncio scheduler for batched NPU operators."
    )
    parser.add_argument("--version", action="version", version=f"opsched {opsched.__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    common = _common()
    fmt = argparse.ArgumentDefaultsHelpFormatter
    sub.add_parser(
        "demo",
        parents=[common],
        formatter_class=fmt,
        help="the seeds through the two-phase API, an async training loop (calls and "
        "graphs, traced), a sync batch script; a summary table",
        description="Runs the demo; every result is checked bit for bit against solo "
        "launches (exit 1 otherwise). Writes the training loop's trace to --trace "
        f"(default {DEMO_TRACE}).",
    )
    add_bench_arguments(
        sub.add_parser(
            "bench",
            parents=[common],
            formatter_class=fmt,
            help="run the benchmarks: tables, a JSON result file, optionally a PNG chart",
        )
    )
    add_stress_arguments(
        sub.add_parser(
            "stress",
            parents=[common],
            help="hammer a scheduler with a mixed, fault-injected workload and verify every "
            "request (exit 1 on any discrepancy)",
            formatter_class=fmt,
        )
    )
    sub.add_parser(
        "warm",
        help="compile every kernel now, into numba's disk cache (e.g. at image build time)",
        description="Compiles (or loads from the cache) every compiled kernel for every "
        "dtype, so that no request of a later process waits for the compiler. The cache "
        "lies beside the installed kernels, under NUMBA_CACHE_DIR when that is set, or in "
        "the user's cache directory; with none writable, this only checks that they compile.",
    )
    sub.add_parser(
        "products",
        help="list the Ascend product profiles: operators and dtypes each supports",
        description="The product profiles --product / SchedulerConfig.product / product= "
        "check requests against.",
    )
    trace = sub.add_parser(
        "trace",
        help="summarize a trace file, optionally draw its timeline as a PNG",
        description="Checks that PATH is an opsched trace and prints launches, requests and "
        "busy time per stream. Open the file itself in https://ui.perfetto.dev.",
    )
    trace.add_argument("path", metavar="PATH", help="a trace written by --trace / trace=")
    trace.add_argument("--png", metavar="OUT", help="draw the timeline here (needs matplotlib)")
    return parser


def add_bench_arguments(p: argparse.ArgumentParser) -> None:
    """The ``bench`` options (shared with the scripts under ``scripts/``)."""
    p.add_argument(
        "which",
        nargs="?",
        default="all",
        choices=("kernels", "scheduler", "graphs", "all"),
        help="which benchmark",
    )
    p.add_argument("--quick", action="store_true", help="tiny workloads, one repeat: a smoke run")
    p.add_argument("--repeats", type=int, default=3, help="repeats (graph rounds); medians")
    p.add_argument("--json", metavar="PATH", help="result file (default bench-WHICH.json)")
    p.add_argument("--plot", metavar="PATH", help="PNG chart (needs opsched[plot])")
    k = p.add_argument_group("kernels")
    k.add_argument("--sizes", default=",".join(_human(n) for n in KERNEL_SIZES))
    k.add_argument("--dtypes", default="FLOAT,FLOAT16,BFLOAT16")
    k.add_argument("--ops", default="glu,gn,gnb", help="glu, gn, gnb (GroupNormBackward)")
    s = p.add_argument_group("scheduler")
    s.add_argument("--parts", default=",".join(PARTS), help="which parts")
    s.add_argument(
        "--target-groups",
        default=",".join(TARGET_GROUPS),
        help="which rows of the cost targets (part targets)",
    )
    s.add_argument("--clients", type=int, default=256, help="concurrent coroutines")
    s.add_argument("--per-client", type=int, default=200, help="requests each")
    g = p.add_argument_group("graphs")
    g.add_argument("--graph-clients", type=int, default=64, help="concurrent chains")
    g.add_argument("--graph-repeats", type=int, default=20, help="chains each")


def add_stress_arguments(p: argparse.ArgumentParser) -> None:
    """The ``stress`` options (shared with ``scripts/stress.py``)."""
    d = StressOptions()
    size = p.add_mutually_exclusive_group()
    size.add_argument("--requests", type=int, default=d.requests, help="requests to run")
    size.add_argument("--duration", type=float, help="run for this many seconds instead")
    p.add_argument("--clients", type=int, default=d.clients, help="async coroutines")
    p.add_argument(
        "--sync-clients", type=int, default=d.sync_clients, help="threads using opsched.sync"
    )
    p.add_argument("--seed", type=int, default=d.seed, help="everything derives from it")
    for name, help_ in (
        ("invalid", "share of requests with a bad argument"),
        ("cancel", "share cancelled by their caller"),
        ("deadline", "share whose deadline has already passed"),
        ("fault", "share hit by an injected launch failure"),
        ("graphs", "share of templates submitted as graphs"),
    ):
        p.add_argument(f"--{name}", type=float, default=getattr(d, name), help=help_)
    p.add_argument("--templates", type=int, default=d.templates, help="distinct request shapes")
    p.add_argument(
        "--max-queued-requests", type=int, default=d.max_queued_requests, help="queue cap"
    )
    p.add_argument(
        "--workspace-limit-bytes", type=int, default=d.workspace_limit_bytes, help="pool cap"
    )
    p.add_argument("--watchdog", type=float, default=d.watchdog, help="seconds before lost")
    p.add_argument("--report", metavar="PATH", help="write the JSON report here")
    p.add_argument("--replay", type=int, metavar="INDEX", help="rerun one request of the seed")
    p.add_argument(
        "--progress",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="progress bar (default: when stderr is a terminal)",
    )


def stress_options(args: argparse.Namespace) -> StressOptions:
    """StressOptions from parsed ``stress`` arguments.

    Raises:
        ValueError: a value out of range (the message names the option and the range).
    """
    rates = {name: getattr(args, name) for name in ("invalid", "cancel", "deadline", "fault")}
    for name, rate in {**rates, "graphs": args.graphs}.items():
        if not 0.0 <= rate <= 1.0:
            msg = f"--{name}={rate} is out of range; expected a share in [0, 1]"
            raise ValueError(msg)
    if sum(rates.values()) > 1.0:
        msg = f"--invalid, --cancel, --deadline and --fault add up to {sum(rates.values())}; > 1"
        raise ValueError(msg)
    for name in ("requests", "templates", "max_queued_requests", "workspace_limit_bytes"):
        if getattr(args, name) < 1:
            msg = f"--{name.replace('_', '-')}={getattr(args, name)} must be >= 1"
            raise ValueError(msg)
    if args.clients < 0 or args.sync_clients < 0 or args.clients + args.sync_clients < 1:
        msg = (
            f"--clients={args.clients} --sync-clients={args.sync_clients}: both >= 0, "
            "and at least one client"
        )
        raise ValueError(msg)
    if args.duration is not None and args.duration <= 0:
        msg = f"--duration={args.duration} must be > 0 seconds"
        raise ValueError(msg)
    progress = sys.stderr.isatty() if args.progress is None else args.progress
    return StressOptions(
        requests=args.requests,
        duration=args.duration,
        clients=args.clients,
        sync_clients=args.sync_clients,
        seed=args.seed,
        device=args.device,
        config=args.config,
        product=args.product,
        trace=args.trace,
        invalid=args.invalid,
        cancel=args.cancel,
        deadline=args.deadline,
        fault=args.fault,
        graphs=args.graphs,
        templates=args.templates,
        max_queued_requests=args.max_queued_requests,
        workspace_limit_bytes=args.workspace_limit_bytes,
        watchdog=args.watchdog,
        report=args.report,
        replay=args.replay,
        progress=progress,
    )


def _size(text: str) -> int:
    units = {"K": 1 << 10, "M": 1 << 20}
    unit = units.get(text[-1:].upper())
    try:
        return int(text[:-1]) * unit if unit else int(text)
    except ValueError:
        msg = f"--sizes: {text!r} is not a size; expected e.g. 1024, 64K or 16M"
        raise ValueError(msg) from None


def _human(n: int) -> str:
    return f"{n >> 20}M" if n >= 1 << 20 and n % (1 << 20) == 0 else f"{n >> 10}K"


def configure_logging(fmt: str, verbosity: int) -> None:
    """Send the scheduler's structlog events to stderr (only the command does this)."""
    if verbosity <= 0:
        return  # unconfigured: opsched emits nothing
    import logging

    import structlog

    renderer: Any = (
        structlog.processors.JSONRenderer()
        if fmt == "json"
        else structlog.dev.ConsoleRenderer(colors=False)
    )
    structlog.configure(
        processors=[
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso"),
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(
            logging.INFO if verbosity == 1 else logging.DEBUG
        ),
        logger_factory=structlog.PrintLoggerFactory(sys.stderr),
    )


def _config(args: argparse.Namespace, default: SchedulerConfig | None) -> SchedulerConfig | None:
    """The config of ``--config`` (else ``default``), with ``--product`` applied."""
    config = SchedulerConfig.load(args.config) if args.config else default
    if args.product is not None:
        config = (config or SchedulerConfig()).evolve({"product": args.product})
    return config


def _run_products() -> int:
    head = ("product", "GluBackward", "GroupNormalizationGrad", "GroupNormBackward")
    rows = [(r[0], r[2], r[3], r[4]) for r in table_rows()]
    widths = [max(len(str(row[i])) for row in [head, *rows]) + 2 for i in range(4)]
    for row in [head, *rows]:
        print("".join(f"{cell:<{w}}" for cell, w in zip(row, widths, strict=True)).rstrip())
    print("\n".join(f"  {r[0]}: {r[1]}" for r in table_rows()))
    return 0


def _run_bench(args: argparse.Namespace) -> int:
    from opsched.cli import bench_graphs as _bench_graphs
    from opsched.cli import bench_kernels as _bench
    from opsched.cli import bench_scheduler as _bench_scheduler

    config = _config(args, None)
    target = _bench.BenchTarget(args.device, config)
    which = ("kernels", "scheduler", "graphs") if args.which == "all" else (args.which,)
    problem = None
    ops, dtypes = tuple(args.ops.split(",")), tuple(args.dtypes.split(","))
    unknown_parts = sorted(set(args.parts.split(",")) - set(PARTS))
    unknown_groups = sorted(set(args.target_groups.split(",")) - set(TARGET_GROUPS))
    if args.trace and which == ("kernels",):
        problem = "--trace: the kernel benchmark runs no scheduler; trace scheduler or graphs"
    elif args.repeats < 1:
        problem = f"--repeats={args.repeats} must be >= 1"
    elif "scheduler" in which and unknown_parts:
        problem = f"unknown scheduler benchmark part(s) {unknown_parts}; valid: {list(PARTS)}"
    elif "scheduler" in which and unknown_groups:
        problem = f"unknown cost-target group(s) {unknown_groups}; valid: {list(TARGET_GROUPS)}"
    elif not set(ops) <= {"glu", "gn", "gnb"}:
        problem = f"--ops={args.ops!r}; expected a comma list of glu, gn, gnb"
    elif not set(dtypes) <= set(_bench.KERNEL_DTYPES):
        problem = (
            f"--dtypes={args.dtypes!r}; expected a comma list of {', '.join(_bench.KERNEL_DTYPES)}"
        )
    if problem is not None:  # said before minutes of measuring
        raise ValueError(problem)
    sizes = tuple(_size(t) for t in args.sizes.split(","))  # a bad size: said here too
    if args.plot:
        _plot.require_matplotlib()  # say so before minutes of measuring
    quick = args.quick
    results: dict[str, Any] = {}
    out = sys.stdout
    if "kernels" in which:
        print("== kernels: fast kernels against a numpy copy of the same bytes", file=out)
        sizes = (1 << 10, 1 << 12) if quick else sizes
        dtypes = ("FLOAT",) if quick else dtypes
        results["kernels"] = _bench.bench_kernels(
            sizes, dtypes, ops, repeats=1 if quick else args.repeats
        )
        _bench.print_kernel_table(results["kernels"], out)
    traced = False
    if "scheduler" in which:
        print(f"\n== scheduler ({args.device})", file=out)
        repeats, clients, per_client = (
            (1, 8, 8) if quick else (args.repeats, args.clients, args.per_client)
        )
        parts = ("throughput", "tracing", "sweeps") if quick else tuple(args.parts.split(","))
        results["scheduler"] = _bench_scheduler.bench_scheduler(
            repeats,
            parts,
            clients,
            per_client,
            target,
            args.trace,
            quick,
            tuple(args.target_groups.split(",")),
        )
        traced = bool(args.trace) and "throughput" in parts
        _bench_scheduler.print_scheduler_report(results["scheduler"], out)
    if "graphs" in which:
        print(f"\n== graphs ({args.device})", file=out)
        rounds, clients, repeats = (
            (1, 2, 1) if quick else (args.repeats, args.graph_clients, args.graph_repeats)
        )
        results["graphs"] = _bench_graphs.bench_graphs(
            rounds, clients, repeats, target, None if traced else args.trace
        )
        traced = traced or bool(args.trace)
        _bench_graphs.print_graph_report(results["graphs"], out)
    path = args.json or f"bench-{args.which}.json"
    _bench.write_json(args.which, results, path, "opsched " + shlex.join(args.argv))
    print(f"\nresults written to {path}", file=out)
    if traced:
        print(f"timeline of one measured run written to {args.trace}", file=out)
    if args.plot:
        try:
            _plot.plot_bench(results, args.plot)
        except ValueError as exc:
            print(f"--plot: {exc}", file=out)
        else:
            print(f"chart written to {args.plot}", file=out)
    return 0


def _run_trace(args: argparse.Namespace) -> int:
    events = load_trace(args.path)
    s = summarize(events)
    print(
        f"{args.path}: {s['launches']} launches serving {s['requests']} requests over "
        f"{s['span_ms']:.1f} ms; executor cache hits {s['cache_hits']}; graph edges "
        f"{s['graph_edges']}; queue peak {s['queued_peak']}"
    )
    for st in s["streams"]:
        print(
            f"  {st['stream']:<10}{st['launches']:>7} launches{st['requests']:>9} requests"
            f"{st['busy_ms']:>10.1f} ms busy ({st['busy_share']:.0%})"
        )
    if args.png:
        _plot.plot_trace(events, args.png)
        print(f"timeline drawn to {args.png}")
    return 0


def _run_warm() -> int:
    import time

    from opsched import kernels

    started = time.perf_counter()
    count = kernels.warm()
    elapsed = time.perf_counter() - started
    print(f"{count} kernel entry points compiled or loaded from the cache in {elapsed:.1f} s")
    return 0


def main(argv: list[str] | None = None) -> int:
    """Run the command line; return the exit status (2: a usage error)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    args = _parser().parse_args(argv)
    args.argv = argv
    command = args.command
    try:
        if command == "trace":
            return _run_trace(args)
        if command == "products":
            return _run_products()
        if command == "warm":
            return _run_warm()
        configure_logging(args.log_format, args.verbose)
        if command == "demo":
            from opsched.cli.demo import run_demo

            config = _config(args, SchedulerConfig(streams=2))
            return run_demo(sys.stdout, config, args.device, args.trace or DEMO_TRACE)
        if command == "bench":
            return _run_bench(args)
        if command == "stress":
            return run_stress(stress_options(args), sys.stdout)
    except (ValueError, TypeError, OSError, ImportError, AclnnError) as exc:
        print(f"opsched {command}: error: {exc}", file=sys.stderr)
        return 2
    raise AssertionError(command)  # argparse rejects unknown commands


if __name__ == "__main__":
    sys.exit(main())
