"""The stress driver: clients, the run, the checks after shutdown, the report."""

from __future__ import annotations

import json
import math
import resource
import sys
import threading
import time
from typing import Any, TextIO

import anyio
import attrs
import numpy as np

import opsched
import opsched.sync
from opsched._api import resolve_config
from opsched.cli.stress.harness import REFUSED, _Harness, _submit_async, _submit_sync, _Tally
from opsched.cli.stress.workload import (
    Solos,
    StressOptions,
    _Case,
    make_case,
    make_template,
)
from opsched.ops.products import product_named

# ------------------------------------------------------------------------------ driver


def _rss_bytes() -> int:
    """Peak resident set size of this process so far (Linux reports KiB)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak * (1 if sys.platform == "darwin" else 1024))


def _cpu_seconds() -> float:
    """CPU time of this process so far, every thread's, user and system."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _scheduler_threads(before: frozenset[threading.Thread] = frozenset()) -> list[str]:
    """Scheduler threads alive now, but for those in ``before`` (other schedulers of the
    process, alive before the run: not the run's to join)."""
    return [
        t.name
        for t in threading.enumerate()
        if t.name.startswith(("opsched-stream", "opsched-portal")) and t not in before
    ]


class _Clock:
    """Hands out request indices until the count or the duration is reached (thread-safe)."""

    def __init__(self, opts: StressOptions) -> None:
        self._next = 0
        self._lock = threading.Lock()
        self._limit = opts.requests if opts.duration is None else math.inf
        self._until = math.inf if opts.duration is None else time.monotonic() + opts.duration
        self._only = opts.replay

    def take(self) -> int | None:
        with self._lock:
            if self._only is not None:
                index, self._only = self._only, None
                self._limit = 0
                return index
            if self._next >= self._limit or time.monotonic() >= self._until:
                return None
            self._next += 1
            return self._next - 1

    @property
    def issued(self) -> int:
        return self._next


def run_stress(opts: StressOptions, out: TextIO) -> int:
    """Run the stress test; print the summary to ``out``; return the exit status.

    Every result must be bit-identical to its request's solo call and within the
    tolerance of the float64 oracle. The solo call is the two-phase API on the numpy
    devices; on a torch device it is the request launched alone through opsched on that
    device (its batch invariance: the same bits alone as in any batch).
    """
    started = time.perf_counter()
    templates = _templates(opts)
    tally = _Tally(replay=_replay_command(opts))
    clock = _Clock(opts)
    overrides: dict[str, Any] = {
        "max_queued_requests": opts.max_queued_requests,
        "workspace_limit_bytes": opts.workspace_limit_bytes,
    }
    if opts.product is not None:
        overrides["product"] = opts.product
    config = resolve_config(opts.config, overrides)
    harness = _Harness(opts, templates, tally, product_named(config.product))
    rss_start = _rss_bytes()
    before = frozenset(threading.enumerate())
    # Memory bound: what can be alive at once. Each async client holds one request, each
    # sync thread a burst of 256; each request's arrays (inputs, output, the oracle's copy)
    # are counted four times over; plus two pools' worth of workspace and 256 MiB of slack.
    mean = sum(
        sum(a.nbytes for a in t.args if isinstance(a, np.ndarray))
        + sum(e.nbytes for e in t.expected_arrays)
        for t in templates
    ) / len(templates)
    outstanding = opts.clients + 256 * opts.sync_clients
    bound = int(rss_start + 2 * config.workspace_limit_bytes + 4 * mean * outstanding + (256 << 20))
    progress = _Progress(opts, tally) if opts.progress else None

    with opsched.sync.open_scheduler(config, device=opts.device, trace=opts.trace) as facade:
        sched = facade.scheduler
        sched.device.inject_faults(harness.injector)
        threads = [
            threading.Thread(
                target=_sync_client, args=(facade, harness, clock, opts), name=f"stress-sync-{i}"
            )
            for i in range(opts.sync_clients)
        ]
        for t in threads:
            t.start()
        run_start, cpu_start = time.perf_counter(), _cpu_seconds()
        facade._portal.portal.call(_async_clients, sched, harness, clock, opts)
        for t in threads:
            t.join()
        elapsed = time.perf_counter() - run_start
        busy = (_cpu_seconds() - cpu_start) / elapsed if elapsed else 0.0
    stats = sched.statistics()
    if progress is not None:
        progress.close()

    checks = _final_checks(stats, tally, clock, bound, before)
    report = _report(opts, stats, tally, clock, elapsed, checks, bound, started)
    report["cores_busy"] = busy
    report["product"] = config.product
    _print_summary(report, out)
    if opts.report:
        with open(opts.report, "w", encoding="utf-8") as f:
            json.dump(report, f, indent=2)
    return 0 if report["ok"] else 1


def _templates(opts: StressOptions) -> list[Any]:
    """The run's templates with their solo results (see :func:`run_stress`)."""
    if not opts.device.startswith("torch"):
        return [make_template(opts.seed, i, opts) for i in range(opts.templates)]
    with opsched.sync.open_scheduler(device=opts.device, streams=1) as alone:
        solos: Solos = {  # one blocking call at a time: each launch holds one request
            "glu": alone.glu_backward,
            "gn": alone.group_norm_grad,
            "gnb": alone.group_norm_backward,
        }
        return [make_template(opts.seed, i, opts, solos) for i in range(opts.templates)]


async def _async_clients(
    sched: opsched.Scheduler, harness: _Harness, clock: _Clock, opts: StressOptions
) -> None:
    async with anyio.create_task_group() as tg:
        for _ in range(opts.clients):
            tg.start_soon(_async_client, sched, harness, clock, opts)


async def _async_client(
    sched: opsched.Scheduler, harness: _Harness, clock: _Clock, opts: StressOptions
) -> None:
    spent = 0.0  # this client's harness time (see _Tally.harness_seconds)
    cpu = time.thread_time
    while True:
        began = cpu()
        index = clock.take()
        if index is None:
            break
        case = make_case(opts.seed, index, opts)
        kind, args, kw, expect = harness.prepare(case)
        result: Any = None
        error: BaseException | None = None
        start = time.perf_counter()
        # The watchdog: a cancel scope of its own, whose expiry marks the request lost.
        with anyio.CancelScope(deadline=anyio.current_time() + opts.watchdog) as watchdog:
            spent += cpu() - began
            try:
                if case.fate == "cancel":
                    # Cancelled before it is submitted: the cancellation reaches the caller
                    # at its first wait, whatever the request's stage by then.
                    with anyio.CancelScope() as scope:
                        scope.cancel()
                        result = await _submit_async(sched, kind, args, kw)
                        error = AssertionError("the cancelled request returned a result")
                    result = None if error is None else result
                else:
                    result = await _submit_async(sched, kind, args, kw)
            except Exception as exc:
                error = exc
            latency = time.perf_counter() - start
            began = cpu()
        if watchdog.cancelled_caught:
            harness.tally.record(case, "lost", f"no outcome within {opts.watchdog} s")
        else:
            harness.check(case, expect, result, error, latency, kw.get("out"))
        spent += cpu() - began
    harness.tally.add_harness_time(spent)


def _sync_client(
    facade: opsched.sync.SyncScheduler, harness: _Harness, clock: _Clock, opts: StressOptions
) -> None:
    """A batch script: submits bursts of futures, then collects them (bursts fill the queue).

    Graph cases run through the blocking ``facade.run`` at once (a blocking run cannot be
    cancelled, so there a cancel case runs as a valid one).
    """
    spent = 0.0  # this thread's harness time (see _Tally.harness_seconds)
    cpu = time.thread_time
    while True:
        burst: list[tuple[_Case, Any, Any, float, BaseException | None, Any]] = []
        for _ in range(256):
            began = cpu()
            index = clock.take()
            if index is None:
                break
            case = make_case(opts.seed, index, opts)
            kind, args, kw, expect = harness.prepare(case)
            spent += cpu() - began
            start = time.perf_counter()
            if kind == "graph":
                spent += _sync_graph(facade, harness, case, args, kw, start, expect)
                continue
            try:
                future = _submit_sync(facade, kind, args, kw)
            except Exception as exc:  # rejected at submit
                burst.append((case, expect, None, start, exc, kw.get("out")))
                continue
            if case.fate == "cancel" and not future.cancel():
                # it finished before it could be cancelled: it must then be right
                case = attrs.evolve(case, fate="valid")
            burst.append((case, expect, future, start, None, kw.get("out")))
        if not burst:
            break
        for case, expect, future, start, error, out in burst:
            result = None
            if future is not None:
                if future.cancelled():
                    began = cpu()
                    harness.check(case, expect, None, None, 0.0, out)
                    spent += cpu() - began
                    continue
                try:
                    result = future.result(timeout=opts.watchdog)
                except TimeoutError as exc:
                    if not future.done():
                        harness.tally.record(case, "lost", f"no outcome within {opts.watchdog} s")
                        continue
                    error = exc
                except Exception as exc:  # the request's own error
                    error = exc
            latency = time.perf_counter() - start
            began = cpu()
            harness.check(case, expect, result, error, latency, out)
            spent += cpu() - began
    harness.tally.add_harness_time(spent)


def _sync_graph(
    facade: opsched.sync.SyncScheduler,
    harness: _Harness,
    case: _Case,
    args: tuple[Any, ...],
    kw: dict[str, Any],
    start: float,
    expect: int | None,
) -> float:
    """Run a graph case through the blocking facade and check it; return the harness's
    time in it (building the graph, checking the result)."""
    began = time.thread_time()
    g = opsched.Graph()
    x, dy, gamma, mean, rstd, gate = args
    b = g.glu_backward(g.group_norm_grad(x, dy, gamma, mean, rstd), gate, dim=-1)
    spent = time.thread_time() - began
    result, error = None, None
    try:
        (result,) = facade.run(g, [b], **{k: v for k, v in kw.items() if k == "deadline"})
    except Exception as exc:
        error = exc
    began = time.thread_time()
    if case.fate == "cancel":
        case = attrs.evolve(case, fate="valid")
    harness.check(case, expect, result, error, time.perf_counter() - start)
    return spent + time.thread_time() - began


class _Progress:
    """A tqdm bar with live throughput, fed from a small thread reading the tally."""

    def __init__(self, opts: StressOptions, tally: _Tally) -> None:
        from tqdm import tqdm

        total = None if opts.duration is not None else opts.requests
        self._bar = tqdm(total=total, unit="req", desc="stress", smoothing=0.1)
        self._tally = tally
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="stress-progress", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        shown = 0
        while not self._stop.wait(0.2):  # a display refresh rate, not a wait for work
            done = len(self._tally.resolved)
            self._bar.update(done - shown)
            shown = done
        self._bar.update(len(self._tally.resolved) - shown)

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        self._bar.close()


def _replay_command(opts: StressOptions) -> str:
    """The command that reruns one request of this run (``{index}`` to fill in)."""
    defaults = StressOptions()
    words = ["opsched stress", f"--seed {opts.seed}"]
    for name in (
        "templates",
        "large",
        "graphs",
        "invalid",
        "cancel",
        "deadline",
        "fault",
        "max_queued_requests",
        "workspace_limit_bytes",
    ):
        option = name.replace("_", "-")
        value = getattr(opts, name)
        if value != getattr(defaults, name):
            words.append(f"--{option} {value}")
    for name in ("device", "product", "config"):
        value = getattr(opts, name)
        if value is not None and value != getattr(defaults, name):
            words.append(f"--{name} {value}")
    return " ".join([*words, "--replay {index}"])


def _accounting(stats: opsched.SchedulerStatistics, tally: _Tally) -> tuple[bool, str]:
    """The scheduler's counters against what the harness itself submitted and got back.

    Exact where the harness knows the truth: requests refused at submit, launches failed by
    the injector, graph runs started. Bounds where a cancellation may race: a request
    cancelled after it finished counts as completed for the scheduler and cancelled for its
    caller; one cancelled while it waited for room in a full queue was never accepted.
    """
    o, g = tally.outcomes, tally.graph_outcomes

    def plain(*names: str) -> int:  # outcomes of single requests, not graph runs
        return sum(o.get(n, 0) - g.get(n, 0) for n in names)

    refused = plain("invalid") + sum(v - g.get(k, 0) for k, v in o.items() if k.startswith(REFUSED))
    single = sum(o.values()) - sum(g.values()) - o.get("duplicated", 0) - o.get("lost", 0)
    graph_runs = sum(g.values()) - sum(v for k, v in g.items() if k.startswith(REFUSED))
    accepted = stats.submitted - stats.graph_nodes
    most = single - refused
    least = most - plain("cancelled")
    expired_low = plain("expired") + g.get("expired", 0)
    checks = [
        ("rejected", stats.rejected, refused, stats.rejected == refused),
        ("failed", stats.failed, plain("faulted"), stats.failed == plain("faulted")),
        ("accepted", accepted, f"{least}..{most}", least <= accepted <= most),
        ("graph runs", stats.graph_runs, graph_runs, stats.graph_runs == graph_runs),
        ("expired", stats.expired, expired_low, expired_low <= stats.expired),
        ("completed", stats.completed, plain("completed"), plain("completed") <= stats.completed),
        ("finished twice", stats.finished_twice, 0, stats.finished_twice == 0),
    ]
    detail = ", ".join(f"{name} {got} (harness {want})" for name, got, want, _ in checks)
    return all(ok for *_, ok in checks), detail


def _final_checks(
    stats: opsched.SchedulerStatistics,
    tally: _Tally,
    clock: _Clock,
    bound: int,
    before: frozenset[threading.Thread],
) -> dict[str, tuple[bool, str]]:
    """The checks after shutdown: name -> (held, detail). ``before``: the threads alive
    before the run."""
    issued = clock.issued if clock.issued else len(tally.resolved)
    lost = tally.outcomes.get("lost", 0) + max(0, issued - len(tally.resolved))
    total = stats.completed + stats.failed + stats.cancelled + stats.expired
    threads = _scheduler_threads(before)
    peak = _rss_bytes()
    return {
        "every request resolved exactly once": (
            lost == 0 and tally.outcomes.get("duplicated", 0) == 0,
            f"{len(tally.resolved)} of {issued} resolved; "
            f"{lost} lost, {tally.outcomes.get('duplicated', 0)} duplicated",
        ),
        "every result right": (
            tally.outcomes.get("wrong", 0) == 0,
            f"{tally.outcomes.get('wrong', 0)} wrong",
        ),
        "expired requests never launched": (
            tally.launched_expired == 0,
            f"{tally.launched_expired} launched after their deadline",
        ),
        "counters match the harness's": _accounting(stats, tally),
        "statistics add up": (
            stats.submitted == total and stats.queued == 0 and stats.running == 0,
            f"submitted {stats.submitted} = completed {stats.completed} + failed "
            f"{stats.failed} + cancelled {stats.cancelled} + expired {stats.expired} "
            f"(= {total})",
        ),
        "workspace blocks all returned": (
            stats.pool.in_use == 0,
            f"{stats.pool.in_use} bytes still handed out after shutdown",
        ),
        "executors released": (
            stats.executor_cache.size == 0,
            f"{stats.executor_cache.size} executors still cached after shutdown",
        ),
        "no scheduler thread alive": (not threads, ", ".join(threads) or "none"),
        "memory bounded": (
            peak <= bound,
            f"peak RSS {peak >> 20} MiB, bound {bound >> 20} MiB",
        ),
    }


def _report(
    opts: StressOptions,
    stats: opsched.SchedulerStatistics,
    tally: _Tally,
    clock: _Clock,
    elapsed: float,
    checks: dict[str, tuple[bool, str]],
    bound: int,
    started: float,
) -> dict[str, Any]:
    lat = sorted(tally.latencies)

    def pct(p: float) -> float:
        return lat[min(len(lat) - 1, int(p * len(lat)))] * 1e3 if lat else 0.0

    issued = len(tally.resolved)
    scheduler_seconds = elapsed - tally.harness_seconds
    return {
        "ok": all(held for held, _ in checks.values()),
        "options": attrs.asdict(opts),
        "requests": issued,
        "seconds": elapsed,
        "throughput_per_s": issued / elapsed if elapsed else 0.0,
        "latency_ms": {"p50": pct(0.50), "p99": pct(0.99)},
        "harness_seconds": tally.harness_seconds,
        "scheduler_throughput_per_s": (
            issued / scheduler_seconds if scheduler_seconds > 0 else float("inf")
        ),
        "outcomes": dict(sorted(tally.outcomes.items())),
        "checks": {name: {"held": held, "detail": d} for name, (held, d) in checks.items()},
        "discrepancies": tally.discrepancies,
        "scheduler": {
            "launches": stats.launches,
            "requests_per_launch_mean": stats.requests_per_launch_mean,
            "queued_peak": stats.queued_peak,
            "max_queued_requests": opts.max_queued_requests,
            "backpressure_waits": stats.backpressure_waits,
            "workspace_limit_bytes": opts.workspace_limit_bytes,
            "rejected": stats.rejected,
            "graph_runs": stats.graph_runs,
            "pool_peak_bytes": stats.pool.peak,
            "executor_hit_rate": stats.executor_cache.hit_rate,
        },
        "peak_rss_bytes": _rss_bytes(),
        "rss_bound_bytes": bound,
        "wall_seconds": time.perf_counter() - started,
    }


def _print_summary(r: dict[str, Any], out: TextIO) -> None:
    o = r["options"]
    print(
        f"opsched stress: {r['requests']} requests, {o['clients']} async clients + "
        f"{o['sync_clients']} sync threads, seed {o['seed']}, device {o['device']}, "
        f"product {r['product']}",
        file=out,
    )
    print(
        f"  {r['throughput_per_s']:,.0f} requests/s over {r['seconds']:.1f} s; latency p50 "
        f"{r['latency_ms']['p50']:.2f} ms, p99 {r['latency_ms']['p99']:.2f} ms",
        file=out,
    )
    print(
        f"  the harness's own cost: {r['harness_seconds']:.1f} s of CPU drawing, preparing and "
        f"checking requests; the scheduler's share: {r['scheduler_throughput_per_s']:,.0f} "
        f"requests/s over the other {r['seconds'] - r['harness_seconds']:.1f} s; "
        f"{r['cores_busy']:.2f} cores busy",
        file=out,
    )
    outcomes = ", ".join(f"{k} {v}" for k, v in r["outcomes"].items())
    print(f"  outcomes: {outcomes}", file=out)
    s = r["scheduler"]
    print(
        f"  scheduler: {s['launches']} launches ({s['requests_per_launch_mean']:.1f} "
        f"requests each), executor hit rate {s['executor_hit_rate']:.1%}",
        file=out,
    )
    print(
        f"  caps met: queue peak {s['queued_peak']} (callers capped at "
        f"{s['max_queued_requests']}, {s['backpressure_waits']} backpressure waits; graph "
        f"nodes are admitted past it), pool peak {s['pool_peak_bytes'] / (1 << 20):.1f} of "
        f"{s['workspace_limit_bytes'] / (1 << 20):.1f} MiB",
        file=out,
    )
    print(f"  {'check':<40}{'':<8}detail", file=out)
    for name, check in r["checks"].items():
        verdict = "ok" if check["held"] else "FAILED"
        print(f"  {name:<40}{verdict:<8}{check['detail']}", file=out)
    if r["discrepancies"]:
        print("  first discrepancies (rerun one with --seed S --replay INDEX):", file=out)
        for line in r["discrepancies"][:10]:
            print(f"    {line}", file=out)
    print(f"  verdict: {'PASS' if r['ok'] else 'FAIL'}", file=out)
