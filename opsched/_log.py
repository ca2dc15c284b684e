"""Library-safe logging: opsched's structlog events reach the application's configuration.

The library never calls ``structlog.configure()``. Unconfigured, structlog would print every
event, debug ones included, to stdout; so opsched emits its events only once the application
(or the ``opsched`` command) has configured structlog, and is silent otherwise.
"""

from __future__ import annotations

import logging
from typing import Any

import structlog

__all__ = ["Logger", "enabled", "get_logger"]


class Logger:
    """An opsched module's structlog logger that never raises into the library.

    An event runs the application's processors, in the middle of the scheduler's own
    bookkeeping (finishing a launch's requests, say), where an exception would leave the
    rest undone and callers waiting. One a processor raises is logged instead to the
    standard library's ``logging`` (logger ``opsched``; printed to stderr when nothing is
    configured), not to structlog, which is what failed.
    """

    __slots__ = ("_logger",)

    def __init__(self, name: str) -> None:
        self._logger = structlog.get_logger(name)

    def debug(self, event: str, **fields: Any) -> None:
        self._emit("debug", event, fields)

    def info(self, event: str, **fields: Any) -> None:
        self._emit("info", event, fields)

    def warning(self, event: str, **fields: Any) -> None:
        self._emit("warning", event, fields)

    def error(self, event: str, **fields: Any) -> None:
        self._emit("error", event, fields)

    def _emit(self, level: str, event: str, fields: dict[str, Any]) -> None:
        try:
            getattr(self._logger, level)(event, **fields)
        except Exception:  # the application's processors: reported, never raised here
            logging.getLogger("opsched").exception(
                "structlog raised on opsched's event %r (%s)", event, level
            )


def get_logger(name: str) -> Logger:
    """The logger of an opsched module."""
    return Logger(name)


def enabled() -> bool:
    """Whether events should be emitted: the application has configured structlog."""
    return structlog.is_configured()
