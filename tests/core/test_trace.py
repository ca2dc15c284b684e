"""Timeline traces: the file a traced scheduler writes, checked against what it did."""

from __future__ import annotations

import asyncio
import itertools
import json

import numpy as np
import pytest

import opsched
import opsched.sync
from opsched.core.trace import load_trace, summarize
from opsched.devices.host import SOLO_BATCH_MAX
from tests.helpers import gn_inputs, rand

F32 = np.dtype(np.float32)


def _slices(events):
    return [e for e in events if e["ph"] == "X"]


async def _mixed_workload(sched, rng):
    glu = [(rand(rng, (8, 16), F32), rand(rng, (8, 32), F32)) for _ in range(40)]
    gn = [gn_inputs(rng, (2, 4, 16), F32) for _ in range(10)]
    await asyncio.gather(
        *(sched.glu_backward(g, x) for g, x in glu),
        *(sched.group_norm_grad(*args) for args in gn),
    )


@pytest.mark.parametrize("device", ["cpu", "reference"])
def test_one_track_per_stream_and_one_slice_per_launch(tmp_path, device):
    path = tmp_path / "run.json"
    rng = np.random.default_rng(0)

    async def main():
        async with opsched.open_scheduler(
            device=device, streams=3, trace=path, inline_max_bytes=0
        ) as sched:
            await _mixed_workload(sched, rng)
            await _mixed_workload(sched, rng)
        return sched.statistics()

    stats = asyncio.run(main())
    events = load_trace(path)
    tracks = {e["tid"]: e["args"]["name"] for e in events if e["name"] == "thread_name"}
    assert sorted(v for k, v in tracks.items() if k > 0) == ["stream 0", "stream 1", "stream 2"]
    slices = _slices(events)
    assert len(slices) == stats.launches
    for stream in stats.streams:  # each stream's track holds exactly its launches
        assert sum(1 for e in slices if e["tid"] == stream.index + 1) == stream.launches
    assert sum(e["args"]["requests"] for e in slices) == stats.completed == 100
    ops = {e["args"]["operator"] for e in slices}
    assert ops == {"GluBackward", "GroupNormalizationGrad"}
    for e in slices:
        assert e["dur"] > 0 and e["args"]["dtype"] == "FLOAT"
        # a batch of up to SOLO_BATCH_MAX requests runs on their solo plans, not an executor
        solo = 1 < e["args"]["requests"] <= SOLO_BATCH_MAX
        assert (e["args"]["executor cache"] == "solo plans") is solo
        assert solo or e["args"]["executor cache"] in ("hit", "miss")
        assert e["args"]["bytes"] > 0 and e["args"]["queue wait us"] >= 0
    misses = sum(1 for e in slices if e["args"]["executor cache"] == "miss")
    assert misses == stats.executor_cache.misses
    counters = {e["name"] for e in events if e["ph"] == "C"}
    assert counters == {"queued requests", "workspace pool bytes"}
    summary = summarize(events)
    assert summary["launches"] == stats.launches and summary["requests"] == 100


def test_slices_on_one_stream_do_not_overlap(tmp_path):
    path = tmp_path / "run.json"

    async def main():
        async with opsched.open_scheduler(streams=2, trace=path) as sched:
            for _ in range(3):
                await _mixed_workload(sched, np.random.default_rng(1))

    asyncio.run(main())
    by_stream: dict[int, list] = {}
    for e in _slices(load_trace(path)):
        by_stream.setdefault(e["tid"], []).append((e["ts"], e["ts"] + e["dur"]))
    for spans in by_stream.values():
        spans.sort()
        for (_, end), (start, _) in itertools.pairwise(spans):
            assert start >= end - 0.01  # a stream runs one launch at a time


def test_graph_edges_are_flow_arrows_from_producer_to_consumer(tmp_path):
    path = tmp_path / "graph.json"
    rng = np.random.default_rng(2)
    x, dy, gamma, mean, rstd = gn_inputs(rng, (2, 4, 16), F32)
    graph = opsched.Graph()
    gn = graph.group_norm_grad(x, dy, gamma, mean, rstd, name="gn")
    glu = graph.glu_backward(gn, rand(rng, (2, 4, 32), F32), name="glu")

    async def main():
        async with opsched.open_scheduler(streams=2, trace=path, inline_max_bytes=0) as s:
            await s.run(graph, [glu])

    asyncio.run(main())
    events = load_trace(path)
    slices = {e["args"]["graph nodes"][0]: e for e in _slices(events)}
    starts = [e for e in events if e["ph"] == "s"]
    finishes = [e for e in events if e["ph"] == "f"]
    assert len(starts) == len(finishes) == 1 and starts[0]["id"] == finishes[0]["id"]
    producer, consumer = slices["gn"], slices["glu"]
    s, f = starts[0], finishes[0]
    assert s["tid"] == producer["tid"]
    assert producer["ts"] <= s["ts"] <= producer["ts"] + producer["dur"]
    assert f["tid"] == consumer["tid"] and f["ts"] == consumer["ts"] and f["bp"] == "e"


def test_sync_facade_traces_too(tmp_path):
    path = tmp_path / "sync.json"
    rng = np.random.default_rng(3)
    work = [(rand(rng, (4, 8), F32), rand(rng, (4, 16), F32)) for _ in range(50)]
    with opsched.sync.open_scheduler(streams=1, trace=path) as sched:
        for f in [sched.submit_glu_backward(g, x) for g, x in work]:
            f.result()
        launches = sched.statistics().launches
    assert len(_slices(load_trace(path))) == launches


def test_untraced_scheduler_records_nothing(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)

    async def main():
        async with opsched.open_scheduler(streams=1) as sched:
            assert sched._engine.tracer is None
            await _mixed_workload(sched, np.random.default_rng(4))

    asyncio.run(main())
    assert list(tmp_path.iterdir()) == []


def test_trace_into_a_missing_directory_fails_at_open(tmp_path):
    async def main():
        async with opsched.open_scheduler(trace=tmp_path / "nope" / "t.json"):
            pass

    with pytest.raises(FileNotFoundError, match="does not exist"):
        asyncio.run(main())


def test_load_trace_rejects_other_files(tmp_path):
    other = tmp_path / "other.json"
    other.write_text(json.dumps({"traceEvents": []}))
    with pytest.raises(ValueError, match="not written by opsched"):
        load_trace(other)
    broken = tmp_path / "broken.json"
    doc = {
        "traceEvents": [{"ph": "X", "name": "a", "pid": 1}],
        "otherData": {"generator": "opsched"},
    }
    broken.write_text(json.dumps(doc))
    with pytest.raises(ValueError, match=r"event 0 \(X\) lacks \['tid', 'ts', 'dur', 'args'\]"):
        load_trace(broken)


def test_a_long_run_streams_its_events_in_bounded_memory(tmp_path, monkeypatch):
    from opsched.core import trace as _trace

    monkeypatch.setattr(_trace, "FLUSH_EVENTS", 16)
    path = tmp_path / "long.json"
    rng = np.random.default_rng(5)
    seen = []

    async def main():
        async with opsched.open_scheduler(streams=2, trace=path) as sched:
            for _ in range(20):
                await _mixed_workload(sched, rng)
                seen.append(len(sched._engine.tracer._events))
            return sched.statistics()

    stats = asyncio.run(main())
    assert max(seen) <= 16
    assert len(_slices(load_trace(path))) == stats.launches


def test_a_launch_s_queue_wait_is_its_earliest_queued_request_s(tmp_path):
    # Two requests queued at 1 s and 3 s, launched together at 5 s: the launch waited as
    # long as its first request did, 4 s (docs/tracing.md), in the trace and the log event.
    import structlog

    from opsched.core.batching import Batch
    from opsched.core.requests import Request
    from opsched.core.trace import Tracer, log_launch, trace_launch
    from opsched.ops import GLU_BACKWARD

    def queued_at(at):
        x = np.zeros((2, 8), F32)
        tensors = {"grad_out": np.zeros((2, 4), F32), "self": x, "out": np.empty_like(x)}
        return Request(0, at, GLU_BACKWARD, tensors, {"dim": -1}, "k", 8, 160, 0, None)

    batch = Batch([queued_at(3.0), queued_at(1.0)], 0, "k", True, launched_at=5.0)
    with structlog.testing.capture_logs() as logs:
        log_launch(GLU_BACKWARD, batch, ({}, 10.0, 10.5))
    assert logs[0]["queue_wait_s"] == pytest.approx(4.0)
    tracer = Tracer(tmp_path / "run.json", "cpu", 1)
    trace_launch(tracer, GLU_BACKWARD, batch, True, ({}, 10.0, 10.5))
    tracer.write()
    (launch,) = _slices(load_trace(tmp_path / "run.json"))
    assert launch["args"]["queue wait us"] == pytest.approx(4e6)
