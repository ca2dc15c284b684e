"""The event loop seen from outside: call soon, and call soon from another thread.

Stream threads hand each finished launch back to the loop with one non-blocking call. anyio
offers only blocking cross-thread calls, so this module binds the running backend's own
primitive: ``loop.call_soon_threadsafe`` on asyncio, ``TrioToken.run_sync_soon`` on trio.
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Callable, Hashable
from typing import Any

import attrs

__all__ = ["LoopHandle", "current_loop"]


@attrs.frozen
class LoopHandle:
    """Ways to reach the loop a scheduler lives on."""

    #: Identifies the loop (the asyncio loop, or the trio token).
    key: Hashable
    _soon: Callable[..., Any]
    _threadsafe: Callable[..., Any]
    #: The backend's name, "asyncio" or "trio".
    library: str
    _later: Callable[..., Any] | None = None

    def call_later(self, delay: float, fn: Callable[..., Any], *args: Any) -> None:
        """Run ``fn(*args)`` on the loop ``delay`` seconds from now (call from the loop).

        Only on asyncio; on trio a no-op (timers there live in the waiting coroutines, and
        the sync facade always runs on asyncio).
        """
        if self._later is not None:
            self._later(max(0.0, delay), fn, *args)

    def call_soon(self, fn: Callable[..., Any], *args: Any) -> None:
        """Run ``fn(*args)`` on the loop after the current step (call from the loop)."""
        self._soon(fn, *args)

    def post(self, fn: Callable[..., Any], *args: Any) -> bool:
        """Run ``fn(*args)`` on the loop, from any thread; False once the loop has ended."""
        try:
            self._threadsafe(fn, *args)
        except RuntimeError:  # asyncio: loop closed; trio: RunFinishedError
            return False
        return True


def current_loop() -> LoopHandle:
    """The handle of the running event loop.

    Raises:
        RuntimeError: no event loop runs in this thread, or it is neither asyncio nor trio.
    """
    trio = sys.modules.get("trio")  # only a program that imported trio can be running it
    if trio is not None:
        try:
            token = trio.lowlevel.current_trio_token()
        except RuntimeError:
            pass
        else:
            return LoopHandle(token, token.run_sync_soon, token.run_sync_soon, "trio")
    try:
        loop = asyncio.get_running_loop()
    except RuntimeError:
        msg = "opsched's async API must be called from a running asyncio or trio event loop"
        raise RuntimeError(msg) from None
    return LoopHandle(loop, loop.call_soon, loop.call_soon_threadsafe, "asyncio", loop.call_later)
