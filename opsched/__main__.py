"""The ``opsched`` command (also ``python -m opsched``)."""

from __future__ import annotations

import argparse
import sys

from opsched._stress import StressOptions, run_stress

__all__ = ["main"]


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="opsched", description="An asyncio scheduler for batched NPU operators."
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    sub.add_parser(
        "demo", help="the seeds through the two-phase API, then an async and a sync workload"
    )
    add_stress_arguments(
        sub.add_parser(
            "stress",
            help="hammer a scheduler with a mixed, fault-injected workload and verify every "
            "request (exit 1 on any discrepancy)",
            formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        )
    )
    return parser


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
    p.add_argument("--device", default=d.device, help="cpu or reference")
    p.add_argument("--config", help="scheduler TOML profile")
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


def main(argv: list[str] | None = None) -> int:
    """Run the command line; return the exit status."""
    args = _parser().parse_args(argv)
    if args.command == "demo":
        from opsched._demo import run_demo

        return run_demo(sys.stdout)
    if args.command == "stress":
        try:
            options = stress_options(args)
        except ValueError as exc:
            print(f"opsched stress: error: {exc}", file=sys.stderr)
            return 2
        return run_stress(options, sys.stdout)
    raise AssertionError(args.command)  # argparse rejects unknown commands


if __name__ == "__main__":
    sys.exit(main())
