"""FrameworkStream: graph edges across an accelerator's streams wait on the device.

No accelerator is needed: the framework streams are stand-ins that record what they were
asked to wait for, and a producer launch is held at a gate after issuing its kernels, as a
real one blocks on its framework event until the device finishes.
"""

from __future__ import annotations

import threading
from typing import Any

import pytest

from opsched.devices.streams import Event, FrameworkStream

WAIT = 10.0  # seconds: only a hang reaches it


class FakeFramework:
    """A framework stream that records the events it was told to wait for."""

    def __init__(self) -> None:
        self.waited: list[Any] = []

    def wait_event(self, event: Any) -> None:
        self.waited.append(event)


@pytest.fixture
def streams():
    made = [FrameworkStream(i, framework=FakeFramework()) for i in range(2)]
    yield made
    for s in made:
        s.close()


def test_a_consumer_is_queued_on_the_device_before_its_producer_finishes(streams):
    producer, consumer = streams
    kernels_done = threading.Event()  # the device finishing the producer's kernels
    consumer_issued = threading.Event()
    device_event = object()

    def produce() -> None:
        producer.issued(device_event)  # kernels queued; now block until they finish
        assert kernels_done.wait(WAIT)

    producer.enqueue(produce, lambda result, error: None)
    edge = producer.record_event()
    consumer.wait_event(edge)
    consumer.enqueue(lambda: consumer_issued.set(), lambda result, error: None)

    # the consumer issued its launch while the producer's kernels are still running
    assert consumer_issued.wait(WAIT)
    assert not edge.query()
    assert consumer.framework.waited == [device_event]  # ordered on the device
    kernels_done.set()
    edge.synchronize()


def test_a_producer_that_issued_nothing_is_waited_for_on_the_host(streams):
    producer, consumer = streams
    ran: list[str] = []

    def fail() -> None:
        ran.append("producer")
        raise RuntimeError("before issuing")

    producer.enqueue(fail, lambda result, error: None)
    consumer.wait_event(producer.record_event())
    done = threading.Event()
    consumer.enqueue(lambda: (ran.append("consumer"), done.set()), lambda r, e: None)
    assert done.wait(WAIT)
    assert ran == ["producer", "consumer"]
    assert consumer.framework.waited == []  # finished on the host: nothing to wait for


def test_events_of_other_streams_are_waited_for_on_the_host(streams):
    _, consumer = streams
    foreign = Event()  # e.g. a plain stream's: no framework event to wait on
    order: list[str] = []
    done = threading.Event()
    consumer.wait_event(foreign)
    consumer.enqueue(lambda: (order.append("consumer"), done.set()), lambda r, e: None)
    order.append("foreign completes")
    foreign._complete()
    assert done.wait(WAIT)
    assert order == ["foreign completes", "consumer"]
    assert consumer.framework.waited == []


class _FakeTensor:
    """A result tensor on an accelerator: its block's address, and the streams it was
    marked as used by."""

    def __init__(self, block: int, marks: list) -> None:
        self.block, self.marks = block, marks

    def untyped_storage(self):
        return type("Storage", (), {"data_ptr": lambda _: self.block})()

    def record_stream(self, stream) -> None:
        self.marks.append((self.block, stream))


def test_results_allocated_on_a_launch_stream_are_marked_used_by_the_callers_stream():
    from types import SimpleNamespace

    from opsched.devices.torch.device import TorchDevice, _used_by
    from opsched.ops import GROUP_NORM_BACKWARD

    marks: list = []
    caller = object()
    # two requests whose results are views of two stacked blocks, one output not asked for
    requests = [
        SimpleNamespace(
            tensors={"dx": _FakeTensor(1, marks), "dgamma": _FakeTensor(2, marks), "dbeta": None}
        )
        for _ in range(2)
    ]
    _used_by(caller, requests, GROUP_NORM_BACKWARD, TorchDevice.record_stream)
    assert marks == [(1, caller), (2, caller)]  # each block once, on the caller's stream


def test_each_result_is_marked_used_by_its_own_callers_stream_only():
    from types import SimpleNamespace

    from opsched.devices.torch.device import OnStream, TorchDevice, _used_by
    from opsched.ops import GLU_BACKWARD

    marks: list = []
    requests = [
        SimpleNamespace(tensors=OnStream({"out": _FakeTensor(block, marks)}, stream))
        for block, stream in ((1, "stream A"), (2, "stream B"), (3, None))
    ]
    _used_by("default", requests, GLU_BACKWARD, TorchDevice.record_stream)
    assert marks == [(1, "stream A"), (2, "stream B"), (3, "default")]
