"""Timeline traces: what the scheduler did, as a Chrome trace-event / Perfetto JSON file.

``open_scheduler(trace="run.json")`` writes, as the scheduler works (buffered, in bounded
memory; the file is complete once the scheduler closes):

- one track (thread) per stream, a slice per launch: operator, dtype, requests fused, bytes,
  executor cache hit or miss, how long its first request waited in the queue;
- counter tracks: queued requests, and workspace pool bytes in use and held;
- flow arrows from a graph node's producer launch to its consumer launch.

Open the file in https://ui.perfetto.dev (or ``chrome://tracing``). Everything here runs on
the scheduler's loop thread; launch times are the stream's own ``perf_counter`` readings.
With tracing off the scheduler holds ``None`` and pays one ``is not None`` test per launch.

The scheduler's structlog events per launch live here too (:func:`log_launch`): both are
per-launch observability, never per-request work.
"""

from __future__ import annotations

import json
import os
import pathlib
import time
from typing import Any

from opsched._log import INFO, WARNING, enabled, get_logger
from opsched.devices import meta_of
from opsched.ops import DTYPE_NAMES

__all__ = [
    "TRACE_SCHEMA_VERSION",
    "Tracer",
    "load_trace",
    "log_failure",
    "log_launch",
    "log_overflow",
    "summarize",
    "trace_launch",
]

_log = get_logger("opsched.scheduler")

#: Bumped when the layout of the file changes (``otherData.schema``).
TRACE_SCHEMA_VERSION = 1

#: Events buffered before a write to the file.
FLUSH_EVENTS = 4096
#: Graph launches remembered for the arrows to their consumers.
KEPT_SLICES = 65536

_PID = 1
#: Counter and scheduler-wide events sit on this thread id; streams are 1..n.
_SCHEDULER_TID = 0

#: A launch's ``executor cache`` argument: served by a cached executor, planned now, or its
#: requests ran on their solo plans one after another (None: no executor of the cache).
_CACHE_WORDS = {True: "hit", False: "miss", None: "solo plans"}


class Tracer:
    """Writes trace events to a file as they happen, in bounded memory.

    Events are buffered and written in chunks of :data:`FLUSH_EVENTS`; :meth:`write`
    flushes the rest and closes the JSON document. Graph launches are remembered (the last
    :data:`KEPT_SLICES`) to draw the arrows to their consumers, which usually complete right
    after them.

    Args:
        path: where the file is written (opened now: a missing directory fails at once).
        device: the device's name (the process name shown in the viewer).
        streams: how many streams the device has (one track each).
    """

    def __init__(self, path: str | os.PathLike[str], device: str, streams: int) -> None:
        self.path = pathlib.Path(path)
        parent = self.path.parent
        if not parent.is_dir():
            msg = f"trace={str(path)!r}: directory {str(parent)!r} does not exist"
            raise FileNotFoundError(msg)
        self._file: Any = self.path.open("w", encoding="utf-8")
        self._file.write('{"traceEvents":[\n')
        self._first = True
        self._origin = time.perf_counter()
        self._events: list[dict[str, Any]] = [
            _meta("process_name", _SCHEDULER_TID, name=f"opsched scheduler ({device})"),
            _meta("thread_name", _SCHEDULER_TID, name="scheduler"),
            _meta("thread_sort_index", _SCHEDULER_TID, sort_index=-1),
        ]
        for i in range(streams):
            self._events.append(_meta("thread_name", i + 1, name=f"stream {i}"))
            self._events.append(_meta("thread_sort_index", i + 1, sort_index=i))
        #: graph request id -> (tid, start, end) of its launch, for flow arrows
        self._slices: dict[int, tuple[int, float, float]] = {}
        #: arrows whose producer has not completed yet: producer id -> consumer ids
        self._pending: dict[int, list[int]] = {}
        self._arrows: set[tuple[tuple[int, float, float], tuple[int, float, float]]] = set()
        self._flow_ids = 0
        self._last_counters: tuple[int, int, int] | None = None
        self.written = False

    def _us(self, t: float) -> float:
        return round((t - self._origin) * 1e6, 3)

    def launch(
        self,
        stream: int,
        start: float,
        end: float,
        name: str,
        args: dict[str, Any],
        graph_edges: list[tuple[int, list[int]]],
    ) -> None:
        """One launch ran on ``stream`` from ``start`` to ``end`` (``perf_counter`` seconds).

        ``graph_edges``: for each graph-node request it served, ``(request id, producer
        request ids)``.
        """
        tid = stream + 1
        ts = self._us(start)
        dur = max(round(self._us(end) - ts, 3), 0.001)
        self._append(
            {
                "name": name,
                "cat": "launch",
                "ph": "X",
                "pid": _PID,
                "tid": tid,
                "ts": ts,
                "dur": dur,
                "args": args,
            }
        )
        for request_id, producers in graph_edges:
            here = (tid, ts, ts + dur)
            self._slices[request_id] = here
            if len(self._slices) > KEPT_SLICES:
                del self._slices[next(iter(self._slices))]  # the oldest
            for consumer in self._pending.pop(request_id, ()):
                self._arrow(here, self._slices.get(consumer))
            for producer in producers:
                src = self._slices.get(producer)
                if src is not None:
                    self._arrow(src, here)
                elif len(self._pending) < KEPT_SLICES:  # it completes later (or was fed)
                    self._pending.setdefault(producer, []).append(request_id)

    def _arrow(self, src: tuple[int, float, float], dst: tuple[int, float, float] | None) -> None:
        """A flow arrow from the producer's slice to the consumer's (one per pair)."""
        if dst is None or (src, dst) in self._arrows:
            return
        self._arrows.add((src, dst))
        if len(self._arrows) > KEPT_SLICES:
            self._arrows.clear()  # only guards against duplicates among recent launches
        self._flow_ids += 1
        base = {"name": "graph edge", "cat": "graph", "pid": _PID, "id": self._flow_ids}
        # The start binds to the producer's slice (a point inside it), the finish to the
        # consumer slice that encloses its timestamp (``bp: e``).
        self._append({**base, "ph": "s", "tid": src[0], "ts": (src[1] + src[2]) / 2})
        self._append({**base, "ph": "f", "bp": "e", "tid": dst[0], "ts": dst[1]})

    def counters(self, queued: int, pool_in_use: int, pool_held: int) -> None:
        """Sample the counter tracks (skipped when nothing changed since the last sample)."""
        sample = (queued, pool_in_use, pool_held)
        if sample == self._last_counters:
            return
        self._last_counters = sample
        ts = self._us(time.perf_counter())
        self._append(
            {
                "name": "queued requests",
                "ph": "C",
                "pid": _PID,
                "tid": _SCHEDULER_TID,
                "ts": ts,
                "args": {"requests": queued},
            }
        )
        self._append(
            {
                "name": "workspace pool bytes",
                "ph": "C",
                "pid": _PID,
                "tid": _SCHEDULER_TID,
                "ts": ts,
                "args": {"in use": pool_in_use, "held": pool_held},
            }
        )

    def _append(self, event: dict[str, Any]) -> None:
        self._events.append(event)
        if len(self._events) >= FLUSH_EVENTS:
            self._flush()

    def _flush(self) -> None:
        if not self._events:
            return
        text = ",\n".join(json.dumps(e, separators=(",", ":")) for e in self._events)
        self._file.write(text if self._first else ",\n" + text)
        self._first = False
        self._events.clear()

    def write(self) -> None:
        """Flush what is buffered and close the file (once; later calls do nothing)."""
        if self.written:
            return
        self.written = True
        try:
            self._flush()
            other = {"generator": "opsched", "schema": TRACE_SCHEMA_VERSION}
            self._file.write('\n],"displayTimeUnit":"ms","otherData":' + json.dumps(other) + "}\n")
        finally:
            self._file.close()


def trace_launch(
    tracer: Tracer, op: Any, batch: Any, cache_hit: bool | None, result: Any | None
) -> None:
    """Record one finished launch of ``batch`` (``result``: its work's ``(errors, start,
    end)``, None when the launch itself failed)."""
    requests = batch.requests
    end = time.perf_counter()
    start, end = (result[1], result[2]) if result is not None else (end, end)
    first = meta_of(requests[0].tensors[op.tensor_names[0]])
    args: dict[str, Any] = {
        "operator": op.name,
        "dtype": DTYPE_NAMES.get(first.dtype, "?"),
        "requests": len(requests),
        "fused": batch.fused,
        "bytes": batch.nbytes,
        "executor cache": _CACHE_WORDS[cache_hit],
        "queue wait us": round(_queue_wait(batch) * 1e6, 1),
        "failed": sum(1 for r in requests if r.error is not None),
    }
    if batch.part is not None:
        args["split part"] = True
    edges = []
    for r in requests:
        if r.graph is not None:
            run, index = r.graph
            edges.append((r.id, run.producer_ids(index)))
    if edges:
        args["graph nodes"] = [r.graph[0].name(r.graph[1]) for r in requests if r.graph is not None]
    name = f"{op.name} x{len(requests)}" if len(requests) > 1 else op.name
    tracer.launch(batch.stream, start, end, name, args, edges)


def log_launch(op: Any, batch: Any, result: Any | None) -> None:
    """The debug event of one finished launch (nothing unless structlog is configured)."""
    if not enabled():
        return
    requests = batch.requests
    _log.debug(
        "launch",
        op=op.name,
        dtype=str(meta_of(requests[0].tensors[op.tensor_names[0]]).dtype),
        requests=len(requests),
        bytes=batch.nbytes,
        stream=batch.stream,
        fused=batch.fused,
        queue_wait_s=_queue_wait(batch),
        run_s=result[2] - result[1] if result is not None else 0.0,
        failed=sum(1 for r in requests if r.error is not None),
        nodes=[r.graph[0].name(r.graph[1]) for r in requests if r.graph is not None],
    )


def _queue_wait(batch: Any) -> float:
    """How long a launch's earliest-queued request waited in the queue."""
    return batch.launched_at - min(r.enqueued_at for r in batch.requests)


def log_overflow(requests: int) -> None:
    """A launch took workspace beyond the cap (nothing in flight could return any)."""
    if enabled(INFO):
        _log.info("workspace over the cap", requests=requests)


def log_failure(what: str, exc: BaseException, requests: int) -> None:
    """A batch formation or launch start failed its requests."""
    if enabled(WARNING):
        _log.warning(what, error=repr(exc), requests=requests)


def _meta(kind: str, tid: int, **args: Any) -> dict[str, Any]:
    return {"name": kind, "ph": "M", "pid": _PID, "tid": tid, "args": args}


def load_trace(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """Read a trace file opsched wrote and check its layout; return its events.

    Raises:
        ValueError: not an opsched trace, or an event missing a field its phase needs
            (the message names the event).
    """
    with pathlib.Path(path).open(encoding="utf-8") as f:
        try:
            document = json.load(f)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            msg = f"{path}: not a trace-event file (not JSON: {exc})"
            raise ValueError(msg) from exc
    if not isinstance(document, dict) or not isinstance(document.get("traceEvents"), list):
        msg = f"{path}: not a trace-event file (no traceEvents list)"
        raise ValueError(msg)
    if document.get("otherData", {}).get("generator") != "opsched":
        msg = f"{path}: not written by opsched (otherData.generator)"
        raise ValueError(msg)
    required = {
        "M": ("name", "pid", "tid", "args"),
        "X": ("name", "pid", "tid", "ts", "dur", "args"),
        "C": ("name", "pid", "ts", "args"),
        "s": ("name", "pid", "tid", "ts", "id"),
        "f": ("name", "pid", "tid", "ts", "id", "bp"),
    }
    events: list[dict[str, Any]] = document["traceEvents"]
    for i, event in enumerate(events):
        fields = required.get(event.get("ph", ""))
        if fields is None:
            msg = (
                f"{path}: event {i} has phase {event.get('ph')!r}; expected one of {list(required)}"
            )
            raise ValueError(msg)
        missing = [k for k in fields if k not in event]
        if missing:
            msg = f"{path}: event {i} ({event.get('ph')}) lacks {missing}"
            raise ValueError(msg)
    return events


def summarize(events: list[dict[str, Any]]) -> dict[str, Any]:
    """Per stream: launches, requests, busy time; overall: span, cache hits, graph edges."""
    slices = [e for e in events if e["ph"] == "X"]
    names = {e["tid"]: e["args"]["name"] for e in events if e["name"] == "thread_name"}
    span = max(e["ts"] + e["dur"] for e in slices) - min(e["ts"] for e in slices) if slices else 0.0
    streams = []
    for tid in sorted(t for t in names if t != _SCHEDULER_TID):
        mine = [e for e in slices if e["tid"] == tid]
        busy = sum(e["dur"] for e in mine)
        streams.append(
            {
                "stream": names[tid],
                "launches": len(mine),
                "requests": sum(e["args"].get("requests", 1) for e in mine),
                "busy_ms": busy / 1e3,
                "busy_share": busy / span if span else 0.0,
            }
        )
    queued = [e["args"]["requests"] for e in events if e["name"] == "queued requests"]
    return {
        "span_ms": span / 1e3,
        "launches": len(slices),
        "requests": sum(e["args"].get("requests", 1) for e in slices),
        "cache_hits": sum(1 for e in slices if e["args"].get("executor cache") == "hit"),
        "graph_edges": sum(1 for e in events if e["ph"] == "f"),
        "queued_peak": max(queued, default=0),
        "streams": streams,
    }
