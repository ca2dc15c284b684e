"""Promises of the scheduler that concurrent callers rely on: a request's outcome belongs to
the request, not to one of its waiters; backpressure is first come, first served; a
deadline bounds how long a request is held for company; a scheduler may be left from
another task."""

from __future__ import annotations

import anyio
import numpy as np
import pytest

from opsched import RequestState, RequestWithdrawnError
from tests.sched_helpers import THREADED_DEVICES, assert_result, held_stream, settle, solo_glu

pytestmark = pytest.mark.anyio  # every test on asyncio and on trio (conftest)

F32 = np.float32


def small_glu(rng, rows=4, cols=8):
    x = rng.standard_normal((rows, cols)).astype(F32)
    return rng.standard_normal((rows, cols // 2)).astype(F32), x


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
