"""Timeline traces: what the scheduler did, as a Chrome trace-event / Perfetto JSON file.

``open_scheduler(trace="run.json")`` records, and writes when the scheduler closes:

- one track (thread) per stream, a slice per launch: operator, dtype, requests fused, bytes,
  executor cache hit or miss, how long its first request waited in the queue;
- counter tracks: queued requests, and workspace pool bytes in use and held;
- flow arrows from a graph node's producer launch to its consumer launch.

Open the file in https://ui.perfetto.dev (or ``chrome://tracing``). Everything here runs on
the scheduler's loop thread; launch times are the stream's own ``perf_counter`` readings.
With tracing off the scheduler holds ``None`` and pays one ``is not None`` test per launch.
"""

from __future__ import annotations

import json
import os
import pathlib
import time
from typing import Any

__all__ = ["TRACE_SCHEMA_VERSION", "Tracer"]

#: Bumped when the layout of the file changes (``otherData.schema``).
TRACE_SCHEMA_VERSION = 1

_PID = 1
#: Counter and scheduler-wide events sit on this thread id; streams are 1..n.
_SCHEDULER_TID = 0


class Tracer:
    """Collects trace events in memory; :meth:`write` saves them as JSON.

    Args:
        path: where the file is written.
        device: the device's name (the process name shown in the viewer).
        streams: how many streams the device has (one track each).
    """

    def __init__(self, path: str | os.PathLike[str], device: str, streams: int) -> None:
        self.path = pathlib.Path(path)
        parent = self.path.parent
        if not parent.is_dir():
            msg = f"trace={str(path)!r}: directory {str(parent)!r} does not exist"
            raise FileNotFoundError(msg)
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
        self._edges: list[tuple[int, int]] = []
        self._last_counters: tuple[int, int, int] | None = None
        self.launches = 0
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
        self._events.append(
            {"name": name, "cat": "launch", "ph": "X", "pid": _PID, "tid": tid, "ts": ts,
             "dur": dur, "args": args}
        )  # fmt: skip
        self.launches += 1
        for request_id, producers in graph_edges:
            self._slices[request_id] = (tid, ts, ts + dur)
            self._edges.extend((p, request_id) for p in producers)

    def counters(self, queued: int, pool_in_use: int, pool_held: int) -> None:
        """Sample the counter tracks (skipped when nothing changed since the last sample)."""
        sample = (queued, pool_in_use, pool_held)
        if sample == self._last_counters:
            return
        self._last_counters = sample
        ts = self._us(time.perf_counter())
        self._events.append(
            {"name": "queued requests", "ph": "C", "pid": _PID, "tid": _SCHEDULER_TID,
             "ts": ts, "args": {"requests": queued}}
        )  # fmt: skip
        self._events.append(
            {"name": "workspace pool bytes", "ph": "C", "pid": _PID, "tid": _SCHEDULER_TID,
             "ts": ts, "args": {"in use": pool_in_use, "held": pool_held}}
        )  # fmt: skip

    def _flows(self) -> list[dict[str, Any]]:
        flows: list[dict[str, Any]] = []
        seen: set[tuple[tuple[int, float, float], tuple[int, float, float]]] = set()
        for producer, consumer in self._edges:
            src, dst = self._slices.get(producer), self._slices.get(consumer)
            if src is None or dst is None or (src, dst) in seen:
                continue  # a fed input, a launch that never ran, or an arrow drawn already
            seen.add((src, dst))  # fused launches: one arrow per pair of launches
            base = {"name": "graph edge", "cat": "graph", "pid": _PID, "id": len(seen)}
            # The start binds to the producer's slice (a point inside it), the finish to
            # the consumer slice that encloses its timestamp (``bp: e``).
            flows.append({**base, "ph": "s", "tid": src[0], "ts": (src[1] + src[2]) / 2})
            flows.append({**base, "ph": "f", "bp": "e", "tid": dst[0], "ts": dst[1]})
        return flows

    def write(self) -> None:
        """Write the file (once; later calls do nothing)."""
        if self.written:
            return
        self.written = True
        document = {
            "traceEvents": self._events + self._flows(),
            "displayTimeUnit": "ms",
            "otherData": {"generator": "opsched", "schema": TRACE_SCHEMA_VERSION},
        }
        with self.path.open("w", encoding="utf-8") as f:
            json.dump(document, f, separators=(",", ":"))


def _meta(kind: str, tid: int, **args: Any) -> dict[str, Any]:
    return {"name": kind, "ph": "M", "pid": _PID, "tid": tid, "args": args}


def load_trace(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """Read a trace file opsched wrote and check its layout; return its events.

    Raises:
        ValueError: not an opsched trace, or an event missing a field its phase needs
            (the message names the event).
    """
    with pathlib.Path(path).open(encoding="utf-8") as f:
        document = json.load(f)
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
        streams.append({
            "stream": names[tid],
            "launches": len(mine),
            "requests": sum(e["args"].get("requests", 1) for e in mine),
            "busy_ms": busy / 1e3,
            "busy_share": busy / span if span else 0.0,
        })  # fmt: skip
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
