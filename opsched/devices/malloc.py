"""Freed memory kept in the process for the next launches' outputs (glibc's malloc).

The host devices allocate every result the caller gets with numpy, that is with the C
library's ``malloc``. A scheduler frees them in bursts: the results of a round of launches
are dropped together by their callers. glibc then gives the top of its heap back to the
system as soon as more than 128 KiB lies free there (``M_TRIM_THRESHOLD``), and the next
round's outputs fault their pages in again, zero-filled, one 4 KiB page at a time: a
64 KiB result's kernel then runs several times slower than on memory already in place.
Kept at the top of the heap instead, the memory is reused without a fault, which
``opsched bench scheduler --parts medium`` shows for results of 64 KiB to 1 MiB.

:func:`keep_freed_memory` asks glibc to keep that much (``M_TOP_PAD``), and to serve
allocations up to 32 MiB from the heap (``M_MMAP_THRESHOLD``, glibc's own ceiling: setting
any of these turns off its adaptive threshold, which would otherwise have risen there after
the first large free). It is a setting of the whole process, so it is applied only where
the process left glibc's malloc at its defaults (no ``MALLOC_*`` variable, no
``glibc.malloc`` tunable), only ever raised, and never on another C library. The cost: up
to that much freed memory stays resident in each malloc arena (the loop thread's, and each
stream thread's that allocated) instead of going back to the system.
"""

from __future__ import annotations

import ctypes
import functools
import os
import platform
import threading
from collections.abc import Callable

from opsched._log import enabled, get_logger

__all__ = ["MMAP_THRESHOLD", "keep_freed_memory"]

_log = get_logger("opsched.devices")

#: ``mallopt`` parameters (glibc's ``malloc.h``).
_M_TOP_PAD = -2
_M_MMAP_THRESHOLD = -3
#: Allocations below this come from the heap once :func:`keep_freed_memory` applied: glibc's
#: largest mmap threshold on 64-bit systems (it refuses more).
MMAP_THRESHOLD = 32 << 20

#: Variables and tunables by which a user sets glibc's malloc: then it is theirs.
_USER_SETTINGS = ("MALLOC_TOP_PAD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_MMAP_THRESHOLD_")

_lock = threading.Lock()
#: What this process asked for so far (bytes kept; 0: nothing).
_kept = [0]


def keep_freed_memory(nbytes: int) -> bool:
    """Keep up to ``nbytes`` of freed memory for reuse, process-wide (see the module's
    docstring); a no-op for 0, below what was applied already, outside glibc, or where the
    user configured glibc's malloc.

    Returns:
        Whether the setting was applied by this call.
    """
    if nbytes <= 0 or _user_configured():
        return False
    with _lock:
        if nbytes <= _kept[0]:
            return False
        mallopt = _glibc_mallopt()
        if mallopt is None:
            return False
        if not (mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD) and mallopt(_M_TOP_PAD, nbytes)):
            return False
        _kept[0] = nbytes
    if enabled():
        _log.debug("malloc keeps freed memory", bytes=nbytes, mmap_threshold=MMAP_THRESHOLD)
    return True


def _user_configured() -> bool:
    environ = os.environ
    if any(name in environ for name in _USER_SETTINGS):
        return True
    return "glibc.malloc" in environ.get("GLIBC_TUNABLES", "")


@functools.cache  # platform.libc_ver() reads the interpreter's binary: once
def _glibc_mallopt() -> Callable[[int, int], int] | None:
    """glibc's ``mallopt``, or None on another C library (or where it cannot be found)."""
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return None
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return None
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    mallopt.restype = ctypes.c_int
    return mallopt
