"""Shared pieces of the scheduler tests: random requests, solo oracles, a stream gate."""

from __future__ import annotations

import contextlib
import importlib.util
import os
import threading

import ml_dtypes
import numpy as np

from opsched.cli.solo import solo_glu, solo_gn  # noqa: F401 - the shared oracle
from tests.helpers import BF16, assert_same_bits, gn_inputs, rand

DTYPES = [np.dtype(np.float32), np.dtype(np.float16), BF16, np.dtype(np.float64)]


def random_glu(rng: np.random.Generator, dtype=None):
    """A random GLU request ``(grad_out, self, dim)``, sometimes non-contiguous."""
    dtype = dtype or DTYPES[rng.integers(len(DTYPES))]
    ndim = int(rng.integers(1, 5))
    shape = [int(v) for v in rng.integers(1, 5, ndim)]
    dim = int(rng.integers(-ndim, ndim))
    shape[dim] *= 2
    x = rand(rng, tuple(shape), dtype, 3.0)
    if rng.random() < 0.3 and ndim > 1:
        x = np.ascontiguousarray(x.swapaxes(0, -1)).swapaxes(0, -1)  # same values, F-like
    gshape = list(shape)
    gshape[dim] //= 2
    return rand(rng, tuple(gshape), dtype), x, dim


def random_gn(rng: np.random.Generator, dtype=None):
    """A random group-norm request ``(x, dy, gamma, mean, rstd)`` with a few group sizes."""
    dtype = dtype or DTYPES[rng.integers(3)]
    m = [4, 16, 30][rng.integers(3)]
    shape = (int(rng.integers(1, 4)), int(rng.integers(1, 4)), m)
    return gn_inputs(rng, shape, dtype)


class Gate:
    """A fault-injector hook that never injects: it records each launch's requests and
    holds launches that include a chosen array until :meth:`open` (no sleeps)."""

    def launched_array(self, array: np.ndarray) -> bool:
        """Whether a launched request used ``array``."""
        return id(array) in self.seen or array.__array_interface__["data"][0] in self.seen

    def __init__(self, hold: np.ndarray | None = None) -> None:
        self.hold = hold
        self.opened = threading.Event()
        self.entered = threading.Event()  # set once a held launch waits at the gate
        self.launched: list[list[int]] = []
        self.seen: set[int] = set()  # ids of every array of every launched request

    def __call__(self, requests) -> bool:
        self.launched.append([r.id for r in requests])
        self.seen.update(id(t) for r in requests for t in r.tensors.values())
        self.seen.update(_address(t) for r in requests for t in r.tensors.values())
        if self.hold is not None and any(
            any(uses(t, self.hold) for t in r.tensors.values()) for r in requests
        ):
            self.entered.set()
            assert self.opened.wait(10), "gate never opened"
        return False

    def open(self) -> None:
        self.opened.set()


class FailWhen:
    """A fault injector: fail any launch containing a request that uses one of ``arrays``."""

    def __init__(self, *arrays: np.ndarray) -> None:
        self.arrays = arrays
        self.launches = 0

    def __call__(self, requests) -> bool:
        self.launches += 1
        return any(
            any(uses(t, a) for a in self.arrays for t in r.tensors.values()) for r in requests
        )


def _address(t) -> int | None:
    """Where a torch tensor's data starts (None for anything else)."""
    return t.data_ptr() if hasattr(t, "data_ptr") else None


def uses(t, array: np.ndarray) -> bool:
    """Whether a request's tensor ``t`` is ``array``, or (torch:cpu) a view of its memory."""
    if t is array:
        return True
    return _address(t) is not None and t.data_ptr() == array.__array_interface__["data"][0]


def small_glu(rng: np.random.Generator, rows: int = 4, cols: int = 8):
    """A small FLOAT GluBackward call: ``(grad_out, self)``, ``self`` of ``(rows, cols)``."""
    f32 = np.dtype(np.float32)
    return rand(rng, (rows, cols // 2), f32), rand(rng, (rows, cols), f32)


#: The torch device the torch-device tests run on: ``OPSCHED_TEST_DEVICE`` (e.g.
#: ``torch:cuda``, ``torch:npu:0``), torch:cpu by default.
TORCH_DEVICE = os.environ.get("OPSCHED_TEST_DEVICE", "torch:cpu")
#: Whether that is the CPU (tests of what only torch:cpu does skip elsewhere).
ON_TORCH_CPU = TORCH_DEVICE == "torch:cpu"
_TORCH = [TORCH_DEVICE] if importlib.util.find_spec("torch") else []
#: The devices the scheduler behaviour tests run on (the torch device where torch is
#: installed).
DEVICES = ["cpu", "reference", *_TORCH]
#: Those with stream threads: a test may hold a launch at a gate without blocking the loop.
#: The gates find a request by its arrays' memory, which an accelerator's copy of a numpy
#: array does not keep: the torch device joins them on the CPU only.
THREADED_DEVICES = ["cpu", *(_TORCH if ON_TORCH_CPU else [])]


def torch_device():  # -> torch.device
    """The torch device of :data:`TORCH_DEVICE` (torch imported)."""
    import torch

    spec = TORCH_DEVICE.removeprefix("torch:")
    if spec.startswith("npu"):
        import torch_npu  # noqa: F401 - registers the device

    return torch.device(spec)


def on_device(array):  # -> torch.Tensor
    """A numpy array as a tensor on the test device (a view of it on the CPU)."""
    import torch

    tensor = torch.from_numpy(array)
    return tensor if ON_TORCH_CPU else tensor.to(torch_device())


def host(tensor) -> np.ndarray:
    """A tensor's values as a numpy array (copied from an accelerator)."""
    return tensor.detach().cpu().numpy()


#: (rtol, atol) of docs/operators.md per dtype. A torch device's result and the numpy oracle are
#: each
#: within it of the exact value, so they are compared within twice it.
_TORCH_TOL = {
    np.dtype(np.float64): (1e-10, 1e-10),
    np.dtype(np.float32): (1e-4, 1e-4),
    np.dtype(np.float16): (1e-2, 1e-3),
    BF16: (2e-2, 2e-3),
}


def assert_result(device: str, got, want) -> None:
    """The numpy devices give the oracle's bits; a torch device (the framework's own
    operators) gives its values within docs/operators.md's tolerance, as a numpy array for numpy
    inputs."""
    if not device.startswith("torch"):
        assert_same_bits(got, want)
        return
    assert isinstance(got, np.ndarray) and got.dtype == want.dtype and got.shape == want.shape
    rtol, atol = _TORCH_TOL[want.dtype]
    want64 = want.astype(np.float64)
    # Values near zero from cancelling terms differ by an ulp of the terms, not of the value
    # (the two compute their float32 sums in different orders): one output-dtype ulp at the
    # output's largest magnitude more.
    eps = float(ml_dtypes.finfo(want.dtype).eps)
    ulp = eps * float(np.abs(want64).max(initial=0.0))
    np.testing.assert_allclose(got.astype(np.float64), want64, 2 * rtol, 2 * atol + ulp)


async def gather(*awaitables, return_exceptions: bool = False) -> list:
    """``asyncio.gather`` for any backend (an anyio task group): results in order; with
    ``return_exceptions`` an exception is returned in its place instead of raised."""
    import anyio

    results: list = [None] * len(awaitables)

    async def run(i, awaitable):
        try:
            results[i] = await awaitable
        except Exception as exc:
            if not return_exceptions:
                raise
            results[i] = exc

    async with anyio.create_task_group() as tg:
        for i, awaitable in enumerate(awaitables):
            tg.start_soon(run, i, awaitable)
    return results


async def settle(condition, tries: int = 1000) -> None:
    """Yield to the event loop until ``condition()`` holds: one checkpoint per try, no
    sleeps (asyncio and trio schedule newly started tasks and callbacks differently, so
    "after one checkpoint" is no promise on both). Fails after ``tries`` checkpoints."""
    import anyio

    for _ in range(tries):
        if condition():
            return
        await anyio.lowlevel.checkpoint()
    msg = f"still not true after {tries} checkpoints"
    raise AssertionError(msg)


async def beside_a_ready_task(awaitable):
    """Await ``awaitable`` while more than ``FEW_READY`` other tasks are ready to run (on
    either backend), so that a request it submits goes through the queue unless its device
    says company gains it nothing (``Device.runs_alone_from``): with fewer it would run at
    submit."""
    import anyio

    from opsched.core.engine import FEW_READY

    go = anyio.Event()
    error: Exception | None = None
    async with anyio.create_task_group() as tg:
        for _ in range(FEW_READY + 1):
            tg.start_soon(go.wait)
        await settle(lambda: go.statistics().tasks_waiting == FEW_READY + 1)
        go.set()  # their tasks are ready to run now
        try:
            result = await awaitable
        except Exception as exc:  # raised as it is, not in the task group's ExceptionGroup
            error = exc
    if error is not None:
        raise error
    return result


@contextlib.asynccontextmanager
async def held_stream(device: str, blocker, **config):
    """A scheduler whose one stream is busy: GluBackward on ``blocker`` (``(grad_out,
    self)``) launched and held at a :class:`Gate` until the test opens it. Yields
    ``(sched, gate, pending)``, ``pending`` the blocker's request; ``config``: more knobs."""
    import opsched

    gate = Gate(hold=blocker[1])
    async with opsched.open_scheduler(
        device=device, streams=1, inline_max_bytes=0, **config
    ) as sched:
        sched.device.inject_faults(gate)
        pending = sched.glu_backward_nowait(*blocker)
        await settle(lambda: sched.statistics().running == 1)  # held at the gate
        yield sched, gate, pending
