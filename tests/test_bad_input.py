"""Bad input, whole classes, through every public face: a clear, typed error at submit that
names the argument; nothing queued, nothing hung.

Faces: ``await sched.op``, ``sched.op_nowait``, ``await opsched.op``, the sync facade's
blocking call and ``submit_op``, ``opsched.sync.op``, graphs, the two-phase API.
"""

from __future__ import annotations

import asyncio
import math
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import opsched
import opsched.sync
from opsched import ParamInvalidError, SchedulerClosedError, aclnn
from tests.helpers import assert_same_bits, rand

F32 = np.dtype(np.float32)
ASYNC_FACES = ("await", "nowait", "module")
SYNC_FACES = ("sync blocking", "sync submit", "sync module")


def glu_args(seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    return rand(rng, (4, 16), F32), rand(rng, (4, 32), F32)


async def _async_call(face: str, sched: opsched.Scheduler, *args, **kw):
    if face == "await":
        return await sched.glu_backward(*args, **kw)
    if face == "nowait":
        return sched.glu_backward_nowait(*args, **kw)  # must raise here, at the call
    return await opsched.glu_backward(*args, **kw)  # the enclosing scheduler


def _sync_call(face: str, facade: opsched.sync.SyncScheduler, *args, **kw):
    if face == "sync blocking":
        return facade.glu_backward(*args, **kw)
    if face == "sync submit":
        return facade.submit_glu_backward(*args, **kw)  # must raise here, at the call
    return opsched.sync.glu_backward(*args, **kw)


def refused_async(face: str, error: type[BaseException], match: str, *args, **kw) -> None:
    """Call through ``face``; assert ``error`` at submit and that nothing was queued."""

    async def main():
        async with opsched.open_scheduler(streams=1) as sched:
            g, x = glu_args()
            await sched.glu_backward(g, x)  # warm: the signature caches know this shape
            with pytest.raises(error, match=match):
                await _async_call(face, sched, *args, **kw)
            return sched.statistics()

    stats = asyncio.run(asyncio.wait_for(main(), 30))
    assert (stats.submitted, stats.completed, stats.rejected) == (1, 1, 1)


def refused_sync(face: str, error: type[BaseException], match: str, *args, **kw) -> None:
    with opsched.sync.open_scheduler(streams=1) as facade:
        facade.glu_backward(*glu_args())
        before = facade.statistics()
        with pytest.raises(error, match=match):
            _sync_call(face, facade, *args, **kw)
        after = facade.statistics()
    if face != "sync module":  # that one is the process-wide default scheduler
        assert after.submitted == before.submitted
        assert after.rejected == before.rejected + 1


# ----------------------------------------------------------------- outputs that can't be written


def _read_only_out() -> np.ndarray:
    out = np.empty((4, 32), F32)
    out.flags.writeable = False
    return out


@pytest.mark.parametrize("face", ASYNC_FACES)
def test_a_read_only_out_is_refused_at_submit_async(face):
    refused_async(face, ParamInvalidError, "out is read-only", *glu_args(1), out=_read_only_out())


@pytest.mark.parametrize("face", SYNC_FACES)
def test_a_read_only_out_is_refused_at_submit_sync(face):
    refused_sync(face, ParamInvalidError, "out is read-only", *glu_args(1), out=_read_only_out())


def test_a_read_only_out_is_refused_even_after_its_shape_was_cached():
    async def main():
        async with opsched.open_scheduler(streams=1) as sched:
            g, x = glu_args()
            await sched.glu_backward(g, x, out=np.empty_like(x))  # caches out's signature
            with pytest.raises(ParamInvalidError, match="out is read-only"):
                await sched.glu_backward(g, x, out=_read_only_out())

    asyncio.run(main())


def test_a_read_only_out_is_refused_by_the_two_phase_api_and_executor_bind():
    g, x = glu_args()
    with pytest.raises(ParamInvalidError, match="out is read-only"):
        aclnn.glu_backward_get_workspace_size(g, x, -1, _read_only_out())
    size, ex = aclnn.glu_backward_get_workspace_size(g, x, -1, np.empty_like(x))
    ex.set_repeatable()
    with pytest.raises(TypeError, match="masked array"):
        ex.bind(self=np.ma.masked_array(x))


def test_a_read_only_out_on_torch_cpu_is_a_param_error_not_a_bare_value_error():
    pytest.importorskip("torch")

    async def main():
        async with opsched.open_scheduler(device="torch:cpu", streams=1) as sched:
            with pytest.raises(ParamInvalidError, match="out is read-only"):
                await sched.glu_backward(*glu_args(), out=_read_only_out())
            return sched.statistics()

    stats = asyncio.run(main())
    assert (stats.submitted, stats.completed, stats.rejected) == (0, 0, 1)


# -------------------------------------------------------------------- deadlines and timeouts


BAD_TIMES = [
    ({"timeout": math.nan}, ValueError, "timeout=nan must be a finite number"),
    ({"timeout": math.inf}, ValueError, "timeout=inf must be a finite number"),
    ({"deadline": math.nan}, ValueError, "deadline=nan must be a finite number"),
    ({"deadline": -math.inf}, ValueError, "deadline=-inf must be a finite number"),
    ({"timeout": "1s"}, TypeError, "timeout must be a number of seconds"),
    ({"timeout": -1.0}, ValueError, "timeout=-1.0 must be >= 0"),
]


@pytest.mark.parametrize("face", ASYNC_FACES)
@pytest.mark.parametrize(("kw", "error", "match"), BAD_TIMES)
def test_bad_deadlines_are_refused_at_submit_async(face, kw, error, match):
    refused_async(face, error, match, *glu_args(2), **kw)


@pytest.mark.parametrize("face", SYNC_FACES)
@pytest.mark.parametrize(("kw", "error", "match"), BAD_TIMES[:3])
def test_bad_deadlines_are_refused_at_submit_sync(face, kw, error, match):
    refused_sync(face, error, match, *glu_args(2), **kw)


@pytest.mark.parametrize(("kw", "error", "match"), BAD_TIMES)
def test_bad_deadlines_are_refused_by_graph_runs(kw, error, match):
    g, x = glu_args(3)
    graph = opsched.Graph()
    node = graph.glu_backward(g, x)

    async def main():
        async with opsched.open_scheduler(streams=1) as sched:
            with pytest.raises(error, match=match):
                await sched.run(graph, [node], **kw)
            return sched.statistics()

    assert asyncio.run(main()).graph_runs == 0
    with opsched.sync.open_scheduler(streams=1) as facade, pytest.raises(error, match=match):
        facade.run(graph, [node], **kw)


# ----------------------------------------------------------- array-likes whose meaning we'd drop


ODD_ARRAYS = [
    (lambda x: np.ma.masked_array(x, mask=x > 0), "masked array"),
    (lambda x: x.view(np.recarray), "numpy.ndarray subclass"),
    (lambda x: x.tolist(), "must be a numpy.ndarray, got builtins.list"),
]


@pytest.mark.parametrize("face", ASYNC_FACES)
@pytest.mark.parametrize(("make", "match"), ODD_ARRAYS)
def test_array_kinds_are_refused_at_submit_async(face, make, match):
    g, x = glu_args(4)
    refused_async(face, TypeError, f"self .*{match}|self is a {match}", g, make(x))


@pytest.mark.parametrize("face", SYNC_FACES)
@pytest.mark.parametrize(("make", "match"), ODD_ARRAYS)
def test_array_kinds_are_refused_at_submit_sync(face, make, match):
    g, x = glu_args(4)
    refused_sync(face, TypeError, match, g, make(x))


@pytest.mark.parametrize(("make", "match"), ODD_ARRAYS)
def test_array_kinds_are_refused_by_graphs_and_the_two_phase_api(make, match):
    g, x = glu_args(5)
    with pytest.raises(TypeError, match=match):
        opsched.Graph().glu_backward(g, make(x))
    with pytest.raises(TypeError, match=match):
        aclnn.glu_backward_get_workspace_size(g, make(x), -1, np.empty_like(x))


def test_a_memmap_is_accepted_as_plain_data(tmp_path):
    g, x = glu_args(6)
    mm = np.memmap(tmp_path / "x.bin", dtype=F32, mode="w+", shape=x.shape)
    mm[...] = x
    want = opsched.sync.glu_backward(g, x)
    assert_same_bits(opsched.sync.glu_backward(g, mm).view(np.uint32), want.view(np.uint32))


# ----------------------------------------------------------------- configuration with no bound


@pytest.mark.parametrize(("knob", "value"), [("max_delay_us", 1e12), ("max_delay_us", math.inf)])
def test_an_unbounded_config_value_is_refused_before_anything_runs(knob, value):
    async def main():
        async with opsched.open_scheduler(**{knob: value}):
            pass

    with pytest.raises(ValueError, match=f"{knob}=.* is out of range"):
        asyncio.run(main())
    with pytest.raises(ValueError, match=f"{knob}=.* is out of range"):
        opsched.sync.open_scheduler(**{knob: value}).__enter__()


# ----------------------------------------------------------------------- a closed sync scheduler


def test_every_method_of_a_closed_sync_scheduler_raises_scheduler_closed():
    g, x = glu_args(7)
    graph = opsched.Graph()
    node = graph.glu_backward(g, x)
    with opsched.sync.open_scheduler(streams=1) as facade:
        facade.glu_backward(g, x)
    calls = {
        "glu_backward": lambda: facade.glu_backward(g, x),
        "submit_glu_backward": lambda: facade.submit_glu_backward(g, x),
        "group_norm_grad": lambda: facade.group_norm_grad(*(x[None],) * 3, x[:, :1], x[:, :1]),
        "submit_group_norm_backward": lambda: facade.submit_group_norm_backward(
            x, x, x, x, None, 4, 32, 1, 4
        ),
        "run": lambda: facade.run(graph, [node]),
        "statistics": facade.statistics,
    }
    for name, call in calls.items():
        with pytest.raises(SchedulerClosedError, match="closed"):
            call()
        assert name  # each method raised
    assert facade.scheduler.statistics().completed == 1  # the final counters stay readable


# -------------------------------------------------------------------------------------- fork


FORK_CHILD = textwrap.dedent(
    """
    import multiprocessing, os, sys
    import numpy as np
    import opsched, opsched.sync
    from opsched import SchedulerClosedError

    g = np.ones((4, 16), np.float32)
    x = np.linspace(-1, 1, 128, dtype=np.float32).reshape(4, 32)
    want = opsched.sync.glu_backward(g, x)            # the parent's default scheduler runs
    own_cm = opsched.sync.open_scheduler(streams=1)
    own = own_cm.__enter__()                          # and one of its own

    def child(conn):
        try:
            got = opsched.sync.glu_backward(g, x)       # a fresh default in the child
            ok = got.tobytes() == want.tobytes()
            try:
                own.glu_backward(g, x)                  # inherited: must raise, never hang
                inherited = "no error"
            except SchedulerClosedError as exc:
                inherited = str(exc)
            try:
                own.scheduler.submit_threadsafe(
                    opsched.ops.GLU_BACKWARD, (g, x, -1))
                core = "no error"
            except SchedulerClosedError as exc:
                core = str(exc)
            conn.send((ok, inherited, core))
        except BaseException as exc:
            conn.send((False, repr(exc), ""))

    ctx = multiprocessing.get_context("fork")
    parent_end, child_end = ctx.Pipe()
    p = ctx.Process(target=child, args=(child_end,))
    p.start()
    if not parent_end.poll(60):
        p.kill()
        sys.exit("the child hung")
    ok, inherited, core = parent_end.recv()
    p.join(30)
    assert ok, inherited
    assert "did not survive the fork" in inherited, inherited
    assert "did not survive the fork" in core, core
    assert (opsched.sync.glu_backward(g, x) == want).all()  # the parent is unaffected
    assert (own.glu_backward(g, x) == want).all()
    print("fork ok")
    """
)


def _run_script(script: str) -> str:
    """``script``'s output, run by a new interpreter (a fork there forks nothing of
    pytest's); its failure fails the test."""
    proc = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


def test_a_forked_child_gets_its_own_default_and_an_inherited_scheduler_raises():
    assert "fork ok" in _run_script(FORK_CHILD)


FORK_LOCK_CHILD = textwrap.dedent(
    """
    import os, select, sys
    import numpy as np
    from opsched.core import requests

    # a thread of the parent (here, its only one) holds the futures' module lock at the fork
    with requests._CONDITION_MADE, requests._CLAIMS:
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child: a future settled and read there must not wait for it
            future = requests.new_request_future()
            future.settle(np.ones(2), None)
            os.write(write, b"ok" if future.result(timeout=0).shape == (2,) else b"no")
            os._exit(0)
    ready, _, _ = select.select([read], [], [], 60)
    if not ready:
        os.kill(pid, 9)
        sys.exit("the child hung on the lock held at the fork")
    os.waitpid(pid, 0)
    print(os.read(read, 2).decode())
    """
)


def test_a_forked_child_gives_its_futures_outcomes_whatever_lock_the_parent_held():
    out = _run_script(FORK_LOCK_CHILD)
    assert out.strip() == "ok", out


def test_a_tensor_on_the_numpy_device_names_the_torch_device():
    torch = pytest.importorskip("torch")
    import opsched.sync

    with pytest.raises(TypeError, match=r'grad_out is a torch\.Tensor.*device="torch:cpu"'):
        opsched.sync.glu_backward(torch.ones(2, 4), torch.ones(2, 8))
