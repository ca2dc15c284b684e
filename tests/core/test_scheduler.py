"""The async scheduler's behaviour, on both devices where it applies."""

from __future__ import annotations

import asyncio
import itertools
import threading
import time
import weakref

import anyio
import numpy as np
import pytest
import structlog

import opsched
from opsched import (
    DeadlineExceededError,
    InjectedFault,
    InnerError,
    ParamInvalidError,
    ParamNullptrError,
    QueueFullError,
    RuntimeLaunchError,
    SchedulerClosedError,
    Status,
    ops,
)
from opsched.cli.solo import solo_gnb
from opsched.core.batching import MIN_SPREAD_BYTES
from opsched.core.dispatch import Dispatcher
from opsched.core.engine import FEW_READY, YIELD_EVERY
from opsched.devices.host import LONE_BYTES, SOLO_BATCH_MAX, HostDevice
from opsched.devices.host.glu_backward import GluBackwardLauncher
from opsched.devices.streams import Stream, ThreadStream
from tests.helpers import assert_same_bits, gn_inputs, rand
from tests.sched_helpers import (
    DEVICES,
    THREADED_DEVICES,
    FailWhen,
    Gate,
    assert_result,
    beside_a_ready_task,
    gather,
    held_stream,
    random_glu,
    random_gn,
    settle,
    small_glu,
    solo_glu,
    solo_gn,
)

pytestmark = pytest.mark.anyio  # every test on asyncio and on trio (conftest)

F32 = np.dtype(np.float32)
F64 = np.dtype(np.float64)


def assert_adds_up(stats):
    assert stats.submitted == stats.completed + stats.failed + stats.cancelled + stats.expired
    assert stats.queued == 0 and stats.running == 0


async def together(sched, calls, *, errors=False):
    """GluBackward on each ``(grad_out, self)`` of ``calls``, all queued before one dispatch
    (the loop is kept busy meanwhile, and the device says company gains every request);
    with ``errors``, an exception is returned in place."""
    device = sched.device
    alone, device.runs_alone_from = device.runs_alone_from, {}
    try:
        async with anyio.create_task_group() as tg:
            for _ in range(FEW_READY + 1):  # a busy loop: nothing runs at submit, one
                tg.start_soon(anyio.lowlevel.checkpoint)  # dispatch takes all
            pending = [sched.glu_backward_nowait(g, x) for g, x in calls]
    finally:
        device.runs_alone_from = alone
    results = []
    for p in pending:
        try:
            results.append(await p)
        except Exception as exc:
            if not errors:
                raise
            results.append(exc)
    return results


def spy_glu_gathers(monkeypatch) -> list[int]:
    """The number of requests of each GluBackward gather from now on (the list fills)."""
    gathered: list[int] = []
    gather_of = GluBackwardLauncher.gather

    def gather_spy(self, layout, fused):
        gathered.append(len(layout.requests))
        return gather_of(self, layout, fused)

    monkeypatch.setattr(GluBackwardLauncher, "gather", gather_spy)
    return gathered


def stream_threads(before=frozenset()):
    """Live stream threads, but those in ``before`` (other tests' default schedulers, which
    live until the interpreter exits)."""
    return [
        t for t in threading.enumerate() if t.name.startswith("opsched-stream") and t not in before
    ]


# -------------------------------------------------------------------- results and fusion


async def test_small_requests_fuse_up_to_an_inline_launch():
    # on the cpu device (which runs small launches inline) a fused batch of small requests
    # stops at inline_max_bytes; with inline runs off it takes max_batch_bytes
    rng = np.random.default_rng(1)
    args = [small_glu(rng) for _ in range(100)]
    per = args[0][0].nbytes + 2 * args[0][1].nbytes  # grad_out, self, out (as self)
    for inline_max in (10 * per, 0):
        async with opsched.open_scheduler(streams=1, inline_max_bytes=inline_max) as sched:
            got = await gather(*(sched.glu_backward(g, x) for g, x in args))
        stats = sched.statistics()
        assert stats.completed == 100
        if inline_max:
            assert stats.requests_per_launch_max == 10
        else:  # (one may run at submit, before the others are queued)
            assert stats.requests_per_launch_max >= 99
        for (g, x), result in zip(args, got, strict=True):
            assert_same_bits(result, solo_glu(g, x, -1))


@pytest.mark.usefixtures("fused_batches")
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("seed", range(6))
async def test_random_batches_bit_identical_to_solo(device, seed):
    rng = np.random.default_rng(seed)
    streams = int(rng.integers(1, 4))
    glu = [random_glu(rng) for _ in range(int(rng.integers(1, 60)))]
    gn = [random_gn(rng) for _ in range(int(rng.integers(1, 40)))]
    async with opsched.open_scheduler(device=device, streams=streams) as sched:
        calls = [sched.glu_backward(*a) for a in glu] + [sched.group_norm_grad(*a) for a in gn]
        order = rng.permutation(len(calls))
        results = await gather(*(calls[i] for i in order))
    by_call = dict(zip(order.tolist(), results, strict=True))
    for i, args in enumerate(glu):
        assert_result(device, by_call[i], solo_glu(*args))
    for j, args in enumerate(gn):
        assert_result(device, by_call[len(glu) + j], solo_gn(*args))
    stats = sched.statistics()
    assert_adds_up(stats)
    assert stats.completed == len(calls)


@pytest.mark.usefixtures("fused_batches")
@pytest.mark.parametrize("device", DEVICES)
async def test_group_norm_backward_of_several_shapes_fuses_bit_identical_to_solo(device):
    # one fusion key (FLOAT, two channels a group, HxW 8, every output, a gamma) and three
    # signatures in one launch: each signature group lands in its own rows and back
    rng = np.random.default_rng(11)
    calls = []
    for n, c, group in [(1, 2, 1), (2, 4, 2), (3, 6, 3)] * 4:
        dy, x = rand(rng, (n, c, 8), F32), rand(rng, (n, c, 8), F32)
        mean, rstd = rand(rng, (n, group), F32), (rng.random((n, group)) + 0.5).astype(F32)
        calls.append((dy, x, mean, rstd, rand(rng, (c,), F32), n, c, 8, group))
    async with opsched.open_scheduler(device=device, streams=1) as sched:
        results = await gather(*(sched.group_norm_backward(*args) for args in calls))
    assert sched.statistics().requests_per_launch_max > 3
    for args, got in zip(calls, results, strict=True):
        for result, alone in zip(got, solo_gnb(*args), strict=True):
            assert_result(device, result, alone)


@pytest.mark.parametrize("device", DEVICES)
async def test_concurrent_requests_fuse(device):
    rng = np.random.default_rng(0)
    args = [small_glu(rng) for _ in range(100)]
    async with opsched.open_scheduler(device=device, streams=2) as sched:
        await gather(*(sched.glu_backward(g, x) for g, x in args))
    stats = sched.statistics()
    assert stats.launches < 10 and stats.requests_per_launch_max >= 50
    assert stats.requests_per_launch_mean == pytest.approx(100 / stats.launches)


@pytest.mark.usefixtures("fused_batches")
@pytest.mark.parametrize("device", DEVICES)
async def test_out_is_written_in_place_and_results_belong_to_the_caller(device):
    rng = np.random.default_rng(1)
    g, x = small_glu(rng)
    out = np.zeros((4, 16), F32)[:, ::2]  # strided out, fused path
    async with opsched.open_scheduler(device=device) as sched:
        got, fresh = await gather(sched.glu_backward(g, x, out=out), sched.glu_backward(g, x))
    assert got is out
    assert_result(device, out, solo_glu(g, x, -1))
    assert fresh is not out and (device.startswith("torch") or fresh.flags.owndata)  # not pooled
    assert_result(device, fresh, out)


@pytest.mark.parametrize("device", THREADED_DEVICES)
async def test_large_requests_split_across_streams_bit_identical(device):
    rng = np.random.default_rng(2)
    g, x = rand(rng, (64, 256), F32), rand(rng, (64, 512), F32)
    xg = rand(rng, (4, 8, 512), F32)
    gn_args = (
        xg,
        rand(rng, xg.shape, F32),
        rand(rng, xg.shape, F32),
        rand(rng, (4, 8), F32),
        (rng.random((4, 8)) + 0.5).astype(F32),
    )
    cfg = {"streams": 3, "fuse_max_bytes": 1 << 12, "split_min_bytes": 1 << 14}
    async with opsched.open_scheduler(device=device, **cfg) as sched:
        out = await sched.glu_backward(g, x)
        dx = await sched.group_norm_grad(*gn_args)
        stats = sched.statistics()
    assert_result(device, out, solo_glu(g, x, -1))
    assert_result(device, dx, solo_gn(*gn_args))
    assert stats.launches == 6  # each request in three parts, one per stream
    assert all(s.launches == 2 for s in stats.streams)


@pytest.mark.parametrize("device", THREADED_DEVICES)
async def test_large_unsplittable_request_runs_alone(device):
    rng = np.random.default_rng(3)
    # dim=1 of a (8, 8, 64) view whose last two axes are swapped in memory: the half
    # (axes 1 and 2 together) cannot be viewed as one row, so it cannot be split.
    x = rand(rng, (8, 64, 8), F32).transpose(0, 2, 1)
    g = rand(rng, (8, 4, 64), F32)
    cfg = {"streams": 2, "fuse_max_bytes": 1 << 12, "split_min_bytes": 1 << 13}
    async with opsched.open_scheduler(device=device, **cfg) as sched:
        out = await sched.glu_backward(g, x, 1)
    assert_result(device, out, solo_glu(g, x, 1))
    assert sched.statistics().launches == 1


@pytest.mark.parametrize("device", THREADED_DEVICES)
async def test_large_lone_requests_compute_on_their_streams_but_the_last(device, monkeypatch):
    # Two lone requests of over MIN_SPREAD_BYTES start in one dispatch: the first computes
    # on its stream's thread while the second runs inline on the loop thread (run one
    # after the other inline, the two streams would never overlap). So do two fused
    # launches of that size that are each one compiled call (on the cpu device, requests
    # of LONE_BYTES or more, run on their own arrays by the table loop); fused launches of
    # many calls stay inline: they would queue for the GIL on a thread.
    ran: list[str] = []
    run_inline, enqueue = Stream.run_inline, ThreadStream.enqueue

    def inline(self, work, on_done):
        ran.append("inline")
        run_inline(self, work, on_done)

    def hop(self, work, on_done):
        ran.append("thread")
        enqueue(self, work, on_done)

    monkeypatch.setattr(Stream, "run_inline", inline)
    monkeypatch.setattr(ThreadStream, "enqueue", hop)
    rng = np.random.default_rng(4)
    big = [(rand(rng, (256, 512), F32), rand(rng, (256, 1024), F32)) for _ in range(2)]
    assert big[0][1].nbytes >= MIN_SPREAD_BYTES  # 2.5 MiB in all: alone, under 4 MiB
    tabled = [small_glu(rng, rows=128, cols=256) for _ in range(16)]  # 2 x 2.5 MiB
    # (each of LONE_BYTES at least: run on its own arrays by the table loop)
    assert 2 * tabled[0][1].nbytes + tabled[0][0].nbytes >= LONE_BYTES
    gathered = [small_glu(rng, rows=32, cols=256) for _ in range(26)]  # 2 x 1.02 MiB
    assert 2 * gathered[0][1].nbytes + gathered[0][0].nbytes < LONE_BYTES

    async with opsched.open_scheduler(device=device, streams=2) as sched:
        results = await together(sched, big)
        assert ran == ["thread", "inline"]
        ran.clear()
        results += await together(sched, tabled)
        one_call = ["thread", "inline"] if device == "cpu" else ["inline", "inline"]
        assert ran == one_call and sched.statistics().launches == 4
        ran.clear()
        results += await together(sched, gathered)
        assert ran == ["inline", "inline"] and sched.statistics().launches == 6
    for (g, x), r in zip(big + tabled + gathered, results, strict=True):
        assert_result(device, r, solo_glu(g, x, -1))


@pytest.mark.usefixtures("fused_batches")
@pytest.mark.parametrize("device", ["cpu", "reference"])
async def test_large_requests_of_a_fused_batch_run_on_their_own_arrays(device, monkeypatch):
    # A request of at least LONE_BYTES in a fused batch is not gathered: it runs with its
    # solo plan inside the launch (the same bits as alone), and its failure is its own.
    gathered = spy_glu_gathers(monkeypatch)
    rng = np.random.default_rng(5)
    large = [(rand(rng, (64, 512), F32), rand(rng, (64, 1024), F32)) for _ in range(4)]
    assert LONE_BYTES <= 5 * large[0][0].nbytes <= (1 << 20)  # fusible (fuse_max_bytes)
    small = [small_glu(rng) for _ in range(6)]
    calls = [small[0], large[0], small[1], large[1], *small[2:], *large[2:]]
    async with opsched.open_scheduler(device=device, streams=1) as sched:
        sched.device.inject_faults(FailWhen(large[1][1]))
        results = await together(sched, calls, errors=True)
        assert sched.statistics().launches == 1 and gathered == [len(small)]
        alone = await together(sched, [large[0], large[2]])  # a batch of large ones only
        assert sched.statistics().launches == 2 and gathered == [len(small)]
    for (g, x), r in zip([*calls, large[0], large[2]], results + alone, strict=True):
        if x is large[1][1]:
            assert isinstance(r, RuntimeLaunchError) and isinstance(r.__cause__, InjectedFault)
        else:
            assert_result(device, r, solo_glu(g, x, -1))


@pytest.mark.parametrize("device", ["cpu", "reference"])
async def test_a_small_batch_runs_its_requests_on_their_own_arrays(device, monkeypatch):
    # A batch of up to SOLO_BATCH_MAX requests is one launch whose requests run on their
    # solo plans one after another: nothing gathered, the executor cache not asked, the
    # same bits, a failure its request's own. One request more is gathered.
    gathered = spy_glu_gathers(monkeypatch)
    rng = np.random.default_rng(6)
    calls = [small_glu(rng) for _ in range(SOLO_BATCH_MAX)]
    more = [small_glu(rng) for _ in range(SOLO_BATCH_MAX + 1)]
    async with opsched.open_scheduler(device=device, streams=1) as sched:
        sched.device.inject_faults(FailWhen(calls[3][1]))
        results = await together(sched, calls, errors=True)
        stats = sched.statistics()
        assert stats.launches == 1 and stats.failed == 1 and gathered == []
        assert stats.executor_cache.hits == stats.executor_cache.misses == 0
        results += await together(sched, more)
        assert sched.statistics().launches == 2 and gathered == [SOLO_BATCH_MAX + 1]
    for i, ((g, x), r) in enumerate(zip([*calls, *more], results, strict=True)):
        if i == 3:
            assert isinstance(r, RuntimeLaunchError) and isinstance(r.__cause__, InjectedFault)
        else:
            assert_result(device, r, solo_glu(g, x, -1))


# --------------------------------------------------------------- priorities and queue


@pytest.mark.parametrize("device", THREADED_DEVICES)
async def test_priorities_then_fifo(device):
    rng = np.random.default_rng(4)
    blocker = small_glu(rng)
    async with held_stream(device, blocker, max_batch_requests=1) as (sched, gate, first):
        prios = [0, 5, 0, 9, 5]
        pend = [sched.glu_backward_nowait(*small_glu(rng), priority=p) for p in prios]
        gate.open()
        await first
        for p in pend:
            await p
    ids = [pend_i._request.id for pend_i in pend]
    launched_after = [ids.index(batch[0]) for batch in gate.launched[1:]]
    assert launched_after == [3, 1, 4, 0, 2]  # 9, then 5s in order, then 0s in order


@pytest.mark.parametrize("device", THREADED_DEVICES)
async def test_queue_full_nowait_raises_and_await_waits(device):
    rng = np.random.default_rng(5)
    blocker = small_glu(rng)
    async with held_stream(device, blocker, max_queued_requests=2) as (sched, gate, first):
        queued = [sched.glu_backward_nowait(*small_glu(rng)) for _ in range(2)]
        with pytest.raises(QueueFullError, match="2 requests are queued"):
            sched.glu_backward_nowait(*small_glu(rng))
        assert isinstance(QueueFullError(), anyio.WouldBlock)
        async with anyio.create_task_group() as tg:
            waiter = (
                rng.standard_normal((4, 4)).astype(F32),
                rng.standard_normal((4, 8)).astype(F32),
            )
            results = []

            async def backpressured():
                results.append(await sched.glu_backward(*waiter))

            tg.start_soon(backpressured)
            await settle(lambda: sched.statistics().backpressure_waits == 1)
            assert sched.statistics().queued == 2  # the third waits outside the queue
            gate.open()
        await first
        for q in queued:
            await q
        assert_result(device, results[0], solo_glu(*waiter, -1))
        assert sched.statistics().rejected == 1


# ----------------------------------------------------------- deadlines and cancellation


@pytest.mark.parametrize("device", THREADED_DEVICES)
async def test_deadline_expires_from_its_own_timer_and_never_launches(device):
    rng = np.random.default_rng(6)
    blocker = small_glu(rng)
    async with held_stream(device, blocker) as (sched, gate, first):
        late = small_glu(rng)
        with pytest.raises(DeadlineExceededError, match="was not launched"):
            await sched.glu_backward(*late, deadline=time.monotonic() + 0.02)
        assert not gate.opened.is_set()  # it expired while the stream was still held
        with pytest.raises(TimeoutError):  # DeadlineExceededError is a TimeoutError
            await sched.glu_backward(*late, timeout=0.01)
        gate.open()
        await first
    stats = sched.statistics()
    assert stats.expired == 2 and stats.completed == 1
    assert not gate.launched_array(late[1])
    assert_adds_up(stats)


@pytest.mark.parametrize("device", THREADED_DEVICES)
async def test_queued_deadlines_expire_each_at_its_own_time_in_order(device):
    # One timer serves every deadline: a later request with an earlier deadline re-arms
    # it (its expiry does not wait for the first one's), and a far deadline is untouched.
    rng = np.random.default_rng(16)
    blocker = small_glu(rng)
    async with held_stream(device, blocker) as (sched, gate, first):
        far, late, soon = small_glu(rng), small_glu(rng), small_glu(rng)
        order: list[str] = []
        two_expired = anyio.Event()

        async def waits(name, args, timeout):
            try:
                await sched.glu_backward(*args, timeout=timeout)
            except DeadlineExceededError:
                order.append(name)
                if len(order) == 2:
                    two_expired.set()
            else:
                order.append(f"{name} done")

        async with anyio.create_task_group() as tg:
            tg.start_soon(waits, "far", far, 60.0)
            await settle(lambda: sched.statistics().queued == 1)
            tg.start_soon(waits, "late", late, 0.06)
            tg.start_soon(waits, "soon", soon, 0.02)
            with anyio.fail_after(30):
                await two_expired.wait()
            assert order == ["soon", "late"]  # both while the stream was still held
            assert sched.statistics().queued == 1 and not gate.opened.is_set()
            gate.open()
        await first
    assert order == ["soon", "late", "far done"]
    assert not gate.launched_array(late[1]) and not gate.launched_array(soon[1])
    assert_adds_up(sched.statistics())


@pytest.mark.parametrize("device", THREADED_DEVICES)
async def test_request_launched_before_its_deadline_completes(device):
    rng = np.random.default_rng(7)
    g, x = small_glu(rng)
    async with opsched.open_scheduler(device=device) as sched:
        out = await sched.glu_backward(g, x, timeout=30)
    assert_result(device, out, solo_glu(g, x, -1))


@pytest.mark.parametrize("device", THREADED_DEVICES)
async def test_cancel_queued_request_leaves_queue(device):
    rng = np.random.default_rng(8)
    blocker = small_glu(rng)
    async with held_stream(device, blocker) as (sched, gate, first):
        victim = small_glu(rng)
        async with anyio.create_task_group() as tg:
            tg.start_soon(sched.glu_backward, *victim)
            await settle(lambda: sched.statistics().queued == 1)  # waiting in the queue
            tg.cancel_scope.cancel()
        assert sched.statistics().queued == 0 and sched.statistics().cancelled == 1
        survivor = small_glu(rng)
        pend = sched.glu_backward_nowait(*survivor)
        gate.open()
        await first
        assert_result(device, await pend, solo_glu(*survivor, -1))
    assert not gate.launched_array(victim[1])
    assert_adds_up(sched.statistics())


@pytest.mark.parametrize("device", THREADED_DEVICES)
async def test_cancel_running_request_drops_result_and_others_complete(device):
    rng = np.random.default_rng(9)
    held = small_glu(rng)
    gate = Gate(hold=held[1])
    async with opsched.open_scheduler(device=device, streams=2, inline_max_bytes=0) as sched:
        sched.device.inject_faults(gate)
        results = []
        async with anyio.create_task_group() as tg:

            async def call():
                results.append(await sched.glu_backward(*held))

            tg.start_soon(call)
            await settle(lambda: sched.statistics().running == 1)  # launched, held at the gate
            tg.cancel_scope.cancel()
        assert results == []  # the caller was cancelled; the running launch goes on
        other = small_glu(rng)
        assert_result(device, await sched.glu_backward(*other), solo_glu(*other, -1))
        gate.open()
    stats = sched.statistics()
    assert stats.cancelled == 1 and stats.completed == 1
    assert_adds_up(stats)


@pytest.mark.parametrize("device", THREADED_DEVICES)
async def test_every_task_awaiting_one_pending_gets_its_result(device):
    # The first task waits on the request alone (on asyncio, a bare future); the next ones
    # join it on an event, which must still wake the first.
    rng = np.random.default_rng(10)
    held = small_glu(rng)
    async with held_stream(device, held) as (sched, gate, pending):
        results = []

        async def wait():
            results.append(await pending)

        async with anyio.create_task_group() as tg:
            tg.start_soon(wait)
            await anyio.wait_all_tasks_blocked()  # the first waits
            tg.start_soon(wait)
            tg.start_soon(wait)
            await anyio.wait_all_tasks_blocked()
            gate.open()
    assert len(results) == 3
    for result in results:
        assert result is results[0]
        assert_result(device, result, solo_glu(*held, -1))


@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_a_scope_cancelled_after_the_result_arrived_still_cancels_the_call(monkeypatch):
    # On asyncio, anyio cancels only a task that waits on a pending future: a request that
    # finished just before its caller's scope was cancelled must not hand the result over.
    rng = np.random.default_rng(23)
    reached = []
    scope = anyio.CancelScope()
    complete = Dispatcher.complete

    def complete_then_cancel(self, *args):
        complete(self, *args)  # the result is set; its caller has not resumed yet
        scope.cancel()

    monkeypatch.setattr(Dispatcher, "complete", complete_then_cancel)
    async with opsched.open_scheduler(device="reference") as sched:
        with scope:
            await sched.glu_backward(*small_glu(rng))
            reached.append(True)
    assert scope.cancelled_caught and reached == []
    assert sched.statistics().completed == 1


# ------------------------------------------------------------------- error isolation


@pytest.mark.parametrize("device", DEVICES)
async def test_failing_request_is_isolated_in_its_fused_batch(device):
    rng = np.random.default_rng(10)
    args = [small_glu(rng) for _ in range(20)]
    bad = args[13]
    with structlog.testing.capture_logs() as logs:
        async with opsched.open_scheduler(device=device, streams=1) as sched:
            sched.device.inject_faults(FailWhen(bad[1]))
            results = await gather(
                *(sched.glu_backward(g, x) for g, x in args), return_exceptions=True
            )
    assert not [e for e in logs if e["log_level"] == "warning"]  # a request failed: no riddle
    for (g, x), r in zip(args, results, strict=True):
        if x is bad[1]:
            assert isinstance(r, RuntimeLaunchError) and r.status == Status.ERR_RUNTIME_ERROR
            assert isinstance(r.__cause__, InjectedFault)
        else:
            assert_result(device, r, solo_glu(g, x, -1))
    stats = sched.statistics()
    assert stats.failed == 1 and stats.completed == 19
    assert_adds_up(stats)


@pytest.mark.usefixtures("fused_batches")
@pytest.mark.parametrize("device", ["cpu", "reference"])
async def test_a_launch_that_fails_only_fused_completes_every_request_and_says_so(device):
    # A fault of the fused launch itself (every request runs fine alone): isolation re-runs
    # it down to single requests, each gets its result, and one warning names the launch.
    rng = np.random.default_rng(12)
    args = [small_glu(rng) for _ in range(12)]
    with structlog.testing.capture_logs() as logs:
        async with opsched.open_scheduler(device=device, streams=1) as sched:
            sched.device.inject_faults(lambda requests: len(requests) > 1)
            results = await gather(*(sched.glu_backward(g, x) for g, x in args))
    for (g, x), r in zip(args, results, strict=True):
        assert_result(device, r, solo_glu(g, x, -1))
    warnings = [e for e in logs if e["log_level"] == "warning"]
    # one per launch of several requests (how the backend's loop turns batch them varies)
    assert 1 <= len(warnings) <= sched.statistics().launches
    for w in warnings:
        assert w["event"].startswith("a fused launch failed") and w["op"] == "GluBackward"
        assert w["requests"] > 1 and "InjectedFault" in w["error"]


async def test_kernel_exception_becomes_runtime_launch_error(monkeypatch):
    rng = np.random.default_rng(11)
    g, x = rand(rng, (64, 256), F32), rand(rng, (64, 512), F32)

    def broken(self, plan, tensors):  # the cpu device's launch entry of GluBackward
        def launch(t, workspace):
            raise MemoryError("kernel blew up")

        return launch

    async with opsched.open_scheduler(fuse_max_bytes=1024, split_min_bytes=1 << 30) as sched:
        monkeypatch.setattr(GluBackwardLauncher, "prepare", broken)
        with pytest.raises(RuntimeLaunchError, match="MemoryError: kernel blew up"):
            await sched.glu_backward(g, x)
        monkeypatch.undo()
        # the scheduler goes on (a launch prepared by the broken launcher stays cached
        # for its layout: another layout's request gets the real kernel)
        g2, x2 = rand(rng, (32, 256), F32), rand(rng, (32, 512), F32)
        assert_same_bits(await sched.glu_backward(g2, x2), solo_glu(g2, x2, -1))


async def test_batch_formation_bug_fails_its_requests_not_the_dispatcher(monkeypatch):
    import opsched.core.dispatch as sched_mod

    rng = np.random.default_rng(12)
    real = sched_mod.form_batches
    calls = {"n": 0}

    def flaky(queue, idle, config, now, *policy):
        calls["n"] += 1
        if calls["n"] == 1:
            queue.pop(queue.best_key())  # takes a request, then breaks
            raise KeyError("policy bug")
        return real(queue, idle, config, now, *policy)

    monkeypatch.setattr(sched_mod, "form_batches", flaky)
    async with opsched.open_scheduler(streams=1) as sched:
        with pytest.raises(InnerError, match="batch formation failed: KeyError") as info:
            await beside_a_ready_task(sched.glu_backward(*small_glu(rng)))  # (queued)
        assert isinstance(info.value.__cause__, KeyError)
        after = small_glu(rng)
        assert_same_bits(await sched.glu_backward(*after), solo_glu(*after, -1))
    assert_adds_up(sched.statistics())


async def test_batch_formation_that_always_fails_fails_each_request_and_ends(monkeypatch):
    # a policy bug that raises before taking anything: each round fails the next queued
    # request instead of trying again forever, and the scheduler stays usable
    import opsched.core.dispatch as sched_mod

    rng = np.random.default_rng(13)
    real = sched_mod.form_batches

    def broken(*args):
        raise ValueError("policy bug")

    monkeypatch.setattr(sched_mod, "form_batches", broken)
    async with opsched.open_scheduler(streams=1) as sched:
        for _ in range(3):
            with pytest.raises(InnerError, match="batch formation failed: ValueError"):
                await beside_a_ready_task(sched.glu_backward(*small_glu(rng)))  # (queued)
        monkeypatch.setattr(sched_mod, "form_batches", real)
        after = small_glu(rng)
        assert_same_bits(await sched.glu_backward(*after), solo_glu(*after, -1))
    assert_adds_up(sched.statistics())


@pytest.mark.parametrize("raising", ["log", "release", "memory"])
async def test_a_raising_launch_report_strands_no_request(
    monkeypatch, caplog, anyio_backend, tmp_path, raising
):
    # The launch's log line runs the application's structlog processors, which may raise;
    # so may a device's release of the workspace, and (tracing on) its memory counters,
    # read at every dispatch (an accelerator's allocator statistics: a device error
    # surfaces there). Every request of the round still gets its result (two keys, two
    # inline launches in one dispatch: the first one's report raises), later dispatches
    # still run, and the error is reported: to asyncio's exception handler, on trio to the
    # standard library's logging.
    import opsched.core.dispatch as dispatch_mod
    from opsched.devices.host import HostDevice

    rng = np.random.default_rng(31)
    reported: list[BaseException] = []

    def broken(*args):
        raise RuntimeError(f"{raising} bug")

    if anyio_backend == "asyncio":
        loop = asyncio.get_running_loop()
        loop.set_exception_handler(lambda _, context: reported.append(context["exception"]))
    trace = None
    if raising == "log":
        monkeypatch.setattr(dispatch_mod, "log_launch", broken)
    elif raising == "release":
        monkeypatch.setattr(HostDevice, "release", broken)
    else:
        monkeypatch.setattr(HostDevice, "memory_usage", broken)
        trace = tmp_path / "trace.json"
    glu_calls = [small_glu(rng) for _ in range(3)]
    gn_calls = [random_gn(rng, F32) for _ in range(3)]
    with caplog.at_level("ERROR", logger="opsched"):
        async with opsched.open_scheduler(streams=2, trace=trace) as sched:
            async with anyio.create_task_group() as tg:
                for _ in range(FEW_READY + 1):  # a busy loop: everything queues, one dispatch
                    tg.start_soon(anyio.lowlevel.checkpoint)
                glu = [sched.glu_backward_nowait(g, x) for g, x in glu_calls]
                gn = [sched.group_norm_grad_nowait(*a) for a in gn_calls]
            for p, (g, x) in zip(glu, glu_calls, strict=True):
                assert_same_bits(await p, solo_glu(g, x, -1))
            for p, a in zip(gn, gn_calls, strict=True):
                assert_same_bits(await p, solo_gn(*a))
            after = small_glu(rng)
            for result in await together(sched, [after] * 2):  # dispatches still run
                assert_same_bits(result, solo_glu(*after, -1))
    if anyio_backend == "asyncio":
        loop.set_exception_handler(None)
    else:
        reported = [r.exc_info[1] for r in caplog.records if r.exc_info]
    assert reported and all(str(e) == f"{raising} bug" for e in reported)
    assert_adds_up(sched.statistics())


async def test_a_raising_structlog_processor_strands_no_request(caplog):
    # The application's structlog processors run inside the scheduler's bookkeeping (a
    # failed request's event is logged while its launch's requests are being finished):
    # one that raises is reported to the standard library's logging, never raised there.
    rng = np.random.default_rng(32)
    calls = [small_glu(rng) for _ in range(6)]

    def processor_bug(logger, method, event_dict):
        raise RuntimeError("processor bug")

    structlog.configure(processors=[processor_bug])
    try:
        with caplog.at_level("ERROR", logger="opsched"):
            async with opsched.open_scheduler(streams=1) as sched:
                sched.device.inject_faults(FailWhen(calls[1][1]))
                results = await together(sched, calls, errors=True)
                again = await together(sched, calls[2:])
    finally:
        structlog.reset_defaults()
    assert isinstance(results[1], RuntimeLaunchError)
    done = [*calls[:1], *calls[2:], *calls[2:]]
    for (g, x), r in zip(done, [results[0], *results[2:], *again], strict=True):
        assert_same_bits(r, solo_glu(g, x, -1))
    bugs = [r for r in caplog.records if r.exc_info and str(r.exc_info[1]) == "processor bug"]
    assert any("'request failed'" in r.getMessage() for r in bugs)
    assert_adds_up(sched.statistics())


async def test_a_launch_that_cannot_be_handed_to_its_stream_fails_as_a_launch(monkeypatch):
    # The hand-off to a stream can raise (on an accelerator, a device error surfaces in
    # whatever framework call comes next): that launch's requests fail with
    # RuntimeLaunchError, its stream and workspace come back, later requests run, and the
    # scheduler closes (nothing counted in flight forever).
    rng = np.random.default_rng(33)
    enqueue = ThreadStream.enqueue
    refused: list[int] = []

    def refuse_once(self, work, on_done):
        if not refused:
            refused.append(self.index)
            raise RuntimeError("device lost")
        enqueue(self, work, on_done)

    monkeypatch.setattr(ThreadStream, "enqueue", refuse_once)
    calls = [small_glu(rng) for _ in range(3)]
    async with opsched.open_scheduler(streams=1, inline_max_bytes=0) as sched:
        results = await together(sched, calls, errors=True)
        later = await together(sched, calls)
    assert refused == [0]
    for r in results:  # one launch: all three
        assert isinstance(r, RuntimeLaunchError) and "device lost" in str(r)
        assert isinstance(r.__cause__, RuntimeError)
    for (g, x), r in zip(calls, later, strict=True):
        assert_same_bits(r, solo_glu(g, x, -1))
    stats = sched.statistics()
    assert stats.failed == 3 and stats.completed == 3
    assert_adds_up(stats)


async def test_a_result_that_cannot_be_converted_fails_its_thread_future_only(monkeypatch):
    # A device may convert a result for its caller (a torch device: a tensor back to numpy;
    # on an accelerator a copy off the device, where a device error surfaces). For a
    # thread's future that runs in the launch's completion, on the loop: raising there left
    # the rest of the launch's requests without an outcome. The future of the one whose
    # conversion failed gets that error; the others their results.
    rng = np.random.default_rng(34)
    calls = [small_glu(rng) for _ in range(3)]
    bad = calls[1][0]
    bind = HostDevice.bind

    def converting_bind(self, op, tensors, scalars, spec, nbytes):
        tensors, convert = bind(self, op, tensors, scalars, spec, nbytes)
        if tensors["grad_out"] is bad:

            def convert(result):
                raise RuntimeError("copying the result off the device failed")

        return tensors, convert

    monkeypatch.setattr(HostDevice, "bind", converting_bind)
    async with opsched.open_scheduler(streams=1) as sched:
        sched.device.binds_as_given = -1  # every request bound: the converter is set

        def burst():  # one burst from a thread: one drain, one launch
            futures = [sched.submit_threadsafe(ops.GLU_BACKWARD, call) for call in calls]
            outcomes = []
            for future in futures:
                try:
                    outcomes.append(future.result())
                except Exception as exc:
                    outcomes.append(exc)
            return outcomes

        outcomes = await anyio.to_thread.run_sync(burst)
        later = await sched.glu_backward(*calls[2])
    assert isinstance(outcomes[1], RuntimeError) and "off the device" in str(outcomes[1])
    for i in (0, 2):
        assert_same_bits(outcomes[i], solo_glu(*calls[i], -1))
    assert_same_bits(later, solo_glu(*calls[2], -1))
    assert_adds_up(sched.statistics())


# ----------------------------------------------------------- invalid requests, lifecycle


@pytest.mark.parametrize("device", DEVICES)
async def test_invalid_requests_rejected_at_submit_with_their_status(device):
    rng = np.random.default_rng(13)
    g, x = small_glu(rng)
    async with opsched.open_scheduler(device=device) as sched:
        with pytest.raises(ParamInvalidError) as info:
            await sched.glu_backward(g, x, dim=0)
        assert info.value.status == 161002
        with pytest.raises(ParamNullptrError):
            sched.group_norm_grad_nowait(None, x, x, x, x)
        with pytest.raises(TypeError, match="priority must be an integer"):
            sched.glu_backward_nowait(g, x, priority="high")
        with pytest.raises(TypeError, match="deadline must be a number"):
            sched.glu_backward_nowait(g, x, deadline="soon")
        stats = sched.statistics()
    assert stats.submitted == 0 and stats.rejected == 4 and stats.launches == 0


@pytest.mark.parametrize("device", DEVICES)
async def test_leaving_the_block_drains_pending_requests(device):
    rng = np.random.default_rng(14)
    args = [small_glu(rng) for _ in range(30)]
    before = set(threading.enumerate())
    async with opsched.open_scheduler(device=device, streams=2) as sched:
        pending = [sched.glu_backward_nowait(g, x) for g, x in args]
    assert all(p.done() for p in pending)
    for p, (g, x) in zip(pending, args, strict=True):
        assert_result(device, await p, solo_glu(g, x, -1))
    assert sched.state is opsched.SchedulerState.CLOSED
    with pytest.raises(SchedulerClosedError, match="closed"):
        await sched.glu_backward(*args[0])
    assert not stream_threads(before)


@pytest.mark.parametrize("device", THREADED_DEVICES)
async def test_aclose_cancel_pending_fails_queued_requests(device):
    rng = np.random.default_rng(15)
    blocker = small_glu(rng)
    before = set(threading.enumerate())
    async with held_stream(device, blocker) as (sched, gate, first):
        queued = [sched.glu_backward_nowait(*small_glu(rng)) for _ in range(3)]
        async with anyio.create_task_group() as tg:
            tg.start_soon(lambda: sched.aclose(cancel_pending=True))
            await anyio.lowlevel.checkpoint()
            for q in queued:
                with pytest.raises(SchedulerClosedError):
                    await q
            gate.open()  # the running launch still finishes
        assert_result(device, await first, solo_glu(*blocker, -1))
    stats = sched.statistics()
    assert stats.cancelled == 3 and stats.completed == 1
    assert_adds_up(stats)
    assert not stream_threads(before)


@pytest.mark.parametrize("device", THREADED_DEVICES)
async def test_exception_in_block_cancels_pending_and_closes(device):
    rng = np.random.default_rng(16)
    before = set(threading.enumerate())
    with pytest.raises(ZeroDivisionError):
        async with opsched.open_scheduler(device=device) as sched:
            sched.glu_backward_nowait(*small_glu(rng))
            1 / 0  # noqa: B018
    assert sched.state is opsched.SchedulerState.CLOSED
    assert_adds_up(sched.statistics())
    assert not stream_threads(before)


# --------------------------------------------------------- workspace pool and executors


async def test_workspace_limit_bounds_the_pool_and_everything_completes():
    rng = np.random.default_rng(17)
    args = [small_glu(rng, rows=16, cols=256) for _ in range(200)]
    limit = 256 << 10
    async with opsched.open_scheduler(streams=2, workspace_limit_bytes=limit) as sched:
        results = await gather(*(sched.glu_backward(g, x) for g, x in args))
        stats = sched.statistics()
    for (g, x), r in zip(args, results, strict=True):
        assert_same_bits(r, solo_glu(g, x, -1))
    assert stats.pool.peak <= limit and stats.completed == 200


async def test_small_workspace_cap_gathers_in_chunks_that_fit(monkeypatch):
    gathered = spy_glu_gathers(monkeypatch)
    rng = np.random.default_rng(171)
    # 80 KiB requests (self 8 x 1024 FLOAT): gathered, but the block of the usual padded
    # capacity (2.5 MiB) is over a 256 KiB cap, and so is the whole batch's; a block for
    # two requests (160 KiB) fits
    calls = [small_glu(rng, rows=8, cols=1024) for _ in range(24)]
    limit = 256 << 10
    async with opsched.open_scheduler(streams=1, workspace_limit_bytes=limit) as sched:
        results = await together(sched, calls)
        stats = sched.statistics()
    for (g, x), r in zip(calls, results, strict=True):
        assert_same_bits(r, solo_glu(g, x, -1))
    # one launch, its chunks through one block under the cap
    assert stats.launches == 1 and gathered == [2] * 12
    assert stats.pool.overflows == 0 and 0 < stats.pool.peak <= limit


async def test_requests_no_fused_block_fits_run_on_their_own_arrays():
    rng = np.random.default_rng(172)
    # under a 64 KiB cap not even one request's gathered block fits (80 KiB of operands);
    # FLOAT's compiled loop needs no workspace alone: admitted, each on its own arrays
    calls = [small_glu(rng, rows=8, cols=1024) for _ in range(4)]
    async with opsched.open_scheduler(streams=1, workspace_limit_bytes=64 << 10) as sched:
        results = await together(sched, calls)
        stats = sched.statistics()
    for (g, x), r in zip(calls, results, strict=True):
        assert_same_bits(r, solo_glu(g, x, -1))
    assert stats.completed == 4 and stats.pool.overflows == 0 and stats.pool.peak == 0


async def test_a_given_strided_out_counts_in_the_solo_plan_under_the_cap():
    rng = np.random.default_rng(174)
    # no fused block fits a 4 KiB cap; alone, a strided out is staged through the
    # workspace (8 KiB): the plan is the one for the caller's out, not a fresh one's
    g, x = small_glu(rng, rows=8, cols=256)
    out = np.zeros((8, 512), F32)[:, ::2]
    async with opsched.open_scheduler(workspace_limit_bytes=4096) as sched:
        assert_same_bits(await sched.glu_backward(g, x), solo_glu(g, x, -1))  # 0 bytes
        with pytest.raises(ParamInvalidError, match=r"needs \d+ bytes of workspace"):
            await sched.glu_backward(g, x, out=out)


@pytest.mark.parametrize(
    ("shape", "need"),
    [
        # 8 x 512 (80 KiB: gathered): no fused block fits, and alone its numpy kernel
        # carves 65,600 bytes: the message names that need, not a fused block's
        ((8, 512), "65600"),
        # 64 x 2048 (3 MiB: launched alone, never gathered)
        ((64, 2048), r"\d+"),
    ],
    ids=["gathered", "large"],
)
async def test_request_whose_solo_plan_is_over_the_workspace_cap_is_invalid(shape, need):
    rng = np.random.default_rng(18)
    # DOUBLE: its numpy kernel carves block buffers (FLOAT's compiled loop needs none)
    rows, cols = shape
    g, x = rand(rng, (rows, cols // 2), F64), rand(rng, shape, F64)
    async with opsched.open_scheduler(workspace_limit_bytes=64 << 10) as sched:
        with pytest.raises(
            ParamInvalidError,
            match=rf"needs {need} bytes of workspace, more than workspace_limit_bytes=65536",
        ):
            await sched.glu_backward(g, x)


async def test_steady_state_hits_executor_cache_and_allocates_nothing():
    rng = np.random.default_rng(19)
    shapes = [((r, 2 * c), F32) for r in (2, 4, 8, 16) for c in (8, 16, 32, 64)]  # 16 shapes
    pool_args = [(rand(rng, (r, c // 2), dt), rand(rng, (r, c), dt)) for (r, c), dt in shapes]

    async def burst(sched, n):
        picks = rng.integers(len(pool_args), size=n)
        await gather(*(sched.glu_backward(*pool_args[i]) for i in picks))

    async with opsched.open_scheduler(streams=2) as sched:
        for _ in range(300):  # warm up over the workload's whole range, largest bursts too
            await burst(sched, int(rng.integers(1, 64)))
        for _ in range(4):  # the largest batch a burst can queue: a small request first
            # (it queues; the larger ones, which run at submit while nothing of their launch
            # key is queued, then queue behind it), then the largest shape
            largest = (sched.glu_backward(*pool_args[-1]) for _ in range(63))
            await gather(sched.glu_backward(*pool_args[0]), *largest)
        for args in pool_args:  # bursts of one take the solo path: see each shape alone
            # (alone on an idle loop, a request runs at submit, without the dispatcher's
            # executors)
            await beside_a_ready_task(sched.glu_backward(*args))
        before = sched.statistics()
        for _ in range(200):
            await burst(sched, int(rng.integers(1, 64)))
        after = sched.statistics()
    hits = after.executor_cache.hits - before.executor_cache.hits
    misses = after.executor_cache.misses - before.executor_cache.misses
    assert hits / (hits + misses) >= 0.99, (hits, misses)
    assert after.pool.allocated == before.pool.allocated  # no new workspace allocations


# ---------------------------------------------------------- a lone request at submit


@pytest.mark.parametrize("device", THREADED_DEVICES)
@pytest.mark.usefixtures("runs_at_submit")
async def test_a_lone_request_on_an_idle_scheduler_runs_at_submit(device):
    # Nothing else to run: the request is its solo launch at once, never queued; the
    # launch is counted (stream 0, which was idle) and logged like any other.
    rng = np.random.default_rng(30)
    g, x = small_glu(rng)
    with structlog.testing.capture_logs() as logs:
        async with opsched.open_scheduler(device=device) as sched:
            await anyio.lowlevel.checkpoint()  # the scheduler's service task starts
            out = await sched.glu_backward(g, x)
            stats = sched.statistics()
    assert_result(device, out, solo_glu(g, x, -1))
    assert stats.queued_peak == 0 and stats.launches == 1 and stats.streams[0].launches == 1
    assert stats.completed == 1 and stats.streams[0].busy_seconds > 0
    (launch,) = [e for e in logs if e["event"] == "launch"]
    assert launch["requests"] == 1 and launch["stream"] == 0 and launch["run_s"] > 0


@pytest.mark.usefixtures("runs_at_submit")
async def test_a_client_whose_requests_run_at_submit_lets_the_loop_run(anyio_backend):
    # A request run at submit returns at once on asyncio, but a client looping such
    # requests yields to the loop at least every YIELD_EVERY of them (trio: every one): a
    # ticker task beside it runs, and a cancellation from it reaches the client.
    rng = np.random.default_rng(34)
    g, x = small_glu(rng)
    every = YIELD_EVERY if anyio_backend == "asyncio" else 1
    done, seen = [0], []
    async with opsched.open_scheduler() as sched:
        await anyio.lowlevel.checkpoint()  # the scheduler's service task starts
        with anyio.CancelScope() as scope:

            async def ticker() -> None:
                while True:
                    seen.append(done[0])
                    if done[0] >= 40:
                        scope.cancel()
                    await anyio.lowlevel.checkpoint()

            async with anyio.create_task_group() as tasks:
                tasks.start_soon(ticker)
                await anyio.lowlevel.checkpoint()  # the ticker is running
                for _ in range(200):
                    await sched.glu_backward(g, x)
                    done[0] += 1
        stats = sched.statistics()
    if anyio_backend == "asyncio":  # (trio's loop says "many ready" beside the ticker)
        assert stats.queued_peak == 0  # every one ran at submit
    gaps = [b - a for a, b in itertools.pairwise(seen)]
    assert max(gaps) <= every and sum(gaps) >= 40
    assert done[0] <= 40 + every  # the cancellation came within one stretch


@pytest.mark.parametrize(
    "setting", ["busy loop", "max_delay_us", "inline_max_bytes", "trace", "in flight"]
)
async def test_a_request_runs_at_submit_only_when_nothing_could_join_it(setting, tmp_path):
    rng = np.random.default_rng(31)
    g, x = small_glu(rng)
    config = {
        "max_delay_us": {"max_delay_us": 100},
        "inline_max_bytes": {"inline_max_bytes": 0},
        "trace": {"trace": tmp_path / "trace.json"},
        "in flight": {"inline_max_bytes": 4096, "streams": 1},
    }.get(setting, {})
    async with opsched.open_scheduler(**config) as sched:
        await anyio.lowlevel.checkpoint()  # the scheduler's service task starts
        if setting == "busy loop":  # another task is ready to run: it may submit too
            out = await beside_a_ready_task(sched.glu_backward(g, x))
        elif setting == "in flight":  # a launch runs on the stream: this one must queue
            blocker = small_glu(rng, rows=64, cols=64)  # over inline_max_bytes: threaded
            gate = Gate(hold=blocker[1])
            sched.device.inject_faults(gate)
            held = sched.glu_backward_nowait(*blocker)
            await settle(lambda: sched.statistics().running == 1)
            pending = sched.glu_backward_nowait(g, x)
            assert sched.statistics().queued == 1
            gate.open()
            out = await pending
            assert_same_bits(await held, solo_glu(*blocker, -1))
        else:
            out = await sched.glu_backward(g, x)
        stats = sched.statistics()
    assert_same_bits(out, solo_glu(g, x, -1))
    assert stats.queued_peak >= 1  # it went through the queue


@pytest.mark.parametrize("device", THREADED_DEVICES)
@pytest.mark.parametrize(
    ("rows", "inline_max_bytes", "at_submit"),
    [(16, None, True), (64, None, True), (64, 256 << 10, False)],
)
async def test_a_medium_request_runs_at_submit_however_many_others_are_ready(
    device, rows, inline_max_bytes, at_submit
):
    # Beside tasks that may submit too, a request the device runs on its own arrays in any
    # launch still runs at submit, up to the size the loop may run inline: company would
    # gain it nothing, and queued it would run inline or pay a stream thread's round trip.
    # A larger one queues (the dispatcher spreads such requests across streams).
    rng = np.random.default_rng(35)
    g, x = small_glu(rng, rows=rows, cols=1024)  # 16 rows: 160 KiB with out; 64: 640 KiB
    cfg = {} if inline_max_bytes is None else {"inline_max_bytes": inline_max_bytes}
    async with opsched.open_scheduler(device=device, **cfg) as sched:
        await anyio.lowlevel.checkpoint()  # the scheduler's service task starts
        assert sched.device.runs_alone_from[ops.GLU_BACKWARD.name] <= 2.5 * x.nbytes
        assert (2.5 * x.nbytes <= sched.config.inline_max_bytes) == at_submit
        out = await beside_a_ready_task(sched.glu_backward(g, x))
        stats = sched.statistics()
    assert_result(device, out, solo_glu(g, x, -1))
    assert stats.launches == 1
    assert (stats.queued_peak == 0) == at_submit


@pytest.mark.parametrize("device", ["cpu", "reference"])
async def test_a_small_request_whose_solo_launch_is_cheap_runs_at_submit_beside_others(device):
    # On the cpu device a request of at least its operator's alone_from bytes runs at
    # submit beside tasks that may submit too: its solo launch costs no more than its
    # share of a fused one. A smaller one queues for company; on the reference device
    # (its kernels are not the ones measured) both queue.
    rng = np.random.default_rng(36)
    seen = []  # per request: (at least alone_from bytes, queued)
    for rows in (1, 8):  # 640 bytes with out; 5 KiB
        g, x = small_glu(rng, rows=rows, cols=64)
        async with opsched.open_scheduler(device=device) as sched:
            await anyio.lowlevel.checkpoint()  # the scheduler's service task starts
            alone = sched.device.runs_alone_from[ops.GLU_BACKWARD.name]
            if device == "cpu":
                assert alone == GluBackwardLauncher.alone_from < LONE_BYTES
            else:
                assert alone == LONE_BYTES
            out = await beside_a_ready_task(sched.glu_backward(g, x))
            queued = sched.statistics().queued_peak > 0
        assert_result(device, out, solo_glu(g, x, -1))
        seen.append((g.nbytes + 2 * x.nbytes >= alone, queued))
    at_submit = device == "cpu"
    assert seen == [(False, True), (at_submit, not at_submit)]


async def test_a_request_company_gains_nothing_runs_at_submit_beside_another_keys_queue():
    # Requests of another launch key queued for the dispatcher's next turn do not keep
    # such a request (a 5 KiB GluBackward on the cpu device) waiting: it would share
    # none of their launches. One of its own key queued does: it would join that launch.
    rng = np.random.default_rng(37)
    big = small_glu(rng, rows=8, cols=64)
    assert big[0].nbytes + 2 * big[1].nbytes >= GluBackwardLauncher.alone_from
    gn, tiny = random_gn(rng, F32), small_glu(rng)
    async with opsched.open_scheduler() as sched:
        await anyio.lowlevel.checkpoint()  # the scheduler's service task starts
        async with anyio.create_task_group() as tg:
            for _ in range(FEW_READY + 1):  # a busy loop: the small ones queue
                tg.start_soon(anyio.lowlevel.checkpoint)
            other_key = sched.group_norm_grad_nowait(*gn)
            beside_other = sched.glu_backward_nowait(*big)
            own_key = sched.glu_backward_nowait(*tiny)
            beside_own = sched.glu_backward_nowait(*big)
            states = [p.done() for p in (other_key, beside_other, own_key, beside_own)]
        outs = [await p for p in (other_key, beside_other, own_key, beside_own)]
    assert states == [False, True, False, False]
    assert_same_bits(outs[0], solo_gn(*gn))
    for out, (g, x) in zip(outs[1:], (big, tiny, big), strict=True):
        assert_same_bits(out, solo_glu(g, x, -1))


@pytest.mark.parametrize("anyio_backend", ["asyncio"])  # (on trio every call yields)
async def test_clients_alternating_at_submit_and_queued_requests_keep_fusing(anyio_backend):
    # Each client's every other request runs at submit (a 5 KiB GluBackward), the others
    # queue (a tiny GroupNormalizationGrad): its queued request's wait is its yield, so no
    # client falls behind the others' dispatch (YIELD_EVERY counts from a task's last
    # wait): each round of the small ones is one fused launch of all the clients'.
    rng = np.random.default_rng(38)
    clients, rounds = 2 * (FEW_READY + 1), 3 * YIELD_EVERY
    big = [small_glu(rng, rows=8, cols=64) for _ in range(clients)]
    gns = [gn_inputs(rng, (2, 3, 16), F32) for _ in range(clients)]  # one launch key
    async with opsched.open_scheduler() as sched:
        # both calls checked once before: a call checked in full yields (its wait), which
        # would put its client one round behind the others from the start
        await sched.glu_backward(*big[0])
        await sched.group_norm_grad(*gns[0])
        before = sched.statistics()

        async def client(i: int) -> None:
            for _ in range(rounds):
                assert_same_bits(await sched.glu_backward(*big[i]), solo_glu(*big[i], -1))
                assert_same_bits(await sched.group_norm_grad(*gns[i]), solo_gn(*gns[i]))

        async with anyio.create_task_group() as tg:
            for i in range(clients):
                tg.start_soon(client, i)
        after = sched.statistics()
    assert after.completed - before.completed == 2 * clients * rounds
    # each 5 KiB request its solo launch, then one launch of the small ones a round
    assert after.launches - before.launches == clients * rounds + rounds


@pytest.mark.parametrize("anyio_backend", ["asyncio"])  # (trio says only "none" or "many")
@pytest.mark.usefixtures("runs_at_submit")
async def test_a_request_runs_at_submit_while_at_most_few_others_are_ready(anyio_backend):
    # With FEW_READY callbacks ready on the loop the request still runs at submit (it is
    # finished when the call returns); with one more it is queued for the dispatcher.
    rng = np.random.default_rng(33)
    calls = [small_glu(rng) for _ in range(2)]
    loop = asyncio.get_running_loop()
    finished_at_submit = []
    async with opsched.open_scheduler() as sched:
        for ready, (g, x) in zip((FEW_READY, FEW_READY + 1), calls, strict=True):
            await settle(lambda: sched._engine.loop.ready() == 0)  # nothing else ready
            for _ in range(ready):
                loop.call_soon(int)
            pending = sched.glu_backward_nowait(g, x)
            finished_at_submit.append(pending._request.finished)
            assert_same_bits(await pending, solo_glu(g, x, -1))
        stats = sched.statistics()
    assert finished_at_submit == [True, False]
    assert stats.queued_peak == 1 and stats.launches == 2


@pytest.mark.usefixtures("runs_at_submit")
async def test_a_request_run_at_submit_fails_alone_and_expires_without_a_launch():
    rng = np.random.default_rng(32)
    bad, good = small_glu(rng), small_glu(rng)
    async with opsched.open_scheduler() as sched:
        await anyio.lowlevel.checkpoint()  # the scheduler's service task starts
        sched.device.inject_faults(FailWhen(bad[1]))
        with pytest.raises(RuntimeLaunchError) as raised:
            await sched.glu_backward(*bad)
        assert isinstance(raised.value.__cause__, InjectedFault)
        assert_same_bits(await sched.glu_backward(*good), solo_glu(*good, -1))
        with pytest.raises(DeadlineExceededError, match="had passed when the request"):
            await sched.glu_backward(*good, deadline=time.monotonic() - 1)
        stats = sched.statistics()
    assert stats.queued_peak == 0 and stats.launches == 2  # the expired one never launched
    assert (stats.failed, stats.completed, stats.expired) == (1, 1, 1)
    assert_adds_up(stats)


# ------------------------------------------------------------------------- observability


async def test_statistics_and_launch_log_events():
    rng = np.random.default_rng(20)
    args = [small_glu(rng) for _ in range(10)]
    with structlog.testing.capture_logs() as logs:
        start = time.perf_counter()
        async with opsched.open_scheduler(streams=1) as sched:
            await gather(*(sched.glu_backward(g, x) for g, x in args))
        wall = time.perf_counter() - start
    launches = [e for e in logs if e["event"] == "launch"]
    assert len(launches) == sched.statistics().launches
    first = launches[0]
    assert first["log_level"] == "debug" and first["op"] == "GluBackward"
    assert {"dtype", "requests", "bytes", "stream", "queue_wait_s", "run_s"} <= set(first)
    assert sum(e["requests"] for e in launches) == 10
    # (the process's malloc setting is logged by the first scheduler a process opens)
    expected = {"launch", "workspace pool grew", "malloc keeps freed memory"}
    assert not [e for e in logs if e["event"] not in expected]
    stats = sched.statistics()
    assert stats.streams[0].launches == stats.launches
    # the stream was busy at least while each launch's kernel ran, and within the block
    assert sum(e["run_s"] for e in launches) <= stats.streams[0].busy_seconds <= wall
    assert stats.queued_peak >= 1


async def test_nothing_in_flight_and_no_memory_overflows_instead_of_stalling():
    """Memory held elsewhere (as graph intermediates can hold it) and nothing running that
    would return any: the launch gets workspace beyond the cap rather than waiting forever."""
    rng = np.random.default_rng(21)
    g, x = rand(rng, (64, 128), F64), rand(rng, (64, 256), F64)  # DOUBLE carves workspace
    async with opsched.open_scheduler(streams=1, workspace_limit_bytes=1 << 20) as sched:
        held = sched.device._pool.allocate(1 << 20, 0)  # the whole pool, held
        sched.device.runs_alone_from = {}  # company gains every request: it queues
        out = await beside_a_ready_task(sched.glu_backward(g, x))  # (launched from the queue)
        other = small_glu(rng)
        assert_same_bits(await sched.glu_backward(*other), solo_glu(*other, -1))
        sched.device._pool.release(held)
        stats = sched.statistics()
    assert_same_bits(out, solo_glu(g, x, -1))
    assert stats.pool.overflows >= 1 and stats.pool.in_use == 0


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("requests", [1, 8], ids=["solo", "fused"])
def test_an_idle_scheduler_holds_no_finished_request(device, requests):
    """Once the results are back, nothing of the scheduler keeps the requests' arrays: not
    the stream thread that ran their launch (until its next one), nor the executor cache,
    nor the loop. The inputs are freed while the scheduler stays open and idle (each
    finalizer sets an event; no sleeping)."""
    rng = np.random.default_rng(8)
    with opsched.sync.open_scheduler(device=device, streams=1, inline_max_bytes=0) as sched:
        calls = [(rand(rng, (8, 32), F32), rand(rng, (8, 64), F32)) for _ in range(requests)]
        freed = [threading.Event() for _ in calls]
        for (_, x), event in zip(calls, freed, strict=True):
            weakref.finalize(x, event.set)
        futures = [sched.submit_glu_backward(g, x) for g, x in calls]  # via loop and stream
        results = [f.result() for f in futures]
        del calls, futures, x
        assert all(e.wait(timeout=10) for e in freed), "a finished request is still held"
        assert len(results) == requests and results[0].shape == (8, 64)


@pytest.mark.usefixtures("fused_batches")
async def test_empty_cache_returns_a_fused_launch_s_workspace_memory():
    """After ``empty_cache()`` nothing keeps a released block's memory: not the pool, and
    not the executor cache that planned the launch which used it (it keeps plans and
    layouts, never a block's views)."""
    rng = np.random.default_rng(9)
    calls = [(rand(rng, (8, 32), F32), rand(rng, (8, 64), F32)) for _ in range(8)]
    async with opsched.open_scheduler(streams=1, inline_max_bytes=0) as sched:
        await gather(*(sched.glu_backward(g, x) for g, x in calls))  # one fused launch
        assert sched.statistics().requests_per_launch_max > 1
        pool = sched.device._pool
        blocks = [b for by_size in pool._free.values() for bs in by_size.values() for b in bs]
        assert blocks
        freed = threading.Event()
        weakref.finalize(blocks[0].array, freed.set)
        del blocks
        sched.empty_cache()
        assert freed.wait(timeout=10), "a released block's memory is still referenced"
