"""A lone blocking call on an idle scheduler runs in the caller's thread (no round trip
through the loop thread), with the bits of its solo launch; a busy scheduler queues it."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

import opsched.sync
from opsched import DeadlineExceededError, InjectedFault, RuntimeLaunchError, aclnn
from opsched.core.engine import Engine
from tests.helpers import assert_close, assert_same_bits, rand
from tests.sched_helpers import THREADED_DEVICES, Gate, assert_result, solo_glu, uses

F32 = np.dtype(np.float32)


class Where:
    """A fault injector that injects nothing: it records the thread of each launch."""

    def __init__(self, fail: np.ndarray | None = None) -> None:
        self.threads: list[int] = []
        self.fail = fail

    def __call__(self, requests) -> bool:
        self.threads.append(threading.get_ident())
        return self.fail is not None and any(uses(r.tensors["self"], self.fail) for r in requests)


def args(seed: int):
    rng = np.random.default_rng(seed)
    return rand(rng, (8, 32), F32), rand(rng, (8, 64), F32)


@pytest.mark.parametrize("device", THREADED_DEVICES)
def test_a_lone_blocking_call_runs_in_the_calling_thread_with_the_solo_bits(device):
    g, x = args(1)
    where = Where()
    with opsched.sync.open_scheduler(device=device, streams=2) as sched:
        sched.scheduler.device.inject_faults(where)
        got = sched.glu_backward(g, x)
        again = opsched.sync.SyncScheduler.glu_backward(sched, g, x, dim=-1)
        stats = sched.statistics()
    assert where.threads == [threading.get_ident()] * 2  # ran here, twice
    assert_result(device, got, solo_glu(g, x, -1))
    assert_same_bits(again, got)
    assert (stats.submitted, stats.completed, stats.launches) == (2, 2, 2)
    assert all(s.launches == 0 for s in stats.streams)  # no stream was used
    # the bits of the same request launched by the loop thread (max_delay_us: never here)
    with opsched.sync.open_scheduler(device=device, streams=1, max_delay_us=1.0) as sched:
        sched.scheduler.device.inject_faults(where)
        assert_same_bits(sched.glu_backward(g, x), got)
    assert where.threads[-1] != threading.get_ident()


def test_a_busy_scheduler_queues_the_blocking_call(monkeypatch):
    blocker = args(2)
    gate = Gate(hold=blocker[1])
    g, x = args(3)
    queued = threading.Event()
    real = Engine.submit_threadsafe

    def submit(self, call):
        future = real(self, call)
        _, arguments, *_ = call  # (op, args, out, priority, deadline, timeout)
        if arguments[1] is x:
            queued.set()
        return future

    monkeypatch.setattr(Engine, "submit_threadsafe", submit)
    with opsched.sync.open_scheduler(streams=1, inline_max_bytes=0) as sched:
        sched.scheduler.device.inject_faults(gate)
        first = sched.submit_glu_backward(*blocker)  # holds the only stream
        assert gate.entered.wait(10)  # launched, held at the gate: the scheduler is busy
        result: list[np.ndarray] = []
        caller = threading.Thread(target=lambda: result.append(sched.glu_backward(g, x)))
        caller.start()
        assert queued.wait(10)  # handed to the loop, not run in the caller's thread
        gate.open()
        caller.join(30)
        first.result(30)
        stats = sched.statistics()
    assert_same_bits(result[0], solo_glu(g, x, -1))
    assert gate.launched_array(x)  # it went through a stream's launch, not the caller
    assert stats.streams[0].launches == stats.launches == 2


@pytest.mark.parametrize("mask", [(True, True, True), (True, False, True), (False, True, False)])
def test_lone_calls_get_the_outputs_their_cached_plan_allocates(mask):
    # A lone call whose outputs the launch allocates is planned by its signature and its
    # inputs' strides, and its outputs are made from the shapes that plan's entry kept; the
    # usual launch (every output asked for, nothing staged) keeps a runner with its layout
    # checked once. A second call of the geometry (a hit), the same geometry with a
    # Fortran-ordered input (another plan: it stages that input), calls without gamma and
    # outputs not asked for (left None) must all come out as the two-phase call's, within
    # tolerance of the float64 formula, each in new arrays of its own.
    from tests.ops.test_group_norm_backward import golden

    rng = np.random.default_rng(21)
    n, c, hxw, group = 2, 4, 40, 2
    where = Where()
    results = []
    with opsched.sync.open_scheduler(streams=1) as sched:
        sched.scheduler.device.inject_faults(where)
        for order, with_gamma in [("C", 1), ("C", 1), ("F", 1), ("F", 1), ("C", 0), ("C", 0)]:
            dy = np.asarray(rand(rng, (n, c, hxw), F32), order=order)
            x = rand(rng, (n, c, hxw), F32)
            mean = rand(rng, (n, group), F32)
            rstd = (rng.random((n, group)) + 0.5).astype(F32)
            gamma = rand(rng, (c,), F32) if with_gamma else None
            call = (dy, x, mean, rstd, gamma, n, c, hxw, group)
            got = sched.group_norm_backward(*call, output_mask=mask)
            outs = [np.empty_like(x), np.empty(c, F32), np.empty(c, F32)]
            outs = [o if m else None for o, m in zip(outs, mask, strict=True)]
            size, ex = aclnn.group_norm_backward_get_workspace_size(*call, mask, *outs)
            aclnn.group_norm_backward(np.empty(size, np.uint8) if size else None, size, ex)
            for array, want, gold, asked in zip(got, outs, golden(call), mask, strict=True):
                if not asked:
                    assert array is None
                    continue
                assert_same_bits(array, want)
                assert_close(array, gold.reshape(array.shape), F32, "group_norm_backward")
                assert array.flags.c_contiguous and array.flags.owndata
            results.append(got)
        # (the solo plans of calls whose outputs the launch allocated)
        entries = [e for e in sched.scheduler.device._solo_plans.values() if e.made]
    # one plan a layout (a C-ordered call's plan reads dy in place; the other stages it),
    # and one without gamma; a runner where the launch is the usual one
    assert sorted(e.plan.stage_dy for e in entries) == [False, False, True]
    usual = mask == (True, True, True)
    assert [e.launch.__name__ == "usual" for e in entries] == [usual, False, usual]
    assert where.threads == [threading.get_ident()] * 6  # each ran in this thread
    assert all(a is not b for a, b in zip(results[0], results[1], strict=True) if a is not None)


@pytest.mark.parametrize("device", THREADED_DEVICES)
def test_a_failing_lone_call_fails_alone_and_is_counted(device):
    g, x = args(4)
    with opsched.sync.open_scheduler(device=device, streams=1) as sched:
        sched.scheduler.device.inject_faults(Where(fail=x))
        with pytest.raises(RuntimeLaunchError) as info:
            sched.glu_backward(g, x)
        assert isinstance(info.value.__cause__, InjectedFault)
        ok = args(5)
        assert_result(device, sched.glu_backward(*ok), solo_glu(*ok, -1))
        stats = sched.statistics()
    assert (stats.submitted, stats.completed, stats.failed) == (2, 1, 1)


def test_a_lone_call_past_its_deadline_expires_without_a_launch():
    g, x = args(6)
    where = Where()
    with opsched.sync.open_scheduler(streams=1) as sched:
        sched.scheduler.device.inject_faults(where)
        with pytest.raises(DeadlineExceededError, match="was not launched"):
            sched.glu_backward(g, x, deadline=time.monotonic() - 1)
        stats = sched.statistics()
    assert where.threads == [] and (stats.submitted, stats.expired, stats.launches) == (1, 1, 0)


@pytest.mark.parametrize(
    "setting", [{"max_delay_us": 200.0}, {"trace": "TRACE"}, {"device": "reference"}]
)
def test_no_caller_thread_launch_where_the_loop_must_see_it(tmp_path, setting):
    """Waiting for company (max_delay_us), a trace to record: through the loop. The
    reference device runs inline on the loop thread by design."""
    if setting.get("trace") == "TRACE":
        setting = {"trace": tmp_path / "t.json"}
    g, x = args(7)
    where = Where()
    with opsched.sync.open_scheduler(streams=1, **setting) as sched:
        sched.scheduler.device.inject_faults(where)
        assert_same_bits(sched.glu_backward(g, x), solo_glu(g, x, -1))
    assert where.threads and where.threads[0] != threading.get_ident()
