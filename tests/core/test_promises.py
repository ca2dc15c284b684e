"""Promises of the scheduler that concurrent callers rely on: a request's outcome belongs to
the request, not to one of its waiters; backpressure is first come, first served; a
deadline bounds how long a request is held for company; a scheduler may be left from
another task."""

from __future__ import annotations

import anyio
import numpy as np
import pytest

from opsched import RequestState, RequestWithdrawnError
from tests.sched_helpers import (
    THREADED_DEVICES,
    assert_result,
    held_stream,
    settle,
    small_glu,
    solo_glu,
)

pytestmark = pytest.mark.anyio  # every test on asyncio and on trio (conftest)


@pytest.mark.parametrize("device", THREADED_DEVICES)
async def test_cancelling_one_of_two_waiters_leaves_the_other_its_result(device):
    rng = np.random.default_rng(1)
    blocker = small_glu(rng)
    async with held_stream(device, blocker) as (sched, gate, first):
        g, x = small_glu(rng)
        pending = sched.glu_backward_nowait(g, x)
        got = []
        async with anyio.create_task_group() as tg:
            scope = anyio.CancelScope()

            async def cancelled_waiter():
                with scope:
                    await pending

            async def waiter():
                got.append(await pending)

            tg.start_soon(cancelled_waiter)
            tg.start_soon(waiter)
            await settle(lambda: pending._request.waiting == 2)
            scope.cancel()
            await settle(lambda: pending._request.waiting == 1)
            assert pending.state is RequestState.QUEUED  # not its last waiter: still queued
            gate.open()
        await first
    assert len(got) == 1
    assert_result(device, got[0], solo_glu(g, x, -1))
    assert sched.statistics().cancelled == 0


@pytest.mark.parametrize("device", THREADED_DEVICES)
async def test_the_last_waiters_cancellation_withdraws_the_request(device):
    rng = np.random.default_rng(2)
    blocker = small_glu(rng)
    async with held_stream(device, blocker) as (sched, gate, first):
        pending = sched.glu_backward_nowait(*small_glu(rng))
        async with anyio.create_task_group() as tg:
            for _ in range(2):

                async def waiter():
                    await pending

                tg.start_soon(waiter)
            await settle(lambda: pending._request.waiting == 2)
            tg.cancel_scope.cancel()
        assert pending.state is RequestState.CANCELLED
        with pytest.raises(RequestWithdrawnError, match="GluBackward: the request was withdrawn"):
            await pending
        gate.open()
        await first
    assert sched.statistics().cancelled == 1


class LaunchOrder:
    """A fault-injector hook that never injects: it records which caller's request each
    launch ran, by the identity of its ``self`` array."""

    def __init__(self, arrays) -> None:
        self.index = {id(a): i for i, a in enumerate(arrays)}
        self.launched: list[int] = []

    def __call__(self, requests) -> bool:
        for r in requests:
            found = [self.index[id(t)] for t in r.tensors.values() if id(t) in self.index]
            self.launched.extend(found)
        return False


@pytest.mark.parametrize("cap", [1, 3])
async def test_backpressure_admits_first_come_first_served(cap):
    import opsched

    rng = np.random.default_rng(3)
    parked, newcomers = 60, 60
    calls = [small_glu(rng) for _ in range(parked + newcomers)]
    order = LaunchOrder([x for _, x in calls])
    arrived: list[int] = []
    async with opsched.open_scheduler(
        device="cpu",
        streams=1,
        inline_max_bytes=0,
        max_queued_requests=cap,
        max_batch_requests=1,
    ) as sched:
        blocker = small_glu(rng)
        from tests.sched_helpers import Gate

        gate = Gate(hold=blocker[1])

        def hooks(requests):
            gate(requests)
            return order(requests)

        sched.device.inject_faults(hooks)
        first = sched.glu_backward_nowait(*blocker)
        await settle(lambda: sched.statistics().running == 1)

        async def submitter(i):
            arrived.append(i)  # the same step as the admission check: arrival order
            await sched.glu_backward(*calls[i])

        async with anyio.create_task_group() as tg:
            for i in range(parked):
                tg.start_soon(submitter, i)
            await settle(lambda: sched.statistics().backpressure_waits == parked - cap)
            gate.open()
            for i in range(parked, parked + newcomers):  # newcomers while the queue drains
                tg.start_soon(submitter, i)
                await anyio.lowlevel.checkpoint()
        await first
    assert sorted(order.launched) == list(range(parked + newcomers))
    assert order.launched == arrived


async def test_a_newcomer_never_overtakes_a_woken_waiter():
    # With a cap of 1: X and Y parked, a slot frees, and a newcomer N
    # arrives before the woken X resumes. X, Y, N launch in that order.
    import opsched
    from tests.sched_helpers import Gate

    rng = np.random.default_rng(4)
    blocker, queued, x_call, y_call, n_call = (small_glu(rng) for _ in range(5))
    order = LaunchOrder([x_call[1], y_call[1], n_call[1], queued[1]])
    gate = Gate(hold=blocker[1])

    def hooks(requests):
        gate(requests)
        return order(requests)

    async with opsched.open_scheduler(
        device="cpu",
        streams=1,
        inline_max_bytes=0,
        max_queued_requests=1,
        max_batch_requests=1,
    ) as sched:
        sched.device.inject_faults(hooks)
        first = sched.glu_backward_nowait(*blocker)
        await settle(lambda: sched.statistics().running == 1)
        async with anyio.create_task_group() as tg:
            scope = anyio.CancelScope()

            async def queued_waiter():
                with scope:
                    await sched.glu_backward(*queued)

            tg.start_soon(queued_waiter)
            await settle(lambda: sched.statistics().queued == 1)
            tg.start_soon(sched.glu_backward, *x_call)
            await settle(lambda: sched.statistics().backpressure_waits == 1)
            tg.start_soon(sched.glu_backward, *y_call)
            await settle(lambda: sched.statistics().backpressure_waits == 2)
            scope.cancel()  # the queued request is withdrawn: its slot wakes X
            tg.start_soon(sched.glu_backward, *n_call)  # N arrives in the same turn
            await settle(lambda: sched.statistics().cancelled == 1)
            gate.open()
        await first
    assert order.launched == [0, 1, 2]  # X, Y, N


@pytest.mark.parametrize("device", THREADED_DEVICES)
async def test_a_deadline_bounds_how_long_an_idle_scheduler_holds_a_request(device):
    # With half a second of max_delay_us, a lone request whose timeout is shorter than the
    # delay launches without waiting out the delay for company: held longer, it would expire.
    import opsched

    rng = np.random.default_rng(5)
    g, x = small_glu(rng)
    async with opsched.open_scheduler(device=device, max_delay_us=500_000) as sched:
        with anyio.fail_after(5):  # a failure, not a hang, if it waited out the delay
            got = await sched.glu_backward(g, x, timeout=0.1)
    assert_result(device, got, solo_glu(g, x, -1))
    assert sched.statistics().expired == 0


async def test_a_scheduler_entered_in_one_task_may_be_left_in_another():
    import opsched

    rng = np.random.default_rng(6)
    g, x = small_glu(rng)
    block = opsched.open_scheduler()
    sched = await block.__aenter__()
    assert await opsched.current_scheduler() is sched
    pending = sched.glu_backward_nowait(g, x)

    async def leave():
        await block.__aexit__(None, None, None)

    async with anyio.create_task_group() as tg:
        tg.start_soon(leave)
    assert sched.state.value == "closed"
    assert_result("cpu", await pending, solo_glu(g, x, -1))  # drained on the way out
    assert await opsched.current_scheduler() is not sched  # this task's calls moved on


@pytest.mark.parametrize("backend", ["asyncio", "trio"])
def test_an_abandoned_scheduler_block_is_closed_quietly_when_its_loop_ends(backend):
    import subprocess
    import sys

    code = f"""
import anyio, numpy as np, opsched

async def main():
    block = opsched.open_scheduler()
    sched = await block.__aenter__()  # never left
    await sched.glu_backward(np.ones((2, 4), np.float32), np.ones((2, 8), np.float32))

anyio.run(main, backend={backend!r})
print("done")
"""
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=110, check=False
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == "done\n" and proc.stderr == ""


@pytest.mark.parametrize("device", THREADED_DEVICES)
async def test_a_lost_device_refuses_new_requests_and_fails_the_queued_with_its_cause(device):
    import opsched

    rng = np.random.default_rng(7)
    blocker = small_glu(rng)
    lost = RuntimeError("CUDA error: an illegal memory access was encountered")
    async with held_stream(device, blocker) as (sched, gate, first):
        queued = sched.glu_backward_nowait(*small_glu(rng))
        assert await anyio.to_thread.run_sync(gate.entered.wait, 10)  # the launch started
        sched.device.lost = lost  # what an accelerator's sticky fault sets
        with pytest.raises(opsched.SchedulerClosedError, match="was lost to RuntimeError: CUDA"):
            await sched.glu_backward(*small_glu(rng))
        gate.open()
        await first  # it was running: it finishes
        with pytest.raises(opsched.SchedulerClosedError) as caught:
            await queued
        assert caught.value.__cause__ is lost
        sched.device.lost = None  # (the cpu device is fine: let the block close)
