"""Shared pieces of the scheduler tests: random requests, solo oracles, a stream gate."""

from __future__ import annotations

import threading

import numpy as np

from opsched import aclnn
from tests.helpers import BF16, gn_inputs, rand

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


def solo_glu(grad_out, x, dim):
    """The oracle: one request alone through the two-phase API."""
    out = np.empty(x.shape, x.dtype)
    size, ex = aclnn.glu_backward_get_workspace_size(grad_out, x, dim, out)
    aclnn.glu_backward(np.empty(size, np.uint8) if size else None, size, ex)
    return out


def solo_gn(x, dy, gamma, mean, rstd):
    dx = np.empty(x.shape, x.dtype)
    size, ex = aclnn.group_norm_grad_get_workspace_size(x, dy, gamma, mean, rstd, dx)
    aclnn.group_norm_grad(np.empty(size, np.uint8) if size else None, size, ex)
    return dx


class Gate:
    """A fault-injector hook that never injects: it records each launch's requests and
    holds launches that include a chosen array until :meth:`open` (no sleeps)."""

    def launched_array(self, array: np.ndarray) -> bool:
        """Whether a launched request used ``array``."""
        return id(array) in self.seen

    def __init__(self, hold: np.ndarray | None = None) -> None:
        self.hold = hold
        self.opened = threading.Event()
        self.entered = threading.Event()  # set once a held launch waits at the gate
        self.launched: list[list[int]] = []
        self.seen: set[int] = set()  # ids of every array of every launched request

    def __call__(self, requests) -> bool:
        self.launched.append([r.id for r in requests])
        self.seen.update(id(t) for r in requests for t in r.tensors.values())
        if self.hold is not None and any(
            any(t is self.hold for t in r.tensors.values()) for r in requests
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
        return any(any(t is a for a in self.arrays for t in r.tensors.values()) for r in requests)
