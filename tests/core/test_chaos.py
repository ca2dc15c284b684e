"""Nothing a caller waits on is stranded, whatever the device raises and wherever.

Every call the scheduler makes into a device or a stream from its own bookkeeping can
raise (on an accelerator, a device error surfaces in whichever framework call comes next):
preparing a launch, handing it to its stream, recording its event, releasing its
workspace, allocating a graph intermediate, reading the memory figures for a trace,
converting a result for its caller. Here each of them raises now and then (seeded), under a
mixed load (coroutines, requests queued without waiting, thread futures, blocking calls,
graph runs, callers that cancel or whose deadline passed), on the numpy device and on
torch's CPU device, every launch on a stream thread or as configured by default. Each
request must end: its result (the solo launch's bits; a torch device's within the
tolerance) or an error; only what no request could be given is reported, by the
scheduler; the counters add up, no pool block stays held, the scheduler closes, and a
clean round afterwards is exact.
"""

from __future__ import annotations

import asyncio
import importlib.util
import random

import anyio
import numpy as np
import pytest
import structlog

import opsched
from opsched import DeadlineExceededError, SchedulerStatistics, ops
from opsched.devices.streams import Event, ThreadStream
from tests.helpers import rand
from tests.sched_helpers import assert_result, solo_glu

pytestmark = pytest.mark.anyio  # on asyncio and on trio (conftest)

F32 = np.dtype(np.float32)

#: Where the device is made to raise: (class, method, before the real call or after it).
#: After: the call's work is done (a release returns its block), then it raises.
#: ``None`` stands for the device's class.
HOOKS = [
    (None, "check_fits", "before"),
    (None, "run_solo", "before"),
    (None, "prepare", "before"),
    (None, "release", "after"),
    (None, "intermediate", "before"),
    (None, "empty", "before"),
    (None, "memory_usage", "before"),
    (ThreadStream, "enqueue", "before"),
    (ThreadStream, "record_event", "before"),
    (ThreadStream, "wait_event", "before"),
    (Event, "query", "before"),
]

#: The numpy device, and torch's CPU device where torch is installed (its own launches,
#: conversions and memory figures).
DEVICES = ["cpu", *(["torch:cpu"] if importlib.util.find_spec("torch") else [])]

#: Two ways to run: every launch on a stream thread, traced (no request runs at submit);
#: and as configured by default, small launches inline and lone requests at submit.
CONFIGS = {
    "threads-traced": {"streams": 2, "inline_max_bytes": 0, "trace": True},
    "inline": {"streams": 2},
}


class Chaos:
    """Raises ``RuntimeError("chaos in NAME")`` at each hook with probability ``p`` while
    on, from a seeded generator; counts what it raised."""

    def __init__(self, seed: int, p: float) -> None:
        self._random = random.Random(seed)
        self._p = p
        self.on = True
        self.called: dict[str, int] = {}
        self.raised: dict[str, int] = {}

    def maybe(self, name: str) -> None:
        if not self.on:
            return
        self.called[name] = self.called.get(name, 0) + 1
        if self._random.random() < self._p:
            self.raised[name] = self.raised.get(name, 0) + 1
            raise RuntimeError(f"chaos in {name}")

    def covered(self) -> bool:
        """Whether every hook called often (10 times or more) has raised at least once."""
        return all(name in self.raised for name, n in self.called.items() if n >= 10)

    def install(self, monkeypatch: pytest.MonkeyPatch, device: type) -> None:
        for cls, method, when in HOOKS:
            cls = cls or device
            real = getattr(cls, method)

            def hooked(*args, _real=real, _name=method, _when=when, **kwargs):
                if _when == "before":
                    self.maybe(_name)
                    return _real(*args, **kwargs)
                result = _real(*args, **kwargs)
                self.maybe(_name)
                return result

            monkeypatch.setattr(cls, method, hooked)
        bind = device.bind

        def converting_bind(self_, op, tensors, scalars, spec, nbytes):
            tensors, convert = bind(self_, op, tensors, scalars, spec, nbytes)
            inner = convert

            def convert(result):
                self.maybe("convert")
                return result if inner is None else inner(result)

            return tensors, convert

        monkeypatch.setattr(device, "bind", converting_bind)


def _glu(rng: np.random.Generator, rows: int, half: int) -> tuple[np.ndarray, np.ndarray]:
    return rand(rng, (rows, half), F32), rand(rng, (rows, 2 * half), F32)


class _Work:
    """One round of mixed requests and what each must return when it succeeds."""

    def __init__(self, rng: np.random.Generator, device: str) -> None:
        self.device = device
        self.awaited = [_glu(rng, int(rng.integers(1, 5)), 8) for _ in range(24)]
        self.threaded = [_glu(rng, int(rng.integers(1, 5)), 8) for _ in range(12)]
        # blocking calls from a thread (alone on an idle scheduler: run in that thread),
        # callers that give up (cancelled at once; a deadline passed)
        self.blocking = [_glu(rng, 2, 8) for _ in range(2)]
        self.cancelled = [_glu(rng, 2, 8) for _ in range(4)]
        self.late = [_glu(rng, 2, 8) for _ in range(4)]
        self.pending = [_glu(rng, 2, 8) for _ in range(4)]  # queued, then awaited
        self.chains = []
        for _ in range(6):  # GLU -> GLU: the first's result is the second's grad_out
            # (a 128 KiB intermediate: a block of the pool, which must come back)
            g, x = _glu(rng, 64, 256)
            x2 = rand(rng, (64, 1024), F32)
            graph = opsched.Graph()
            last = graph.glu_backward(graph.glu_backward(g, x, dim=-1), x2, dim=-1)
            self.chains.append((graph, last, solo_glu(solo_glu(g, x, -1), x2, -1)))

    async def run(self, sched: opsched.Scheduler) -> list[object]:
        """Everything at once; each request's outcome (a result or an exception)."""
        outcomes: list[object] = []

        async def awaited(g: np.ndarray, x: np.ndarray) -> None:
            try:
                got = await sched.glu_backward(g, x)
            except Exception as exc:
                outcomes.append(exc)
            else:
                assert_result(self.device, got, solo_glu(g, x, -1))
                outcomes.append(got)

        async def chain(graph: opsched.Graph, last: object, want: np.ndarray) -> None:
            try:
                (got,) = await sched.run(graph, outputs=[last])
            except Exception as exc:
                outcomes.append(exc)
            else:
                assert_result(self.device, got, want)
                outcomes.append(got)

        def burst() -> list[object]:  # one burst from a thread, then its outcomes
            got: list[object] = []
            for g, x in self.blocking:
                try:
                    result = sched.call_threadsafe(ops.GLU_BACKWARD, (g, x))
                except Exception as exc:
                    got.append(exc)
                else:
                    assert_result(self.device, result, solo_glu(g, x, -1))
                    got.append(result)
            futures = []
            for g, x in self.threaded:
                try:  # (the checks at submit ask the device too)
                    futures.append((sched.submit_threadsafe(ops.GLU_BACKWARD, (g, x)), g, x))
                except Exception as exc:
                    got.append(exc)
            for future, g, x in futures:
                try:
                    result = future.result()
                except Exception as exc:
                    got.append(exc)
                else:
                    assert_result(self.device, result, solo_glu(g, x, -1))
                    got.append(result)
            return got

        async def threaded() -> None:
            outcomes.extend(await anyio.to_thread.run_sync(burst))

        async def cancelled(g: np.ndarray, x: np.ndarray) -> None:
            with anyio.CancelScope() as scope:
                scope.cancel()  # delivered at the request's wait (or it ran at submit)
                await awaited(g, x)
            outcomes.append("cancelled" if scope.cancelled_caught else outcomes.pop())

        async def pending() -> None:  # queued without waiting, then awaited
            queued = []
            for g, x in self.pending:
                try:  # (the checks at submit ask the device too)
                    queued.append((sched.glu_backward_nowait(g, x), g, x))
                except Exception as exc:
                    outcomes.append(exc)
            for request, g, x in queued:
                try:
                    got = await request
                except Exception as exc:
                    outcomes.append(exc)
                else:
                    assert_result(self.device, got, solo_glu(g, x, -1))
                    outcomes.append(got)

        async def late(g: np.ndarray, x: np.ndarray) -> None:
            try:
                got = await sched.glu_backward(g, x, timeout=0.0)
            except Exception as exc:
                outcomes.append(exc)
            else:
                assert_result(self.device, got, solo_glu(g, x, -1))
                outcomes.append(got)

        async with anyio.create_task_group() as tg:
            tg.start_soon(threaded)
            tg.start_soon(pending)
            for g, x in self.awaited:
                tg.start_soon(awaited, g, x)
            for graph, last, want in self.chains:
                tg.start_soon(chain, graph, last, want)
            for g, x in self.cancelled:
                tg.start_soon(cancelled, g, x)
            for g, x in self.late:
                tg.start_soon(late, g, x)
        return outcomes

    @property
    def requests(self) -> int:
        calls = (
            self.awaited,
            self.threaded,
            self.blocking,
            self.cancelled,
            self.late,
            self.pending,
        )
        return sum(map(len, calls)) + len(self.chains)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("config", list(CONFIGS))
@pytest.mark.parametrize("seed", [1, 2, 3])
async def test_a_device_raising_anywhere_strands_nothing(
    monkeypatch, caplog, anyio_backend, tmp_path, seed, config, device
):
    rng = np.random.default_rng(seed)
    chaos = Chaos(seed, p=0.2)
    options = {"device": device, **CONFIGS[config]}
    if options.pop("trace", False):
        options["trace"] = tmp_path / "trace.json"
    async with opsched.open_scheduler(device=device) as probe:  # the device's class
        chaos.install(monkeypatch, type(probe.device))
    reported: list[tuple[str, BaseException]] = []
    if anyio_backend == "asyncio":  # what the scheduler reports goes to the loop's handler
        asyncio.get_running_loop().set_exception_handler(
            lambda _, context: reported.append((context["message"], context["exception"]))
        )

    def processor(logger: object, method: str, event: dict) -> dict:
        """The application's structlog processor: it runs on every opsched event (inside
        the scheduler's bookkeeping too) and raises now and then; it prints nothing."""
        chaos.maybe("structlog")
        raise structlog.DropEvent

    structlog.configure(processors=[processor])  # opsched emits its events once configured
    try:
        with caplog.at_level("ERROR", logger="opsched"):
            stats = await _rounds(chaos, rng, device, options)
    finally:
        structlog.reset_defaults()
        if anyio_backend == "asyncio":
            asyncio.get_running_loop().set_exception_handler(None)
    assert chaos.covered() and len(chaos.raised) >= 5, (chaos.called, chaos.raised)
    assert stats.submitted == stats.completed + stats.failed + stats.cancelled + stats.expired
    assert stats.queued == 0 and stats.running == 0
    assert stats.failed > 0  # the chaos reached requests
    # The standard library's logging got the processor's errors (on both loops) and, on
    # trio, which has no exception handler, what the scheduler reports.
    logged = [(r.getMessage(), r.exc_info[1]) for r in caplog.records if r.exc_info]
    processors = [e for m, e in logged if m.startswith("structlog raised on opsched's event")]
    assert processors and all(str(e) == "chaos in structlog" for e in processors)
    if anyio_backend == "trio":
        reported = [(m, e) for m, e in logged if not m.startswith("structlog raised")]
    # Only the chaos was reported, only where no request could be given it, and always by
    # the scheduler itself: never an exception escaping into the loop (on asyncio its
    # "Exception in callback ...", on trio the end of the run).
    assert reported or "release" not in chaos.raised
    assert {str(e) for _, e in reported} <= {
        "chaos in release",
        "chaos in memory_usage",
        "chaos in record_event",
    }, reported
    assert {message for message, _ in reported} <= {
        "opsched: releasing a finished launch's workspace failed",
        "opsched: reading the device's memory for the trace failed",
        "opsched: recording a graph launch's event failed",
        "opsched: releasing a graph intermediate failed",
    }, reported


async def _rounds(
    chaos: Chaos, rng: np.random.Generator, device: str, options: dict
) -> SchedulerStatistics:
    """Rounds under chaos until every hook called often has raised, then a clean round;
    the scheduler's statistics once closed."""
    async with opsched.open_scheduler(**options) as sched:
        for rounds in range(1, 101):
            work = _Work(rng, device)
            outcomes = await work.run(sched)
            assert len(outcomes) == work.requests  # every request ended
            if rounds >= 5 and chaos.covered():
                break
        chaos.on = False
        clean = _Work(rng, device)  # the scheduler still computes exactly
        outcomes = await clean.run(sched)
        errors = [o for o in outcomes if isinstance(o, Exception)]  # the late ones only
        assert len(errors) <= len(clean.late), errors
        assert all(isinstance(e, DeadlineExceededError) for e in errors), errors
        assert sched.statistics().pool.in_use == 0  # nothing held: every block back
    return sched.statistics()
