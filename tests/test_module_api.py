"""Module-level functions: no set-up under asyncio.run and trio.run, clean endings."""

from __future__ import annotations

import asyncio
import inspect
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import trio

import opsched
from tests.helpers import assert_same_bits, rand
from tests.sched_helpers import solo_glu, solo_gn

F32 = np.dtype(np.float32)


def run_script(body: str) -> subprocess.CompletedProcess[str]:
    """Run ``body`` in a fresh interpreter with warnings as errors."""
    code = "import numpy as np, opsched, threading, asyncio\n" + textwrap.dedent(body)
    return subprocess.run(
        [sys.executable, "-W", "error", "-X", "dev", "-c", code],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def test_plain_asyncio_run_needs_no_setup_and_ends_cleanly():
    proc = run_script(
        """
        async def main():
            x = np.arange(24, dtype=np.float32).reshape(4, 6) / 10
            g = np.ones((4, 3), np.float32)
            outs = await asyncio.gather(*(opsched.glu_backward(g, x) for _ in range(50)))
            dx = await opsched.group_norm_grad(*(np.ones((2, 2, 4), np.float32),) * 3,
                                               np.zeros((2, 2), np.float32),
                                               np.ones((2, 2), np.float32))
            print("ok", float(outs[0][0, 0]), dx.shape)
        asyncio.run(main())
        asyncio.run(main())  # a second loop gets its own default scheduler
        print("threads", [t.name for t in threading.enumerate()])
        """
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.count("ok 0.5") == 2
    assert "threads ['MainThread']" in proc.stdout
    assert "destroyed but it is pending" not in proc.stderr
    # -X dev times every callback; the first call loads its kernel where it launches (on
    # the loop, for a small request): a timing note, not an error
    timing = [line for line in proc.stderr.splitlines() if line.startswith("Executing <")]
    assert all(" took " in line for line in timing)
    assert len(timing) == len(proc.stderr.splitlines())


def test_plain_trio_run_needs_no_setup_and_ends_cleanly():
    proc = run_script(
        """
        import trio
        async def main():
            x = np.arange(24, dtype=np.float32).reshape(4, 6) / 10
            g = np.ones((4, 3), np.float32)
            async with trio.open_nursery() as n:
                for _ in range(20):
                    n.start_soon(opsched.glu_backward, g, x)
            print("ok", float((await opsched.glu_backward(g, x))[0, 0]))
        trio.run(main)
        print("threads", [t.name for t in threading.enumerate()])
        """
    )
    assert proc.returncode == 0, proc.stderr
    assert "ok 0.5" in proc.stdout and "threads ['MainThread']" in proc.stdout
    assert proc.stderr == ""


def test_module_functions_under_trio_match_solo():
    rng = np.random.default_rng(0)
    g, x = rand(rng, (8, 16), F32), rand(rng, (8, 32), F32)
    xs = rand(rng, (2, 4, 10), F32)
    gn = (
        xs,
        rand(rng, xs.shape, F32),
        rand(rng, xs.shape, F32),
        rand(rng, (2, 4), F32),
        (rng.random((2, 4)) + 0.5).astype(F32),
    )
    results = {}

    async def main():
        async with opsched.open_scheduler(device="reference") as sched:
            results["glu"] = await opsched.glu_backward(g, x)  # uses the enclosing block
            results["gn"] = await opsched.group_norm_grad(*gn)
            results["sched"] = await opsched.current_scheduler() is sched

    trio.run(main)
    assert_same_bits(results["glu"], solo_glu(g, x, -1))
    assert_same_bits(results["gn"], solo_gn(*gn))
    assert results["sched"] is True


def test_module_function_outside_a_loop_is_a_clear_error():
    with pytest.raises(RuntimeError, match="running asyncio or trio event loop"):
        opsched.glu_backward(np.ones((1,), F32), np.ones((2,), F32)).send(None)


def test_open_scheduler_rejects_bad_config():
    async def main():
        with pytest.raises(ValueError, match="unknown scheduler setting"):
            async with opsched.open_scheduler(stream=2):
                pass
        with pytest.raises(ValueError, match="unknown device 'gpu'"):
            async with opsched.open_scheduler(device="gpu"):
                pass
        with pytest.raises(TypeError, match="config must be a SchedulerConfig"):
            async with opsched.open_scheduler(42):  # type: ignore[arg-type]
                pass

    trio.run(main)


def test_module_functions_find_the_loops_default_without_a_new_loop_handle(monkeypatch):
    # The default scheduler is found by the running asyncio loop itself: the loop handle
    # (current_loop) is built once, when the default is made, not once a call.
    import opsched._api as api

    built = []
    real = api.current_loop

    def counting():
        built.append(1)
        return real()

    monkeypatch.setattr(api, "current_loop", counting)
    g, x = np.ones((2, 3), F32), np.arange(12, dtype=F32).reshape(2, 6) / 10
    seen = {}

    async def main():
        first = await opsched.current_scheduler()
        made = len(built)  # its handle, and the scheduler's own
        for _ in range(5):
            assert_same_bits(await opsched.glu_backward(g, x), solo_glu(g, x, -1))
        seen["calls"] = len(built) - made
        seen["same"] = await opsched.current_scheduler() is first
        async with opsched.open_scheduler(device="reference") as sched:  # the block's first
            seen["block"] = await opsched.current_scheduler() is sched
            assert_same_bits(await opsched.glu_backward(g, x), solo_glu(g, x, -1))
        seen["after"] = await opsched.current_scheduler() is first
        await first.aclose()  # a closed default is replaced by a new one
        seen["new"] = await opsched.current_scheduler() is not first

    asyncio.run(main())
    assert seen == {"calls": 0, "same": True, "block": True, "after": True, "new": True}


def test_scheduler_methods_return_a_coroutine_that_submits_when_awaited():
    g, x = np.ones((2, 3), F32), np.arange(12, dtype=F32).reshape(2, 6) / 10

    async def main():
        async with opsched.open_scheduler(device="reference") as sched:
            pending = sched.glu_backward(g, x)
            assert inspect.iscoroutine(pending)
            assert sched.statistics().submitted == 0  # nothing queued before the await
            task = asyncio.create_task(pending)
            assert_same_bits(await task, solo_glu(g, x, -1))
            unawaited = sched.group_norm_grad(
                *(np.ones((2, 2, 4), F32),) * 3, np.zeros((2, 2), F32), np.ones((2, 2), F32)
            )
            unawaited.close()  # dropped unawaited: never submitted
            assert sched.statistics().submitted == 1

    asyncio.run(main())


def test_a_graph_run_is_a_coroutine_that_starts_when_awaited():
    g, x = np.ones((2, 3), F32), np.arange(12, dtype=F32).reshape(2, 6) / 10
    graph = opsched.Graph()
    node = graph.glu_backward(g, x, -1)

    async def main():
        async with opsched.open_scheduler(device="reference") as sched:
            pending = sched.run(graph, outputs=[node])
            assert inspect.iscoroutine(pending)
            assert sched.statistics().graph_runs == 0  # nothing started before the await
            (out,) = await pending
            assert_same_bits(out, solo_glu(g, x, -1))
            sched.run(graph, outputs=[node]).close()  # dropped unawaited: never started
            bad = sched.run(graph, outputs=[])  # its arguments are checked at the await
            with pytest.raises(ValueError, match="at least one node"):
                await bad
            stats = sched.statistics()
            assert (stats.graph_runs, stats.submitted) == (1, 1)

    asyncio.run(main())
