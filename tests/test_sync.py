"""The synchronous facade."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import gc
import threading
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

import opsched
import opsched.sync
from opsched.core.requests import LeanRequestFuture
from tests.helpers import assert_same_bits, rand
from tests.sched_helpers import DEVICES, FailWhen, Gate, assert_result, solo_glu, solo_gn

F32 = np.dtype(np.float32)


def glu_args(rng, rows=4):
    return rand(rng, (rows, 4), F32), rand(rng, (rows, 8), F32)


@pytest.mark.parametrize("device", DEVICES)
def test_blocking_calls_and_fused_futures(device):
    rng = np.random.default_rng(0)
    args = [glu_args(rng) for _ in range(500)]
    before = set(threading.enumerate())  # other tests' default schedulers live on
    with opsched.sync.open_scheduler(device=device, streams=2) as sched:
        g, x = args[0]
        assert_result(device, sched.glu_backward(g, x), solo_glu(g, x, -1))
        futures = [sched.submit_glu_backward(g, x) for g, x in args]
        for f, (g, x) in zip(futures, args, strict=True):
            assert_result(device, f.result(timeout=30), solo_glu(g, x, -1))
        stats = sched.statistics()
    assert stats.launches < 100  # thread submissions fuse too
    assert stats.completed == 501
    left = set(threading.enumerate()) - before
    assert not [t for t in left if t.name.startswith(("opsched-stream", "opsched-portal"))]


@pytest.mark.parametrize("device", DEVICES)
def test_group_norm_and_out(device):
    rng = np.random.default_rng(1)
    x = rand(rng, (2, 3, 8), F32)
    gn = (
        x,
        rand(rng, x.shape, F32),
        rand(rng, x.shape, F32),
        rand(rng, (2, 3), F32),
        (rng.random((2, 3)) + 0.5).astype(F32),
    )
    out = np.empty_like(x)
    with opsched.sync.open_scheduler(device=device) as sched:
        assert sched.group_norm_grad(*gn, out=out) is out
        fut = sched.submit_group_norm_grad(*gn)
        assert_result(device, fut.result(timeout=30), solo_gn(*gn))
    assert_result(device, out, solo_gn(*gn))


@pytest.mark.parametrize("device", DEVICES)
def test_errors_reach_the_caller(device):
    rng = np.random.default_rng(2)
    g, x = glu_args(rng)
    with opsched.sync.open_scheduler(device=device, streams=1) as sched:
        with pytest.raises(opsched.ParamInvalidError, match="grad_out.shape"):
            sched.submit_glu_backward(g, x, 0)  # raised at submit, in this thread
        sched.scheduler.device.inject_faults(FailWhen(x))
        with pytest.raises(opsched.RuntimeLaunchError):
            sched.glu_backward(g, x)


@contextlib.contextmanager
def one_stream_held(rng) -> Iterator[tuple[opsched.sync.SyncScheduler, Gate, Any]]:
    """A sync scheduler of one stream, held by a first request until ``gate.open()``:
    yields the scheduler, the gate and that request's future."""
    blocker = glu_args(rng)
    gate = Gate(hold=blocker[1])
    with opsched.sync.open_scheduler(streams=1, inline_max_bytes=0) as sched:
        sched.scheduler.device.inject_faults(gate)
        first = sched.submit_glu_backward(*blocker)
        assert gate.entered.wait(10)  # the only stream is now held
        yield sched, gate, first


def test_cancel_a_queued_future_and_deadline():
    rng = np.random.default_rng(3)
    with one_stream_held(rng) as (sched, gate, first):
        victim = glu_args(rng)
        doomed = sched.submit_glu_backward(*victim)
        assert doomed.cancel()
        late = sched.submit_glu_backward(*glu_args(rng), timeout=0.01)
        with pytest.raises(opsched.DeadlineExceededError):
            late.result(timeout=30)  # expired by its timer while the stream is held
        gate.open()
        first.result(timeout=30)
        stats = sched.statistics()
    assert not gate.launched_array(victim[1])
    assert stats.cancelled == 1 and stats.expired == 1 and stats.completed == 1


def test_futures_cancelled_in_the_inbox_end_cancelled_never_launched():
    # The loop thread is held inside an inline launch, so what a thread submits meanwhile
    # waits in the inbox. The futures cancelled there end cancelled when the loop drains
    # it, never launched; the others run.
    rng = np.random.default_rng(8)
    blocker = glu_args(rng)
    gate = Gate(hold=blocker[1])
    with opsched.sync.open_scheduler(streams=1) as sched:
        sched.scheduler.device.inject_faults(gate)
        first = sched.submit_glu_backward(*blocker)
        assert gate.entered.wait(10)  # the loop thread is in the held launch
        args = [glu_args(rng) for _ in range(5)]
        futures = [sched.submit_glu_backward(*a) for a in args]
        for future in futures[::2]:
            assert future.cancel()
        gate.open()
        first.result(timeout=30)
        kept = [(a, f.result(timeout=30)) for a, f in zip(args[1::2], futures[1::2], strict=True)]
        stats = sched.statistics()
    for future in futures[::2]:
        assert future.cancelled()
    assert not any(gate.launched_array(a[1]) for a in args[::2])
    for (g, x), result in kept:
        assert_same_bits(result, solo_glu(g, x, -1))
    assert (stats.submitted, stats.completed, stats.cancelled) == (6, 3, 3)


@pytest.fixture(
    params=["RequestFuture", pytest.param("LeanRequestFuture", marks=pytest.mark.internals)]
)
def future_class(request: pytest.FixtureRequest) -> type:
    """Each kind of future a thread's submission may get: the public one, and the lean
    one behind the gate (opsched._compat)."""
    from opsched.core import requests

    return getattr(requests, request.param)


@pytest.mark.internals
def test_request_futures_set_every_field_a_future_has():
    # LeanRequestFuture sets Future's fields itself (to build a leaner condition): a Python
    # that adds a field to Future must fail here, not in a user's wait().
    from opsched.core.requests import LeanRequestFuture

    # (its list of done-callbacks is a class-level empty tuple until the first is added)
    future = LeanRequestFuture()
    assert all(hasattr(future, name) for name in vars(concurrent.futures.Future()))


@pytest.mark.internals
def test_a_request_future_nobody_waited_on_is_one_tracked_object():
    # A burst holds thousands of futures: each tracked object they hold makes the garbage
    # collector's passes longer. A RequestFuture whose outcome came before anyone waited on
    # it is itself alone, through the whole of a submission: its fields are slots (no
    # __dict__: fields set after __init__ made one, as the scheduler's handling did), no
    # condition until a thread blocks on it, no waiters' list until
    # concurrent.futures.wait() installs a waiter, no done-callbacks' list until one is
    # added. Its result then comes without a lock, and makes no condition either.
    import gc

    rng = np.random.default_rng(15)
    with opsched.sync.open_scheduler(streams=1) as sched:
        futures = [sched.submit_glu_backward(*glu_args(rng)) for _ in range(64)]
        gc.collect()  # a pass over live futures, as in a burst
    # (the block waited for every request: each future has its outcome, nobody waited)
    for future in futures:
        assert future.done() and future.result(timeout=0).shape == (4, 8)
    gc.collect()
    for future in futures:
        kinds = [type(r).__name__ for r in gc.get_referents(future) if gc.is_tracked(r)]
        assert kinds == ["type"], kinds  # the class, not an instance


@pytest.mark.internals
def test_a_future_settled_while_a_thread_makes_its_condition_loses_nothing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The loop gives a future with no condition its outcome without one; a thread that
    # makes the condition at that moment (to wait in result()) must be told of it. Forced:
    # settle() has seen no condition and waits for the module's lock, which a thread holds
    # while it makes one; a waiter blocks in result() on it; then the lock is let go.
    from opsched.core import requests

    made = threading.Lock()
    at_lock = threading.Event()

    class Announcing:  # the module's lock, saying when settle() reaches it
        def __enter__(self) -> None:
            at_lock.set()
            made.acquire()

        def __exit__(self, *exc: object) -> None:
            made.release()

    monkeypatch.setattr(requests, "_CONDITION_MADE", Announcing())
    future = requests.LeanRequestFuture()
    got: list[Any] = []
    with made:  # a thread making the future's condition, right now
        settling = threading.Thread(target=future.settle, args=(np.ones(3), None))
        settling.start()
        assert at_lock.wait(30)  # settle() saw no condition; it waits here
        future._cond = requests._FutureCondition()  # what _condition makes, under the lock
        waiting = threading.Thread(target=lambda: got.append(future.result(timeout=30)))
        waiting.start()
    settling.join(30)
    waiting.join(30)
    assert got and got[0].shape == (3,)
    assert future.result(timeout=0) is got[0]

    failed = requests.LeanRequestFuture()
    failed.settle(None, RuntimeError("boom"))  # no condition: the error is kept
    assert failed.done() and failed._cond is None
    with pytest.raises(RuntimeError, match="boom"):
        failed.result(timeout=0)
    assert isinstance(failed.exception(timeout=0), RuntimeError)


def test_futures_from_many_threads_end_once_however_they_are_waited_on():
    # A future's condition is made on first need, and the loop gives a future without one
    # its outcome under a module lock instead. Threads that wait in result() before the
    # outcome or after it, through wait() / as_completed(), with a done-callback, or that
    # cancel, at whatever moment the loop settles their futures: each future ends once,
    # with its solo result (or cancelled), and no waiter is left behind (a lost wake-up
    # fails here by its timeout, never hangs).
    import random

    rng = np.random.default_rng(21)
    args = [glu_args(rng) for _ in range(32)]
    want = [solo_glu(g, x, -1) for g, x in args]
    added: list[int] = []  # the requests given a done-callback
    calls: list[int] = []  # the callbacks that ran
    failures: list[BaseException] = []

    def check(k: int, future: concurrent.futures.Future[Any]) -> None:
        if future.cancelled():
            with pytest.raises(concurrent.futures.CancelledError):
                future.result(timeout=0)
        else:
            assert_same_bits(future.result(timeout=30), want[k])

    def worker(sched: opsched.sync.SyncScheduler, seed: int) -> None:
        chooser = random.Random(seed)
        mine: list[tuple[int, concurrent.futures.Future[Any]]] = []
        try:
            for _ in range(150):
                k = chooser.randrange(len(args))
                future = sched.submit_glu_backward(*args[k])
                mine.append((k, future))
                way = chooser.randrange(5)
                if way == 0:  # at once: most likely before its outcome
                    check(k, future)
                elif way == 1:
                    added.append(k)
                    future.add_done_callback(lambda f, k=k: calls.append(k))
                elif way == 2:
                    future.cancel()  # queued: withdrawn; running or done: says False
                elif way == 3 and len(mine) >= 4:  # the last few, by the standard tools
                    recent = [f for _, f in mine[-4:]]
                    done, _ = concurrent.futures.wait(recent, timeout=30)
                    assert done == set(recent)
                    assert set(concurrent.futures.as_completed(recent, timeout=30)) == done
            for k, future in mine:  # the rest, after their outcomes (mostly)
                check(k, future)
                assert future.done()
        except BaseException as exc:  # reported by the test's thread
            failures.append(exc)

    with opsched.sync.open_scheduler(streams=2) as sched:
        threads = [threading.Thread(target=worker, args=(sched, s)) for s in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        stats = sched.statistics()
    assert not any(t.is_alive() for t in threads)
    assert not failures, failures
    # each callback ran once (on the loop thread, or in add_done_callback when done by then)
    assert sorted(calls) == sorted(added) and added
    assert stats.submitted == 600 and stats.completed + stats.cancelled == 600


def test_futures_work_with_the_standard_waiting_tools():
    # The futures' condition is a leaner one than concurrent.futures builds: wait(),
    # as_completed(), result(timeout), done-callbacks and cancel() must all still work.
    rng = np.random.default_rng(12)
    with one_stream_held(rng) as (sched, gate, held):
        with pytest.raises(concurrent.futures.TimeoutError):
            held.result(timeout=0)  # still running: a timed wait times out
        queued = [sched.submit_glu_backward(*glu_args(rng)) for _ in range(3)]
        called: list[str] = []
        second = threading.Event()
        queued[0].add_done_callback(lambda f: called.append("first"))
        queued[0].add_done_callback(lambda f: (called.append("second"), second.set()))
        assert queued[2].cancel() and queued[2].cancelled()
        done, pending = concurrent.futures.wait(queued, timeout=0)
        assert done == {queued[2]} and len(pending) == 2
        gate.open()
        finished = set(concurrent.futures.as_completed([held, *queued[:2]], timeout=30))
        assert finished == {held, *queued[:2]}
        assert all(f.exception() is None and f.result().shape == (4, 8) for f in finished)
        assert second.wait(10)  # the loop thread runs them after it set the result
        assert called == ["first", "second"]  # each once, in order
        queued[0].add_done_callback(lambda f: called.append("after"))  # done: runs now
        assert called == ["first", "second", "after"]
        if isinstance(queued[1], LeanRequestFuture):  # (behind the gate: opsched._compat)
            assert queued[1]._done_callbacks == ()  # none added: none made
        with pytest.raises(concurrent.futures.CancelledError):
            queued[2].result()


def test_every_thread_waiting_on_a_future_wakes_with_its_result():
    # The futures' condition is its own lock and makes its waiters' list on the first
    # wait: several threads blocked in result() must all wake when the request finishes.
    rng = np.random.default_rng(14)
    with one_stream_held(rng) as (sched, gate, held):
        queued = sched.submit_glu_backward(*glu_args(rng))
        started, got = threading.Barrier(5), []

        def waiter() -> None:
            started.wait(10)
            got.append(queued.result(timeout=30).shape)

        threads = [threading.Thread(target=waiter) for _ in range(4)]
        for t in threads:
            t.start()
        started.wait(10)  # every waiter is about to block in result()
        gate.open()
        for t in threads:
            t.join(30)
        held.result(timeout=30)
    assert got == [(4, 8)] * 4


def test_a_future_cancelled_by_its_owner_is_left_cancelled_by_its_outcome(future_class):
    # The loop gives a future its outcome with settle(): a cancel() that came first wins,
    # and the late outcome neither raises (InvalidStateError, on the loop thread) nor
    # replaces the cancellation.
    RequestFuture = future_class
    future = RequestFuture()
    assert future.cancel()
    assert future.cancel()  # again: still True, as a plain Future says (it raised here)
    future.settle(np.zeros(2), None)
    future.settle(None, RuntimeError("late"))
    assert future.cancelled()
    with pytest.raises(concurrent.futures.CancelledError):
        future.result(timeout=0)
    fresh = RequestFuture()
    fresh.settle(None, RuntimeError("boom"))
    with pytest.raises(RuntimeError, match="boom"):
        fresh.result(timeout=0)
    with pytest.raises(RuntimeError, match="un-acquired"):
        fresh._condition.notify_all()  # as threading.Condition: only while held


def test_settle_tells_the_standard_waiters_and_happens_once(future_class):
    # settle() does set_result's / set_exception's work itself, under one lock: the waiters
    # that concurrent.futures.wait() and as_completed() install must hear of both kinds of
    # outcome, and a second outcome changes nothing.
    from concurrent.futures._base import FIRST_EXCEPTION, _create_and_install_waiters

    RequestFuture = future_class
    for error in (None, RuntimeError("boom")):
        future, pending = RequestFuture(), RequestFuture()
        waiter = _create_and_install_waiters([future, pending], FIRST_EXCEPTION)
        future.settle(None if error else 7, error)
        assert waiter.finished_futures == [future]
        # an error ends a FIRST_EXCEPTION wait at once; a result leaves it for the other
        assert waiter.event.is_set() is (error is not None)
        future.settle(8, None)  # too late: ignored
        if error is None:
            assert future.result(timeout=0) == 7
        else:
            assert future.exception(timeout=0) is error


def test_done_callbacks_run_without_the_futures_lock(future_class):
    # As for any Future, a done-callback runs after the future's lock is let go: one that
    # waits on another thread which needs that future would deadlock otherwise.
    RequestFuture = future_class

    held = []
    for finish in ("result", "error", "cancel"):
        future = RequestFuture()
        future.add_done_callback(lambda f: held.append(f._condition._is_owned()))
        if finish == "cancel":
            future.cancel()
        else:
            future.settle(1, None if finish == "result" else RuntimeError("boom"))
    assert held == [False, False, False]


def test_a_finished_future_keeps_nothing_of_its_request():
    # Callers keep futures around; the request record (with every array it was given)
    # must not live as long as they do.
    from opsched.core.requests import Request

    rng = np.random.default_rng(13)
    with opsched.sync.open_scheduler(streams=1) as sched:
        futures = [sched.submit_glu_backward(*glu_args(rng)) for _ in range(4)]
        results = [f.result(timeout=30) for f in futures]
    assert all(r.shape == (4, 8) for r in results)
    seen, frontier = set(), list(futures)
    for _ in range(4):  # everything the futures reach, four references deep
        frontier = [o for f in frontier for o in gc.get_referents(f) if id(o) not in seen]
        seen.update(map(id, frontier))
        assert not any(isinstance(o, Request) for o in frontier)


def test_call_from_the_loop_thread_is_a_clear_error():
    rng = np.random.default_rng(4)
    g, x = glu_args(rng)
    with opsched.sync.open_scheduler() as sched:

        async def inside():
            return sched.glu_backward(g, x)

        with pytest.raises(RuntimeError, match="own event-loop thread"):
            sched._portal.portal.call(inside)


def test_works_from_a_thread_running_its_own_asyncio_loop():
    rng = np.random.default_rng(5)
    g, x = glu_args(rng)

    async def notebook_cell():
        return opsched.sync.glu_backward(g, x)  # blocking call inside a running loop

    assert_same_bits(asyncio.run(notebook_cell()), solo_glu(g, x, -1))


@pytest.mark.parametrize("device", DEVICES)
def test_many_submitting_threads(device):
    rng = np.random.default_rng(6)
    args = [glu_args(rng) for _ in range(400)]
    with (
        opsched.sync.open_scheduler(device=device, streams=2) as sched,
        concurrent.futures.ThreadPoolExecutor(4) as pool,
    ):
        results = list(pool.map(lambda a: sched.glu_backward(*a), args))
    for (g, x), r in zip(args, results, strict=True):
        assert_result(device, r, solo_glu(g, x, -1))
