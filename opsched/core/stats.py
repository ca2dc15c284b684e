"""The scheduler's counters (mutable, on the loop thread) and their frozen snapshot.

This module knows nothing of devices or operators: the per-stream, pool and executor cache
figures of a snapshot come from the device, whatever it is.
"""

from __future__ import annotations

import attrs

from opsched.devices import CacheStatistics, PoolStatistics, StreamStatistics

__all__ = ["Counters", "SchedulerStatistics", "with_solo"]


@attrs.define
class Counters:
    """What a scheduler counts; changed only on its loop thread (see
    :class:`SchedulerStatistics` for each field's meaning)."""

    submitted: int = 0
    completed: int = 0
    failed: int = 0
    cancelled: int = 0
    expired: int = 0
    rejected: int = 0
    launches: int = 0
    served: int = 0
    per_launch_max: int = 0
    backpressure_waits: int = 0
    graph_runs: int = 0
    graph_nodes: int = 0
    finished_twice: int = 0
    #: Lone requests run where they were submitted, each a launch of one on stream 0
    #: (outside its FIFO, while it is idle), and their seconds: counted apart by two
    #: additions, folded into ``launches`` and stream 0's figures by the snapshot.
    solo_launches: int = 0
    solo_seconds: float = 0.0

    def count(self, outcome: str) -> None:
        """Count one request's final outcome (a :class:`RequestState` value other than
        queued or running; ``done`` counts as completed)."""
        if outcome == "done":
            self.completed += 1
        elif outcome == "failed":
            self.failed += 1
        elif outcome == "cancelled":
            self.cancelled += 1
        elif outcome == "expired":
            self.expired += 1
        else:
            msg = f"{outcome!r} is not a final outcome"
            raise ValueError(msg)

    def launched(self, requests: int) -> None:
        """Count a launch serving ``requests`` requests."""
        self.launches += 1
        self.served += requests
        if requests > self.per_launch_max:
            self.per_launch_max = requests


def with_solo(
    streams: list[StreamStatistics], launches: int, seconds: float
) -> tuple[StreamStatistics, ...]:
    """The streams' figures with the lone requests run where they were submitted
    (``launches`` of them, ``seconds`` in all: :attr:`Counters.solo_launches`) added to
    stream 0's, where they ran."""
    if launches and streams:
        first = streams[0]
        streams[0] = StreamStatistics(
            first.index, first.launches + launches, first.busy_seconds + seconds
        )
    return tuple(streams)


@attrs.frozen
class SchedulerStatistics:
    """A snapshot of a scheduler's counters.

    Attributes:
        submitted: requests accepted into the queue.
        completed: requests that returned a result.
        failed: requests whose launch failed (RuntimeLaunchError) or that a close failed.
        cancelled: requests whose caller cancelled (queued or running) or that
            ``aclose(cancel_pending=True)`` failed.
        expired: requests whose deadline passed while queued.
        rejected: calls refused at submit time (bad arguments, queue full, closed).
        queued: requests waiting now.
        queued_peak: the most requests ever waiting at once.
        running: requests inside launches now.
        launches: launches started (split parts count one each).
        requests_per_launch_mean: requests served per launch, on average.
        requests_per_launch_max: the most requests one launch served.
        backpressure_waits: submissions that waited for room in a full queue.
        graph_runs: graph runs started.
        graph_nodes: graph nodes submitted as requests.
        finished_twice: requests something tried to finish a second time (an internal
            error: the second outcome was neither counted nor delivered). Always 0.
        streams: per-stream launches and busy seconds.
        pool: the device memory's counters (the workspace pool on the host devices, the
            framework's allocator on torch devices).
        executor_cache: the executor cache's counters.
    """

    submitted: int
    completed: int
    failed: int
    cancelled: int
    expired: int
    rejected: int
    queued: int
    queued_peak: int
    running: int
    launches: int
    requests_per_launch_mean: float
    requests_per_launch_max: int
    backpressure_waits: int
    graph_runs: int
    graph_nodes: int
    finished_twice: int
    streams: tuple[StreamStatistics, ...]
    pool: PoolStatistics
    executor_cache: CacheStatistics

    @property
    def resolved(self) -> int:
        """Requests that reached a final state."""
        return self.completed + self.failed + self.cancelled + self.expired
