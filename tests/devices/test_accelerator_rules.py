"""What a torch device hands the framework on an accelerator, checked without one.

torch's ``meta`` device stands in for an accelerator: its tensors are not on the CPU, so
every launch takes the accelerator's branches, and aten's operators run on it for shapes
and dtypes. A stand-in of the ``torch`` module enforces CUDA's own rules on the calls.
"""

from __future__ import annotations

import types
from typing import Any

import pytest

from opsched.devices.torch import group_norm_backward as gnb_launcher
from opsched.devices.torch import group_norm_grad as gng_launcher
from opsched.devices.torch.group_norm_backward import framework_dtypes
from opsched.ops import GROUP_NORM_BACKWARD

torch = pytest.importorskip("torch")


class _Request:
    """The little of a scheduler request a framework launch reads."""

    def __init__(self, i: int, tensors: dict[str, Any], scalars: dict[str, Any]) -> None:
        self.id, self.op, self.tensors, self.scalars = i, GROUP_NORM_BACKWARD, tensors, scalars


def _cuda_like(calls: list[tuple[Any, ...]]) -> Any:
    """``torch``, but its ``native_group_norm_backward`` refuses mixed dtypes, as aten's
    CUDA kernel does (it reads every operand as the input's dtype)."""
    real = torch.ops.aten.native_group_norm_backward

    def group_norm_backward(dy, x, mean, rstd, gamma, *rest):
        dtypes = (dy.dtype, x.dtype, mean.dtype, rstd.dtype, gamma.dtype)
        calls.append(dtypes)
        if len(set(dtypes)) != 1:
            msg = f"expected scalar type {x.dtype} but found {set(dtypes) - {x.dtype}}"
            raise RuntimeError(msg)
        return real(dy, x, mean, rstd, gamma, *rest)

    aten = types.SimpleNamespace(native_group_norm_backward=group_norm_backward)
    proxy = types.SimpleNamespace(ops=types.SimpleNamespace(aten=aten))
    for name in dir(torch):
        if not name.startswith("__") and name != "ops":
            setattr(proxy, name, getattr(torch, name))
    return proxy


def _requests(count: int, n: int, dtype: Any, stat_dtype: Any, device: str) -> list[_Request]:
    c, hxw, group = 8, 5, 4
    made = []
    for i in range(count):
        tensors = {
            "grad_out": torch.empty(n, c, hxw, dtype=dtype, device=device),
            "input": torch.empty(n, c, hxw, dtype=dtype, device=device),
            "mean": torch.empty(n, group, dtype=stat_dtype, device=device),
            "rstd": torch.empty(n, group, dtype=stat_dtype, device=device),
            "gamma": torch.empty(c, dtype=stat_dtype, device=device),
            "dx": None,
            "dgamma": None,
            "dbeta": None,
        }
        scalars = {"N": n, "C": c, "HxW": hxw, "group": group, "output_mask": (True,) * 3}
        made.append(_Request(i, tensors, scalars))
    return made


@pytest.mark.parametrize("stat_dtype", ["same", "float32"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize(("count", "n"), [(1, 2), (5, 2), (1, 512)], ids=["lone", "stack", "large"])
def test_an_accelerator_gets_one_dtype_and_results_in_the_requests_dtypes(
    count, n, dtype, stat_dtype, monkeypatch
):
    stats = dtype if stat_dtype == "same" else torch.float32
    calls: list[tuple[Any, ...]] = []
    requests = _requests(count, n, dtype, stats, "meta")
    monkeypatch.setattr(gnb_launcher, "torch", _cuda_like(calls))
    gnb_launcher.launch(requests)
    assert calls and all(set(call) == {torch.float32} for call in calls)  # float32 for all
    for r in requests:
        assert r.tensors["dx"].dtype == dtype  # rounded once into the request's dtypes
        assert r.tensors["dgamma"].dtype == r.tensors["dbeta"].dtype == stats


def test_the_cpu_keeps_its_data_dtype_and_widens_only_the_statistics():
    x = torch.empty(2, 8, 5, dtype=torch.bfloat16)
    assert framework_dtypes(x, torch.bfloat16) == (torch.bfloat16, torch.float32)
    meta = x.to("meta")
    assert framework_dtypes(meta, torch.bfloat16) == (torch.float32, torch.float32)
    assert framework_dtypes(meta.float(), torch.float32) == (torch.float32,) * 2


@pytest.mark.parametrize("m", [16, 63, 64, 65, 100, 128, 129, 300])
def test_tree_sums_give_a_row_its_bits_alone_and_in_any_stack(m):
    import numpy as np

    from opsched.devices.torch.group_norm_grad import tree_sums

    rng = np.random.default_rng(m)
    row = torch.from_numpy(rng.standard_normal((1, 1, m)).astype(np.float32))
    alone = tree_sums(row)
    assert alone.shape == (1, 1, 1)
    exact = float(np.sum(row.numpy().astype(np.float64)))
    assert abs(float(alone) - exact) <= 1e-5 * max(1.0, float(np.abs(row.numpy()).sum()))
    for rows, at in ((2, 1), (6, 0), (6, 5), (37, 20)):
        stack = torch.from_numpy(rng.standard_normal((rows, 1, m)).astype(np.float32))
        stack[at] = row[0]
        got = tree_sums(stack)[at]
        assert got.view(torch.int32).item() == alone.view(torch.int32).item()


def test_group_norm_grad_sums_rows_by_the_tree_off_the_cpu(monkeypatch):
    x = torch.empty(3, 4, 5, 7, device="meta")  # rows of 35 elements
    tensors = {"x": x, "dy": x, "gamma": x, "mean": x[:, :, 0, 0], "rstd": x[:, :, 0, 0]}
    tensors["dx"] = torch.empty_like(x)
    calls = []
    real_cat = torch.cat

    def cat(*args, **kwargs):  # the tree's odd-length levels join with cat
        calls.append(args)
        return real_cat(*args, **kwargs)

    proxy = types.SimpleNamespace(
        **{n: getattr(torch, n) for n in dir(torch) if not n.startswith("__")}
    )
    proxy.cat = cat
    monkeypatch.setattr(gng_launcher, "torch", proxy)
    gng_launcher.call(tensors, {})
    assert calls  # 35 is odd: the tree ran (the CPU's path never joins)


# ------------------------------------------------------- streams, events, device errors


class _FakeEvent:
    def __init__(self, backend, blocking: bool) -> None:
        self.backend, self.blocking, self.recorded_on = backend, blocking, None

    def record(self, stream) -> None:
        self.recorded_on = stream

    def synchronize(self) -> None:
        self.backend.synchronized.append(self)
        if self.backend.fault is not None:
            raise self.backend.fault


class _FakeFramework:
    """A framework stream: records what it was told to wait for."""

    def __init__(self) -> None:
        self.waited_streams: list = []

    def wait_stream(self, stream) -> None:
        self.waited_streams.append(stream)

    def wait_event(self, event) -> None:
        pass


class _FakeBackend:
    """``torch.cuda`` as a launch uses it, recording every call."""

    def __init__(self) -> None:
        import threading

        self.threading = threading
        self.current, self.default = "caller stream", "default stream"
        self.fault: BaseException | None = None
        self.sticky = False
        self.bound: list = []
        self.switches: list = []
        self.events: list = []
        self.synchronized: list = []

    def current_stream(self, device):
        return self.current

    def default_stream(self, device):
        return self.default

    def set_device(self, device) -> None:
        self.bound.append(("device", device, self.threading.get_ident()))

    def set_stream(self, stream) -> None:
        self.bound.append(("stream", stream, self.threading.get_ident()))

    def stream(self, framework):
        import contextlib

        self.switches.append(framework)
        return contextlib.nullcontext()

    def Event(self, blocking: bool = False):  # torch's name
        event = _FakeEvent(self, blocking)
        self.events.append(event)
        return event

    def synchronize(self, device) -> None:
        if self.sticky:
            raise RuntimeError("CUDA error: an illegal memory access was encountered")


def _accelerator(monkeypatch, streams: int = 1):
    """A TorchDevice on ``meta`` tensors whose framework is the fake backend."""
    from opsched.devices.streams import FrameworkStream
    from opsched.devices.torch.device import TorchDevice, _binder

    backend = _FakeBackend()
    framework = [_FakeFramework() for _ in range(streams)]
    where = torch.device("meta")
    threads = [
        FrameworkStream(i, framework=f, bind=_binder(backend, where, f))
        for i, f in enumerate(framework)
    ]
    device = TorchDevice(
        "torch:meta",
        threads,
        inline_capable=False,
        accepts_tensors=True,
        torch_device=where,
        framework_streams=framework,
    )
    device._backend = backend
    marked: list = []
    monkeypatch.setattr(TorchDevice, "record_stream", staticmethod(lambda t, s: marked.append(s)))
    return device, backend, framework, marked


def _glu_requests(streams: list[Any]) -> list[Any]:
    from opsched.devices.torch.device import OnStream
    from opsched.ops import GLU_BACKWARD

    made = []
    for i, stream in enumerate(streams):
        tensors = {
            "grad_out": torch.empty(4, 8, device="meta"),
            "self": torch.empty(4, 16, device="meta"),
            "out": None,
        }
        made.append(
            types.SimpleNamespace(
                id=i, op=GLU_BACKWARD, tensors=OnStream(tensors, stream), scalars={"dim": -1}
            )
        )
    return made


def test_a_launch_waits_for_its_callers_streams_and_marks_its_results_used_there(monkeypatch):
    from opsched.ops import GLU_BACKWARD

    device, backend, (framework,), marked = _accelerator(monkeypatch)
    try:
        requests = _glu_requests(["stream A", "stream B", "stream A", None])
        assert device.execute(GLU_BACKWARD, requests, 0) == {}
        # each caller's stream once, the default stream for the request that named none
        assert framework.waited_streams == ["stream A", "stream B", "default stream"]
        # each result on its own caller's stream: requests 0 and 2 share a stacked block
        assert sorted(marked) == ["default stream", "stream A", "stream B"]
        (event,) = backend.events
        assert event.blocking and event.recorded_on is framework  # sleeps, never spins
        assert backend.synchronized == [event]
        assert backend.switches == [framework]  # not the stream's thread: its context
    finally:
        device.close()


def test_a_stream_thread_binds_its_device_and_stream_once_and_launches_without_switching(
    monkeypatch,
):
    import threading

    from opsched.ops import GLU_BACKWARD

    device, backend, (framework,), marked = _accelerator(monkeypatch)
    done = threading.Event()
    threads: list[int] = []

    def work():
        threads.append(threading.get_ident())
        return device.execute(GLU_BACKWARD, _glu_requests(["stream A"]), 0), 0.0, 0.0

    try:
        for _ in range(3):
            device.streams[0].enqueue(work, lambda result, error: None)
        device.streams[0].enqueue(lambda: (done.set(), 0.0, 0.0), lambda r, e: None)
        assert done.wait(10)
    finally:
        device.close()
    worker = threads[0]
    assert set(threads) == {worker}
    assert backend.bound == [
        ("device", torch.device("meta"), worker),
        ("stream", framework, worker),
    ]  # once, in the worker, before its launches
    assert backend.switches == []  # bound: no context switch a launch


def test_the_caller_stream_is_captured_when_a_request_is_bound(monkeypatch):
    from opsched.devices.torch.device import OnStream
    from opsched.ops import GLU_BACKWARD

    device, backend, _, _ = _accelerator(monkeypatch)
    try:
        backend.current = "the caller's side stream"
        tensors = {
            "grad_out": torch.empty(4, 8, device="meta"),
            "self": torch.empty(4, 16, device="meta"),
            "out": None,
        }
        bound, _ = device.bind(GLU_BACKWARD, tensors, {"dim": -1}, {}, 1024)
    finally:
        device.close()
    assert isinstance(bound, OnStream) and bound.stream == "the caller's side stream"


@pytest.mark.parametrize("sticky", [False, True])
def test_a_device_error_at_the_event_fails_the_launch_and_a_sticky_one_loses_the_device(
    monkeypatch, sticky
):
    from opsched.ops import GLU_BACKWARD

    device, backend, _, _ = _accelerator(monkeypatch)
    fault = RuntimeError("CUDA error: an illegal memory access was encountered")
    try:
        backend.fault, backend.sticky = fault, sticky
        errors = device.execute(GLU_BACKWARD, _glu_requests(["s", "s"]), 0)
        assert errors == {0: fault, 1: fault}
        assert device.lost is (fault if sticky else None)
        backend.fault = None
        later = device.execute(GLU_BACKWARD, _glu_requests(["s"]), 0)
    finally:
        device.close()
    if sticky:  # every later launch fails at once, naming the first error
        assert "was lost to an earlier error (RuntimeError: CUDA error" in str(later[0])
        assert later[0].__cause__ is fault
    else:
        assert later == {}


def test_a_stream_whose_binding_failed_fails_its_launches_with_that_error(monkeypatch):
    from opsched.ops import GLU_BACKWARD

    device, backend, _, _ = _accelerator(monkeypatch)
    try:
        device.streams[0].bind_error = RuntimeError("NPU error 107002: context is empty")
        errors = device.execute(GLU_BACKWARD, _glu_requests(["s"]), 0)
    finally:
        device.close()
    assert "107002" in str(errors[0])
