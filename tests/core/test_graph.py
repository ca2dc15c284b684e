"""Task graphs: build-time checks, execution, chaining on streams, failures, cancellation."""

from __future__ import annotations

import asyncio
import gc
import threading
import time
import weakref

import anyio
import numpy as np
import pytest
import structlog

import opsched
import opsched.sync
from opsched import (
    DeadlineExceededError,
    Graph,
    GraphExecutionError,
    InjectedFault,
    InnerError,
    ParamInvalidError,
    ParamNullptrError,
    RuntimeLaunchError,
    UpstreamFailedError,
)
from opsched.ops import Operator
from tests.helpers import assert_same_bits, gn_inputs, rand
from tests.sched_helpers import (
    DEVICES,
    THREADED_DEVICES,
    FailWhen,
    Gate,
    assert_result,
    beside_a_ready_task,
    gather,
    settle,
    solo_glu,
    solo_gn,
)

F32 = np.dtype(np.float32)


def chain(rng, length=8, n=2, g=4, m=8):
    """An alternating chain: group-norm grad, then GLU backward on its output, repeated.

    Returns the graph, its nodes, and a function computing the same chain one call at a
    time through the two-phase API (the oracle).
    """
    graph = Graph()
    nodes = []
    steps = []
    prev = None
    for i in range(length):
        if i % 2 == 0:
            shape = (n, g, m) if prev is None else prev.shape
            x, dy, gamma, mean, rstd = gn_inputs(rng, shape, F32)
            dy_arg = dy if prev is None else prev
            node = graph.group_norm_grad(x, dy_arg, gamma, mean, rstd, name=f"gn{i}")
            steps.append(("gn", (x, dy, gamma, mean, rstd)))
        else:
            gate = rand(rng, (*prev.shape[:-1], 2 * prev.shape[-1]), F32)
            node = graph.glu_backward(prev, gate, dim=-1, name=f"glu{i}")
            steps.append(("glu", (gate,)))
        nodes.append(node)
        prev = node

    def oracle():
        values = []
        for i, (kind, args) in enumerate(steps):
            if kind == "gn":
                x, dy, gamma, mean, rstd = args
                dy = dy if i == 0 else values[-1]
                values.append(solo_gn(x, dy, gamma, mean, rstd))
            else:
                values.append(solo_glu(values[-1], args[0], -1))
        return values

    return graph, nodes, oracle


# --------------------------------------------------------------------------- building


def test_bad_node_raises_its_status_naming_the_node():
    rng = np.random.default_rng(0)
    g = Graph()
    x, dy, gamma, mean, rstd = gn_inputs(rng, (2, 4, 8), F32)
    a = g.group_norm_grad(x, dy, gamma, mean, rstd, name="norm")
    assert (a.shape, a.dtype) == ((2, 4, 8), F32)
    with pytest.raises(ParamInvalidError, match="node 'gate': GluBackward: grad_out.shape") as info:
        g.glu_backward(a, rand(rng, (2, 4, 8), F32), dim=-1, name="gate")  # needs (2, 4, 4)
    assert info.value.status == 161002
    with pytest.raises(ParamNullptrError, match="node 'GroupNormalizationGrad#1'"):
        g.group_norm_grad(a, None, gamma, mean, rstd)
    assert len(g.nodes) == 1  # nothing was added


def test_nodes_of_another_graph_and_cycles_are_refused():
    rng = np.random.default_rng(1)
    g1, g2 = Graph(), Graph()
    args = gn_inputs(rng, (1, 2, 4), F32)
    a = g1.group_norm_grad(*args)
    with pytest.raises(ValueError, match="belongs to another graph"):
        g2.glu_backward(rand(rng, (1, 2, 2), F32), a, dim=-1)
    b = g1.group_norm_grad(args[0], a, *args[2:])
    c = g1.group_norm_grad(*args)
    g1.after(c, b)  # c waits for b: fine
    with pytest.raises(ValueError, match="would close a cycle"):
        g1.after(a, b)  # b depends on a
    with pytest.raises(ValueError, match="would close a cycle"):
        g1.after(b, c)  # c waits for b


def test_placeholder_shapes_flow_through():
    g = Graph()
    x = g.input((2, 3, 8), np.float32, name="x")
    stats = g.input((2, 3), np.float32, name="stats")
    a = g.group_norm_grad(x, x, x, stats, stats)
    b = g.glu_backward(a, g.input((2, 3, 16), np.float32), dim=2)
    assert b.shape == (2, 3, 16) and b.dtype == F32


# -------------------------------------------------------------------------- execution


@pytest.mark.anyio
@pytest.mark.parametrize("device", DEVICES)
async def test_chain_bit_identical_to_calls_one_by_one(device):
    rng = np.random.default_rng(2)
    graph, nodes, oracle = chain(rng)
    async with opsched.open_scheduler(device=device, streams=2) as sched:
        outs = await sched.run(graph, outputs=nodes)
        stats = sched.statistics()
    for got, want in zip(outs, oracle(), strict=True):
        assert_result(device, got, want)
    assert stats.graph_runs == 1 and stats.graph_nodes == 8 and stats.completed == 8


@pytest.mark.anyio
async def test_a_finished_run_leaves_no_reference_cycles_for_the_collector():
    # A run links producers and consumers both ways, and each node run to its request:
    # once the run returns, those links are cut, so reference counting frees it all.
    rng = np.random.default_rng(21)
    graph, nodes, _ = chain(rng, length=4)
    async with opsched.open_scheduler(device="reference") as sched:
        await sched.run(graph, outputs=nodes[-1:])  # warm-up: caches, pools
        gc.collect()
        gc.disable()
        try:
            await sched.run(graph, outputs=nodes[-1:])
            gc.set_debug(gc.DEBUG_SAVEALL)
            gc.collect()
            left = [type(o).__name__ for o in gc.garbage]
        finally:
            gc.set_debug(0)
            gc.garbage.clear()
            gc.enable()
    assert "GraphRun" not in left and "_NodeRun" not in left and "Request" not in left


@pytest.mark.anyio
async def test_a_finished_nodes_request_is_freed_while_its_run_goes_on():
    # A run that kept every node's request (its tensors, its waits) until it returned made
    # the young-generation collections come 40 times per 10,240 nodes instead of once.
    rng = np.random.default_rng(22)
    graph, nodes, _ = chain(rng, length=4)
    seen: list[weakref.ref] = []
    alive_at_launch: list[int] = []

    def watch(requests):  # called with each launch's requests (a fault hook that never fails)
        alive_at_launch.append(sum(ref() is not None for ref in seen))
        seen.extend(weakref.ref(r) for r in requests)
        return False

    async with opsched.open_scheduler(device="reference") as sched:
        sched.device.inject_faults(watch)
        await sched.run(graph, outputs=nodes[-1:])
    # each node launches after its producer finished: by then that request is gone
    assert len(alive_at_launch) == 4 and alive_at_launch == [0, 0, 0, 0]


@pytest.mark.anyio
@pytest.mark.parametrize("device", DEVICES)
async def test_diamond_fan_out_fan_in(device):
    rng = np.random.default_rng(3)
    x, dy, gamma, mean, rstd = gn_inputs(rng, (2, 3, 8), F32)
    g = Graph()
    top = g.group_norm_grad(x, dy, gamma, mean, rstd, name="top")
    gate1, gate2 = rand(rng, (2, 3, 16), F32), rand(rng, (2, 3, 16), F32)
    left = g.glu_backward(top, gate1, dim=-1, name="left")  # fan-out: two consumers of top
    right = g.glu_backward(top, gate2, dim=-1, name="right")
    x2, _, gamma2, mean2, rstd2 = gn_inputs(rng, (2, 3, 16), F32)
    bottom = g.group_norm_grad(left, right, gamma2, mean2, rstd2, name="bottom")  # fan-in
    async with opsched.open_scheduler(device=device, streams=2) as sched:
        (out,) = await beside_a_ready_task(sched.run(g, outputs=[bottom]))  # (queued nodes)
        stats = sched.statistics()
    t = solo_gn(x, dy, gamma, mean, rstd)
    want = solo_gn(solo_glu(t, gate1, -1), solo_glu(t, gate2, -1), gamma2, mean2, rstd2)
    assert_result(device, out, want)
    assert stats.pool.in_use == 0  # launch workspaces went back to the pool
    # ...which holds them on the numpy devices (torch's allocator has them on torch:cpu)
    assert stats.pool.allocated > 0 or device.startswith("torch")


@pytest.mark.anyio
@pytest.mark.parametrize("device", DEVICES)
async def test_a_node_reading_one_producer_twice_runs_once_it_is_launched(device):
    """One producer read through two arguments: the consumer runs once it is launched,
    again in a second run of the same plan, and at once when the producer is fed (a fed
    node is nothing to wait for: counted as one, the run would never end)."""
    rng = np.random.default_rng(13)
    x, dy, gamma, mean, rstd = gn_inputs(rng, (2, 4, 8), F32)
    _, _, gamma2, mean2, rstd2 = gn_inputs(rng, (2, 4, 8), F32)
    g = Graph()
    top = g.group_norm_grad(x, dy, gamma, mean, rstd, name="top")
    twice = g.group_norm_grad(top, top, gamma2, mean2, rstd2, name="twice")
    t = solo_gn(x, dy, gamma, mean, rstd)
    want = solo_gn(t, t, gamma2, mean2, rstd2)
    async with opsched.open_scheduler(device=device, streams=2) as sched:
        for _ in range(2):
            (out,) = await sched.run(g, outputs=[twice])
            assert_result(device, out, want)
        fed = rand(rng, (2, 4, 8), F32)
        (out,) = await sched.run(g, outputs=[twice], inputs={top: fed})
        assert_result(device, out, solo_gn(fed, fed, gamma2, mean2, rstd2))
        stats = sched.statistics()
    assert stats.graph_nodes == 5  # top twice, twice three times
    assert stats.pool.in_use == 0


@pytest.mark.anyio
async def test_only_needed_nodes_run_and_fed_nodes_are_not_computed():
    rng = np.random.default_rng(4)
    graph, nodes, oracle = chain(rng, length=4)
    want = oracle()
    async with opsched.open_scheduler() as sched:
        (second,) = await sched.run(graph, outputs=[nodes[1]])
        assert sched.statistics().graph_nodes == 2  # the later nodes were not needed
        fed = np.ascontiguousarray(want[1])
        (last,) = await sched.run(graph, outputs=[nodes[3]], inputs={nodes[1]: fed})
        assert sched.statistics().graph_nodes == 4  # nodes 2 and 3 only
    assert_same_bits(second, want[1])
    assert_same_bits(last, want[3])


@pytest.mark.anyio
async def test_rerun_with_new_placeholder_inputs_reuses_executors():
    rng = np.random.default_rng(5)
    g = Graph()
    x = g.input((2, 4, 8), np.float32, name="x")
    dy = g.input((2, 4, 8), np.float32, name="dy")
    gate = g.input((2, 4, 16), np.float32, name="gate")
    _, _, gamma, mean, rstd = gn_inputs(rng, (2, 4, 8), F32)
    a = g.group_norm_grad(x, dy, gamma, mean, rstd)
    b = g.glu_backward(a, gate, dim=-1)
    # launched on the stream (not inline: an idle scheduler would run each node at submit,
    # without the dispatcher's executors)
    async with opsched.open_scheduler(streams=1, inline_max_bytes=0) as sched:
        for i in range(4):
            feeds = {
                x: rand(rng, (2, 4, 8), F32),
                dy: rand(rng, (2, 4, 8), F32),
                gate: rand(rng, (2, 4, 16), F32),
            }
            (out,) = await sched.run(g, outputs=[b], inputs=feeds)
            t = solo_gn(feeds[x], feeds[dy], gamma, mean, rstd)
            assert_same_bits(out, solo_glu(t, feeds[gate], -1))
            if i == 0:
                first = sched.statistics().executor_cache
        last = sched.statistics().executor_cache
    assert last.misses == first.misses  # later runs planned nothing new
    assert last.hits > first.hits


@pytest.mark.anyio
async def test_input_errors():
    rng = np.random.default_rng(6)
    g = Graph()
    x = g.input((1, 2, 4), np.float32, name="x")
    stats = rand(rng, (1, 2), F32)
    a = g.group_norm_grad(x, x, x, stats, stats)
    async with opsched.open_scheduler() as sched:
        with pytest.raises(ParamNullptrError, match="placeholder 'x'.*no array"):
            await sched.run(g, outputs=[a])
        with pytest.raises(ParamInvalidError, match=r"inputs\['x'\] has shape \(1, 2, 5\)"):
            await sched.run(g, outputs=[a], inputs={x: np.zeros((1, 2, 5), F32)})
        with pytest.raises(ValueError, match="not a node of this graph"):
            await sched.run(g, outputs=[Graph().input((1,), np.float32)])
        with pytest.raises(ValueError, match="at least one node"):
            await sched.run(g, outputs=[])


@pytest.mark.anyio
async def test_graphs_fuse_with_each_other_and_with_single_calls():
    rng = np.random.default_rng(7)
    graph, nodes, oracle = chain(rng, length=4)
    want = oracle()
    single = (rand(rng, (4, 4), F32), rand(rng, (4, 8), F32))
    async with opsched.open_scheduler(streams=1) as sched:
        results = await gather(
            *(sched.run(graph, outputs=[nodes[-1]]) for _ in range(20)),
            sched.glu_backward(*single),
        )
        stats = sched.statistics()
    for (out,) in results[:-1]:
        assert_same_bits(out, want[-1])
    assert_same_bits(results[-1], solo_glu(*single, -1))
    # one node of every run in one launch (but the first run's, on trio: the first task of
    # a batch of new tasks sees an idle loop, as trio counts only the next batch's tasks as
    # runnable, and a request on an idle scheduler runs at submit, alone)
    assert stats.requests_per_launch_max >= 19
    assert stats.launches < 20 * 4


# ------------------------------------------------------------- chaining on the device


@pytest.mark.anyio
async def test_dependent_launches_on_another_stream_while_its_producer_runs():
    rng = np.random.default_rng(8)
    graph, nodes, oracle = chain(rng, length=2)
    first_x = graph.nodes[0].args["x"]
    gate = Gate(hold=first_x)
    async with opsched.open_scheduler(streams=2, inline_max_bytes=0) as sched:
        sched.device.inject_faults(gate)
        async with anyio.create_task_group() as tg:
            results = []

            async def go():
                results.append(await sched.run(graph, outputs=nodes))

            tg.start_soon(go)
            await settle(lambda: sched.statistics().launches == 2)
            # the producer is held on stream 0, yet its consumer is already launched on
            # stream 1, waiting on the producer's event: no trip back to Python between them
            assert sched.statistics().launches == 2
            assert not gate.opened.is_set()
            gate.open()
    for got, want in zip(results[0], oracle(), strict=True):
        assert_same_bits(got, want)


@pytest.mark.anyio
async def test_a_producer_whose_event_cannot_be_recorded_still_feeds_its_consumers(
    monkeypatch, caplog, anyio_backend
):
    # Recording the event a consumer's launch would wait on can raise (a device error
    # surfacing there): the producer still runs, its consumers are queued once it has
    # finished (nothing on the device could order them after it), the run completes with
    # the same bits, and the error is reported (asyncio: its exception handler; trio:
    # the standard library's logging).
    from opsched.devices.streams import ThreadStream

    rng = np.random.default_rng(40)
    graph, nodes, oracle = chain(rng, length=4)
    record = ThreadStream.record_event
    refused: list[int] = []

    def refuse_once(self):
        if not refused:
            refused.append(self.index)
            raise RuntimeError("event lost")
        return record(self)

    monkeypatch.setattr(ThreadStream, "record_event", refuse_once)
    reported: list[BaseException] = []
    if anyio_backend == "asyncio":
        loop = asyncio.get_running_loop()
        loop.set_exception_handler(lambda _, context: reported.append(context["exception"]))
    with caplog.at_level("ERROR", logger="opsched"):
        async with opsched.open_scheduler(streams=2, inline_max_bytes=0) as sched:
            got = await sched.run(graph, outputs=nodes)
    if anyio_backend == "asyncio":
        loop.set_exception_handler(None)
    else:
        reported = [r.exc_info[1] for r in caplog.records if r.exc_info]
    assert refused and [str(e) for e in reported] == ["event lost"]
    for result, want in zip(got, oracle(), strict=True):
        assert_same_bits(result, want)
    stats = sched.statistics()
    assert stats.completed == len(nodes) and stats.failed == 0


@pytest.mark.anyio
@pytest.mark.parametrize("inline_max_bytes", [0, 4 << 20])  # on a stream, inline
async def test_a_consumer_that_cannot_be_submitted_fails_with_its_downstream(
    monkeypatch, inline_max_bytes
):
    # A consumer is submitted when its producer is launched, from the dispatcher: when
    # that raises (no memory for its output, say), the consumer fails with InnerError and
    # what depends on it as upstream-failed; the run ends, the scheduler goes on.
    from opsched.devices.host import HostDevice

    rng = np.random.default_rng(41)
    graph, nodes, oracle = chain(rng, length=4)
    empty = HostDevice.empty  # (intermediates this small are new arrays, not pooled)
    calls: list[tuple[int, ...]] = []

    def no_memory_the_second_time(self, shape, dtype):
        calls.append(shape)
        if len(calls) == 2:  # the first consumer's output (the first is the head's)
            raise MemoryError("no memory for an intermediate")
        return empty(self, shape, dtype)

    monkeypatch.setattr(HostDevice, "empty", no_memory_the_second_time)
    async with opsched.open_scheduler(streams=2, inline_max_bytes=inline_max_bytes) as sched:
        with pytest.raises(GraphExecutionError) as info:
            await sched.run(graph, outputs=[nodes[-1]])
        monkeypatch.undo()
        got = await sched.run(graph, outputs=nodes)
    failed = info.value.failed
    assert list(failed) == ["glu1", "gn2", "glu3"]
    assert isinstance(failed["glu1"], InnerError) and "submitting node 'glu1'" in str(
        failed["glu1"]
    )
    assert isinstance(failed["glu1"].__cause__, MemoryError)
    assert all(isinstance(failed[n], UpstreamFailedError) for n in ("gn2", "glu3"))
    for result, want in zip(got, oracle(), strict=True):
        assert_same_bits(result, want)
    stats = sched.statistics()
    assert stats.submitted == stats.completed + stats.failed + stats.cancelled + stats.expired


@pytest.mark.anyio
async def test_an_intermediate_that_cannot_be_released_strands_no_request(
    monkeypatch, caplog, anyio_backend
):
    # A pooled intermediate goes back to the device when its last consumer finishes:
    # inside that request's finish, in the middle of its launch's completion. A device
    # whose release raises (after taking the block back) must not leave the launch's other
    # requests without an outcome: two chains whose consumers share one launch, and the
    # error is reported (asyncio: its exception handler; trio: the standard logging).
    from opsched.devices.host import HostDevice

    rng = np.random.default_rng(44)
    release = HostDevice.release
    reported: list[tuple[str, BaseException]] = []

    def release_then_raise(self, token):
        release(self, token)
        raise RuntimeError("release failed")

    chains = []
    for _ in range(2):  # 128 KiB intermediates: pooled blocks
        g, x, x2 = rand(rng, (64, 256), F32), rand(rng, (64, 512), F32), rand(rng, (64, 1024), F32)
        graph = opsched.Graph()
        last = graph.glu_backward(graph.glu_backward(g, x, dim=-1), x2, dim=-1)
        chains.append((graph, last, solo_glu(solo_glu(g, x, -1), x2, -1)))
    if anyio_backend == "asyncio":
        loop = asyncio.get_running_loop()
        loop.set_exception_handler(
            lambda _, context: reported.append((context["message"], context["exception"]))
        )
    monkeypatch.setattr(HostDevice, "release", release_then_raise)
    with caplog.at_level("ERROR", logger="opsched"):
        async with opsched.open_scheduler(streams=1, inline_max_bytes=0) as sched:
            got = await gather(*(sched.run(graph, outputs=[last]) for graph, last, _ in chains))
            stats = sched.statistics()
            assert stats.running == 0 and stats.pool.in_use == 0
    if anyio_backend == "asyncio":
        loop.set_exception_handler(None)
    else:
        reported = [(r.getMessage(), r.exc_info[1]) for r in caplog.records if r.exc_info]
    for (result,), (_, _, want) in zip(got, chains, strict=True):
        assert_same_bits(result, want)
    assert reported and all(str(e) == "release failed" for _, e in reported)
    assert "opsched: releasing a graph intermediate failed" in {m for m, _ in reported}


@pytest.mark.anyio
async def test_a_node_the_device_cannot_check_fails_and_ends(monkeypatch):
    # A node is checked against the workspace cap as it is submitted (recorded and counted
    # already): when the device raises there instead of answering, the node fails with
    # InnerError and its downstream as upstream-failed; the request ends, and the block of
    # its producer's output comes back.
    from opsched.devices.host import HostDevice

    rng = np.random.default_rng(45)
    g, x, x2 = rand(rng, (64, 256), F32), rand(rng, (64, 512), F32), rand(rng, (64, 1024), F32)
    graph = opsched.Graph()
    first = graph.glu_backward(g, x, dim=-1, name="first")
    last = graph.glu_backward(first, x2, dim=-1, name="last")
    check_fits = HostDevice.check_fits
    calls: list[int] = []

    def refuse_the_second(self, *args):
        calls.append(1)
        if len(calls) == 2:  # the consumer's, when its producer is launched
            raise RuntimeError("device lost")
        return check_fits(self, *args)

    monkeypatch.setattr(HostDevice, "check_fits", refuse_the_second)
    async with opsched.open_scheduler(streams=2, inline_max_bytes=0) as sched:
        with pytest.raises(GraphExecutionError) as info:
            await sched.run(graph, outputs=[last])
        stats = sched.statistics()
        assert stats.running == 0 and stats.queued == 0 and stats.pool.in_use == 0
    failed = info.value.failed
    assert list(failed) == ["last"] and isinstance(failed["last"], InnerError)
    assert "checking node 'last'" in str(failed["last"])
    assert isinstance(failed["last"].__cause__, RuntimeError)
    assert stats.submitted == stats.completed + stats.failed == 2


@pytest.mark.anyio
@pytest.mark.parametrize("here", [False, True], ids=["queued", "here"])
async def test_a_run_whose_start_fails_leaves_nothing_queued_or_held(monkeypatch, here):
    # A run submits its ready nodes when it starts; when a later one cannot be submitted
    # (no memory for its output), the run raises that to its caller. The nodes it already
    # queued are withdrawn, and no pooled intermediate stays held for a consumer that will
    # never run. ``here``: on an idle scheduler the ready nodes are to run at submit, in
    # the loop thread, once the run has started.
    from opsched.devices.host import POOLED_INTERMEDIATE_BYTES, HostDevice

    rng = np.random.default_rng(43)
    rows, half = 64, 256  # intermediates of 128 and 256 KiB: pooled blocks
    assert rows * 2 * half * 4 >= POOLED_INTERMEDIATE_BYTES
    graph = opsched.Graph()
    g_a, x_a = rand(rng, (rows, half), F32), rand(rng, (rows, 2 * half), F32)
    g_b, x_b = rand(rng, (rows, 2 * half), F32), rand(rng, (rows, 4 * half), F32)
    a = graph.glu_backward(g_a, x_a, dim=-1)
    b = graph.glu_backward(g_b, x_b, dim=-1)
    c = graph.glu_backward(a, b, dim=-1)  # waits for both roots
    intermediate = HostDevice.intermediate
    calls: list[tuple[int, ...]] = []

    def no_memory_the_second_time(self, shape, dtype):
        calls.append(shape)
        if len(calls) == 2:  # the second root's output, at the run's start
            raise MemoryError("no memory for an intermediate")
        return intermediate(self, shape, dtype)

    monkeypatch.setattr(HostDevice, "intermediate", no_memory_the_second_time)
    inline = 1 << 20 if here else 0
    async with opsched.open_scheduler(streams=2, inline_max_bytes=inline) as sched:
        with pytest.raises(MemoryError):
            await sched.run(graph, outputs=[c])
        monkeypatch.undo()
        stats = sched.statistics()  # at once: nothing of the run is left to finish
        assert stats.queued == 0 and stats.running == 0 and stats.pool.in_use == 0
        assert stats.submitted == stats.cancelled == 1  # its first root, withdrawn
        (got,) = await sched.run(graph, outputs=[c])
    want = solo_glu(solo_glu(g_a, x_a, -1), solo_glu(g_b, x_b, -1), -1)
    assert_same_bits(got, want)
    stats = sched.statistics()
    assert stats.submitted == stats.completed + stats.failed + stats.cancelled + stats.expired


@pytest.mark.anyio
async def test_a_consumer_launched_before_its_producer_failed_fails_with_it():
    # The consumer is already launched (on the other stream, waiting on the producer's
    # event) when the producer's launch fails: the consumer's launch then runs on the
    # producer's unwritten output and returns; the run must still fail it as upstream.
    rng = np.random.default_rng(18)
    graph, nodes, _ = chain(rng, length=2)
    first_x = graph.nodes[0].args["x"]
    gate, fail = Gate(hold=first_x), FailWhen(first_x)
    async with opsched.open_scheduler(streams=2, inline_max_bytes=0) as sched:
        sched.device.inject_faults(lambda requests: gate(requests) or fail(requests))
        async with anyio.create_task_group() as tg:
            caught = []

            async def go():
                with pytest.raises(GraphExecutionError) as info:
                    await sched.run(graph, outputs=nodes)
                caught.append(info.value)

            tg.start_soon(go)
            await settle(lambda: sched.statistics().launches == 2)
            gate.open()
    err = caught[0]
    first, second = (n.name for n in graph.nodes)
    assert set(err.failed) == {first, second}
    assert isinstance(err.failed[first], RuntimeLaunchError)
    assert isinstance(err.failed[second], UpstreamFailedError)
    assert err.failed[second].__cause__ is err.failed[first]


# ---------------------------------------------------------------- failures, cancel


@pytest.mark.anyio
@pytest.mark.parametrize("device", DEVICES)
async def test_failure_fails_downstream_and_independent_branches_complete(device):
    rng = np.random.default_rng(9)
    x, dy, gamma, mean, rstd = gn_inputs(rng, (2, 3, 8), F32)
    bad_gate, ok_gate = rand(rng, (2, 3, 16), F32), rand(rng, (2, 3, 16), F32)
    g = Graph()
    top = g.group_norm_grad(x, dy, gamma, mean, rstd, name="top")
    bad = g.glu_backward(top, bad_gate, dim=-1, name="bad")
    _, _, gamma2, mean2, rstd2 = gn_inputs(rng, (2, 3, 16), F32)
    after_bad = g.group_norm_grad(bad, bad, gamma2, mean2, rstd2, name="after_bad")
    ok = g.glu_backward(top, ok_gate, dim=-1, name="ok")
    async with opsched.open_scheduler(device=device, streams=2) as sched:
        sched.device.inject_faults(FailWhen(bad_gate))
        with pytest.raises(GraphExecutionError) as info:
            await sched.run(g, outputs=[after_bad, ok, top])
        stats = sched.statistics()
    err = info.value
    assert set(err.failed) == {"bad", "after_bad"}
    assert "'bad' (RuntimeLaunchError" in str(err)
    assert isinstance(err.failed["bad"], RuntimeLaunchError)
    assert isinstance(err.failed["bad"].__cause__, InjectedFault)
    assert isinstance(err.failed["after_bad"], UpstreamFailedError)
    assert err.failed["after_bad"].__cause__ is err.failed["bad"]
    assert err.outputs[0] is None
    t = solo_gn(x, dy, gamma, mean, rstd)
    assert_result(device, err.outputs[1], solo_glu(t, ok_gate, -1))
    assert_result(device, err.outputs[2], t)
    assert stats.submitted == stats.completed + stats.failed + stats.cancelled + stats.expired
    assert stats.pool.in_use == 0


@pytest.mark.anyio
@pytest.mark.parametrize("device", THREADED_DEVICES)  # (the reference device never does)
@pytest.mark.usefixtures("runs_at_submit")
async def test_a_run_on_an_idle_scheduler_runs_its_nodes_at_submit_in_order(device):
    # Nothing else to run: each node is its solo launch in the loop thread, a consumer
    # after its producer, none queued; a failed node fails what depends on it unlaunched.
    rng = np.random.default_rng(10)
    x, dy, gamma, mean, rstd = gn_inputs(rng, (2, 3, 8), F32)
    bad_gate, ok_gate = rand(rng, (2, 3, 16), F32), rand(rng, (2, 3, 16), F32)
    _, _, gamma2, mean2, rstd2 = gn_inputs(rng, (2, 3, 16), F32)
    g = Graph()
    top = g.group_norm_grad(x, dy, gamma, mean, rstd, name="top")
    bad = g.glu_backward(top, bad_gate, dim=-1, name="bad")
    after_bad = g.group_norm_grad(bad, bad, gamma2, mean2, rstd2, name="after_bad")
    ok = g.glu_backward(top, ok_gate, dim=-1, name="ok")
    after_ok = g.group_norm_grad(ok, ok, gamma2, mean2, rstd2, name="after_ok")
    async with opsched.open_scheduler(device=device) as sched:
        await anyio.lowlevel.checkpoint()  # the scheduler's service task starts
        (out,) = await sched.run(g, outputs=[after_ok])
        clean = sched.statistics()
        sched.device.inject_faults(FailWhen(bad_gate))
        with pytest.raises(GraphExecutionError) as info:
            await sched.run(g, outputs=[after_bad, after_ok])
        stats = sched.statistics()
    t = solo_gn(x, dy, gamma, mean, rstd)
    u = solo_glu(t, ok_gate, -1)
    assert_result(device, out, solo_gn(u, u, gamma2, mean2, rstd2))
    assert clean.queued_peak == 0 and clean.launches == clean.graph_nodes == 3
    err = info.value
    assert set(err.failed) == {"bad", "after_bad"}
    assert isinstance(err.failed["bad"].__cause__, InjectedFault)
    assert isinstance(err.failed["after_bad"], UpstreamFailedError)
    assert_result(device, err.outputs[1], solo_gn(u, u, gamma2, mean2, rstd2))
    assert stats.queued_peak == 0 and stats.launches - clean.launches == 4  # not after_bad
    assert stats.submitted == stats.completed + stats.failed + stats.cancelled + stats.expired
    assert stats.pool.in_use == 0


@pytest.mark.anyio
@pytest.mark.usefixtures("runs_at_submit")
async def test_a_node_run_at_submit_is_planned_by_its_inputs_alone(monkeypatch):
    # A node's outputs are the device's, made for it at submit (new, C-contiguous,
    # overlapping nothing): its solo launch is planned by its inputs' layout, as a call
    # whose outputs the launch allocates, without asking whether an output overlaps an
    # input. A caller's request of a node's geometry whose output is its own input is
    # still planned by its whole layout, overlap included.
    rng = np.random.default_rng(14)
    graph, nodes, oracle = chain(rng, length=4)
    g, x = rand(rng, nodes[0].shape, F32), rand(rng, nodes[1].shape, F32)
    want = solo_glu(g, x.copy(), -1)
    asked = []
    real = Operator.overlaps_any

    def overlaps_any(self, tensors):
        asked.append(self.name)
        return real(self, tensors)

    monkeypatch.setattr(Operator, "overlaps_any", overlaps_any)
    async with opsched.open_scheduler() as sched:
        await anyio.lowlevel.checkpoint()  # the scheduler's service task starts
        outs = await sched.run(graph, outputs=nodes)
        ran = sched.statistics()
        assert asked == []  # no node asked
        got = await sched.glu_backward(g, x, -1, out=x)
        assert asked == ["GluBackward"]  # the caller's request asked
    assert ran.queued_peak == 0 and ran.launches == ran.graph_nodes == 4  # all at submit
    for out, expected in zip(outs, oracle(), strict=True):
        assert_same_bits(out, expected)
    assert got is x
    assert_same_bits(x, want)


@pytest.mark.anyio
@pytest.mark.parametrize("device", THREADED_DEVICES)
@pytest.mark.usefixtures("runs_at_submit")
async def test_a_node_run_at_submit_past_the_deadline_expires_before_its_consumers_exist(device):
    # A node that would run at submit expires unlaunched once the run's deadline has
    # passed, as in the queue: its consumer is never submitted, so it fails with the run
    # (UpstreamFailedError) and the scheduler counts no failed request.
    rng = np.random.default_rng(13)
    graph, nodes, _ = chain(rng, length=2)
    async with opsched.open_scheduler(device=device) as sched:
        await anyio.lowlevel.checkpoint()  # the scheduler's service task starts
        with pytest.raises(GraphExecutionError) as info:
            await sched.run(graph, outputs=nodes, deadline=time.monotonic() - 1.0)
        stats = sched.statistics()
    failed = info.value.failed
    assert isinstance(failed["gn0"], DeadlineExceededError)
    assert isinstance(failed["glu1"], UpstreamFailedError)
    assert stats.graph_nodes == stats.submitted == stats.expired == 1
    assert stats.failed == stats.launches == stats.queued_peak == 0


@pytest.mark.anyio
async def test_cancelling_a_run_stops_unlaunched_nodes_and_lets_running_ones_finish():
    rng = np.random.default_rng(10)
    graph, nodes, _ = chain(rng, length=6)
    gate = Gate(hold=graph.nodes[0].args["x"])
    async with opsched.open_scheduler(streams=1, inline_max_bytes=0) as sched:
        sched.device.inject_faults(gate)
        with anyio.move_on_after(0.05):  # cancelled while its first node is held running
            await sched.run(graph, outputs=[nodes[-1]])
        gate.open()
        other = (rand(rng, (4, 4), F32), rand(rng, (4, 8), F32))
        assert_same_bits(await sched.glu_backward(*other), solo_glu(*other, -1))
        stats = sched.statistics()
    assert stats.graph_nodes <= 2  # only the held node (and maybe the next) were submitted
    assert stats.submitted == stats.completed + stats.failed + stats.cancelled + stats.expired
    assert stats.pool.in_use == 0


@pytest.mark.anyio
async def test_run_deadline_applies_to_every_node():
    rng = np.random.default_rng(11)
    graph, nodes, _ = chain(rng, length=2)
    blocker = (rand(rng, (4, 4), F32), rand(rng, (4, 8), F32))
    gate = Gate(hold=blocker[1])
    async with opsched.open_scheduler(streams=1, inline_max_bytes=0) as sched:
        sched.device.inject_faults(gate)
        first = sched.glu_backward_nowait(*blocker)
        await anyio.lowlevel.checkpoint()
        with pytest.raises(GraphExecutionError) as info:
            await sched.run(graph, outputs=nodes, timeout=0.02)
        gate.open()
        await first
    failed = info.value.failed
    assert isinstance(failed["gn0"], DeadlineExceededError)
    assert isinstance(failed["glu1"], UpstreamFailedError)


@pytest.mark.anyio
async def test_launch_log_names_graph_nodes():
    rng = np.random.default_rng(12)
    graph, nodes, _ = chain(rng, length=2)
    with structlog.testing.capture_logs() as logs:
        async with opsched.open_scheduler(streams=1) as sched:
            await sched.run(graph, outputs=nodes)
    served = [name for e in logs if e["event"] == "launch" for name in e["nodes"]]
    assert served == ["gn0", "glu1"]


# ------------------------------------------------------------ module level and sync


def test_module_level_run_under_trio_and_sync_run():
    import trio

    rng = np.random.default_rng(13)
    graph, nodes, oracle = chain(rng, length=4)
    want = oracle()
    got = {}

    async def main():
        got["trio"] = await opsched.run(graph, outputs=[nodes[-1]])

    trio.run(main)
    assert_same_bits(got["trio"][0], want[-1])
    before = set(threading.enumerate())  # other tests' default schedulers live on
    with opsched.sync.open_scheduler(streams=2) as sched:
        (out,) = sched.run(graph, outputs=[nodes[-1]])
    assert_same_bits(out, want[-1])
    left = set(threading.enumerate()) - before
    assert not [t for t in left if t.name.startswith("opsched-stream")]


@pytest.mark.anyio
async def test_node_alone_over_the_workspace_cap_fails_its_run_clearly():
    rng = np.random.default_rng(14)
    x, dy, gamma, mean, rstd = gn_inputs(rng, (4, 8, 4096), F32)
    # Every other element of a wider array: the compiled loop reads unit-stride rows, so
    # the launch stages both copies (2 x 128 KiB of workspace, over the 64 KiB cap).
    wide_x, wide_dy = (np.repeat(t, 2, axis=-1) for t in (x, dy))
    g = Graph()
    big = g.group_norm_grad(wide_x[..., ::2], wide_dy[..., ::2], gamma, mean, rstd, name="big")
    after = g.glu_backward(big, rand(rng, (4, 8, 8192), F32), dim=-1, name="after")
    async with opsched.open_scheduler(workspace_limit_bytes=64 << 10) as sched:
        # a node's passed workspace check is remembered for its device; a failed one is
        # asked again, and fails again, at the next run
        for _ in range(2):
            with pytest.raises(GraphExecutionError) as info:
                await sched.run(g, outputs=[after])
            assert isinstance(info.value.failed["big"], ParamInvalidError)
            assert "workspace_limit_bytes=65536" in str(info.value.failed["big"])
            assert isinstance(info.value.failed["after"], UpstreamFailedError)
        assert sched.statistics().failed == 2  # (its consumer never became a request)


@pytest.mark.anyio
async def test_a_node_asks_each_device_it_runs_on_once(monkeypatch):
    # The launch key and the workspace check of a node's geometry are its device's: asked at
    # its first run on a device, remembered for the next runs there, asked again on another.
    from opsched.devices.host import HostDevice

    asked: list[tuple[str, object]] = []
    launch_key, check_fits = HostDevice.launch_key, HostDevice.check_fits

    def counted_key(self, *args):
        asked.append(("key", self))
        return launch_key(self, *args)

    def counted_fits(self, *args):
        asked.append(("fits", self))
        return check_fits(self, *args)

    monkeypatch.setattr(HostDevice, "launch_key", counted_key)
    monkeypatch.setattr(HostDevice, "check_fits", counted_fits)
    rng = np.random.default_rng(16)
    graph, nodes, oracle = chain(rng, length=4)
    expected = oracle()[-1]
    devices = []
    for _ in range(2):
        async with opsched.open_scheduler() as sched:
            devices.append(sched.device)
            for _ in range(3):
                (out,) = await sched.run(graph, outputs=[nodes[-1]])
                assert_same_bits(out, expected)
    per_device = [sorted(kind for kind, d in asked if d is device) for device in devices]
    assert per_device == [["fits"] * 4 + ["key"] * 4] * 2


@pytest.mark.anyio
async def test_nodes_of_one_geometry_share_their_checks_and_device_answers(monkeypatch):
    # Every client's graph of the same shapes reads the same checked geometry: one launch key
    # and workspace check per geometry and device, whichever graph ran first; a geometry
    # lives as long as a node of it.
    from opsched.core.graph import NodeGeometry
    from opsched.devices.host import HostDevice

    asked: list[str] = []
    launch_key = HostDevice.launch_key

    def counted_key(self, *args):
        asked.append("key")
        return launch_key(self, *args)

    monkeypatch.setattr(HostDevice, "launch_key", counted_key)
    # (shapes no other test uses: no other graph alive shares these geometries)
    graphs = [chain(np.random.default_rng(seed), length=4, n=3, g=5, m=6) for seed in (21, 22)]
    (_, first, _), (_, second, _) = graphs
    assert [a.geometry is b.geometry for a, b in zip(first, second, strict=True)] == [True] * 4
    assert len({id(node.geometry) for node in first}) == 4  # each node its own geometry
    rng = np.random.default_rng(23)
    gate = first[1].args["self"]  # (3, 5, 12): the first GLU node's input
    other = Graph().glu_backward(rand(rng, (3, 5, 6), F32), gate, dim=-1)
    assert other.geometry is first[1].geometry  # an array where a node was: one geometry
    other = Graph().glu_backward(rand(rng, (3, 5, 6), F32), rand(rng, (3, 5, 12), F32), dim=2)
    assert other.geometry is not first[1].geometry  # the same axis, as another scalar
    async with opsched.open_scheduler() as sched:
        for graph, nodes, oracle in graphs:
            (out,) = await sched.run(graph, outputs=[nodes[-1]])
            assert_same_bits(out, oracle()[-1])
    assert asked == ["key"] * 4  # asked by the first graph's run only
    probe = weakref.ref(first[0].geometry)
    assert isinstance(probe(), NodeGeometry)
    del graphs, first, second, graph, nodes, oracle, other
    gc.collect()
    assert probe() is None


@pytest.mark.anyio
async def test_graphs_of_one_structure_share_one_run_plan_naming_their_own_inputs():
    # Every client's graph of one structure makes its runs read one plan (by node and
    # placeholder index), while a missing input is still named by its own graph's names.
    rng = np.random.default_rng(25)
    stats = rand(rng, (1, 2), F32)
    graphs = []
    for name in ("x", "y"):
        g = Graph()
        x = g.input((1, 2, 4), np.float32, name=name)
        first = g.group_norm_grad(x, x, x, stats, stats, name=f"gn_{name}")
        last = g.group_norm_grad(x, first, x, stats, stats, name=f"second_{name}")
        graphs.append((g, x, last))
    plans = [g._plan((last.index,), frozenset()) for g, _, last in graphs]
    assert plans[0] is plans[1]
    g, x, last = graphs[1]
    g.group_norm_grad(x, last, x, stats, stats)  # another structure: another plan
    assert g._plan((last.index,), frozenset()) is not plans[0]  # (the same outputs)
    async with opsched.open_scheduler() as sched:
        with pytest.raises(ParamNullptrError, match="placeholder 'y' \\(used by node 'gn_y'\\)"):
            await sched.run(g, outputs=[last])
        value = rand(rng, (1, 2, 4), F32)
        outs = [await sched.run(g, outputs=[last], inputs={x: value}) for g, x, last in graphs]
    assert_same_bits(outs[0], outs[1])
