"""The gates in front of the few private internals of other packages opsched reads.

A request costs a few microseconds, and in three places the public API of a package we
build on cannot do the job at that cost. Each is read only behind a gate: the package's
version is one whose internals were checked, and ``OPSCHED_PUBLIC_ONLY`` is not set. Past
the gate each has a public fallback that computes the same results, more slowly:

- asyncio's ready queue (``loop._ready``): how many callbacks are about to run, so that a
  lone request can run at submit. Fallback: "many", every request goes through the
  dispatcher.
- After a wait, whether the task's anyio cancel scope was cancelled meanwhile (anyio's
  task states and scope chain, asyncio's current task per loop). Fallback: the waiter
  yields to the loop after every wait, where anyio delivers the cancellation itself.
- ``concurrent.futures.Future``'s fields (:class:`~opsched.core.requests.RequestFuture`):
  a future that is one object until something waits on it. Fallback: a plain ``Future``
  subclass driven through its public methods.

The compiled kernels have their own gate for numba's internals (``kernels/_jit.py``, the
same variable). ``OPSCHED_PUBLIC_ONLY=1`` forces every fallback; the test suite runs once
that way (``tests/test_public_fallback.py``), so a release that moves an internal costs
speed, never correctness.
"""

from __future__ import annotations

import importlib.metadata
import os
import sys

__all__ = ["ANYIO_INTERNALS", "PUBLIC_ONLY", "PYTHON_INTERNALS", "version_tuple"]

#: Set (to anything but "" or "0"): use no private internal of another package.
PUBLIC_ONLY = os.environ.get("OPSCHED_PUBLIC_ONLY", "") not in ("", "0")

#: The CPython releases whose asyncio and concurrent.futures internals were checked.
PYTHON_CHECKED = ((3, 11), (3, 13))

#: The anyio releases whose asyncio backend's task states and cancel scopes were checked.
ANYIO_CHECKED = ((4, 4), (4, 16))


def version_tuple(version: str) -> tuple[int, int]:
    """``(major, minor)`` of a version string (``"4.16.0"`` -> ``(4, 16)``); ``(0, 0)``
    when it does not start so."""
    parts = version.split(".")
    try:
        return int(parts[0]), int(parts[1])
    except (IndexError, ValueError):
        return 0, 0


def _within(version: tuple[int, int], checked: tuple[tuple[int, int], tuple[int, int]]) -> bool:
    low, high = checked
    return low <= version <= high


def _anyio_version() -> tuple[int, int]:
    try:
        return version_tuple(importlib.metadata.version("anyio"))
    except importlib.metadata.PackageNotFoundError:
        return 0, 0


#: Whether asyncio's and concurrent.futures' internals may be read.
PYTHON_INTERNALS = not PUBLIC_ONLY and _within(sys.version_info[:2], PYTHON_CHECKED)

#: Whether anyio's task states and cancel scopes may be read.
ANYIO_INTERNALS = not PUBLIC_ONLY and _within(_anyio_version(), ANYIO_CHECKED)
