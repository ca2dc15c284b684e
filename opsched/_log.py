"""Library-safe logging: opsched's events reach whatever logging the application set up.

The library never configures logging. An application that configured structlog gets
opsched's events through its structlog processors. Otherwise they go to the standard
library's ``logging``, under the module's own logger name (``opsched.scheduler``,
``opsched.devices``, ``opsched.kernels``, ...), as ``event key=value ...`` messages: an
application that calls ``logging.basicConfig(level=logging.INFO)`` sees failed requests,
pool growth and evictions, ``DEBUG`` adds every launch. The ``opsched`` logger has a
``NullHandler``, so an application that configured neither hears nothing (not even the
warnings Python's last-resort handler would print).

Events cost nothing when nobody listens: each call site asks :func:`enabled` for its level
before it builds an event's fields.
"""

from __future__ import annotations

import logging
from typing import Any

import structlog

__all__ = ["DEBUG", "ERROR", "INFO", "WARNING", "Logger", "enabled", "get_logger"]

DEBUG, INFO, WARNING, ERROR = logging.DEBUG, logging.INFO, logging.WARNING, logging.ERROR
_LEVELS = {"debug": DEBUG, "info": INFO, "warning": WARNING, "error": ERROR}

#: The parent of every opsched logger: silent unless the application adds a handler.
_ROOT = logging.getLogger("opsched")
_ROOT.addHandler(logging.NullHandler())


class Logger:
    """An opsched module's logger (structlog's or the standard library's, whichever the
    application configured) that never raises into the library.

    An event runs the application's processors or handlers, in the middle of the
    scheduler's own bookkeeping (finishing a launch's requests, say), where an exception
    would leave the rest undone and callers waiting. One that a structlog processor raises
    is reported to the standard library's ``logging`` instead; the standard library
    reports its handlers' own errors itself (``logging.raiseExceptions``).
    """

    __slots__ = ("_logger", "_std")

    def __init__(self, name: str) -> None:
        self._logger = structlog.get_logger(name)
        self._std = logging.getLogger(name)

    def debug(self, event: str, **fields: Any) -> None:
        self._emit("debug", event, fields)

    def info(self, event: str, **fields: Any) -> None:
        self._emit("info", event, fields)

    def warning(self, event: str, **fields: Any) -> None:
        self._emit("warning", event, fields)

    def error(self, event: str, **fields: Any) -> None:
        self._emit("error", event, fields)

    def _emit(self, level: str, event: str, fields: dict[str, Any]) -> None:
        if not structlog.is_configured():
            number = _LEVELS[level]
            if self._std.isEnabledFor(number):
                text = " ".join([event, *(f"{key}={value!r}" for key, value in fields.items())])
                self._std.log(number, "%s", text, extra={"opsched_event": event, **fields})
            return
        try:
            getattr(self._logger, level)(event, **fields)
        except Exception:  # the application's processors: reported, never raised here
            _ROOT.exception("structlog raised on opsched's event %r (%s)", event, level)


def get_logger(name: str) -> Logger:
    """The logger of an opsched module (``name`` under ``opsched``)."""
    return Logger(name)


def enabled(level: int = DEBUG) -> bool:
    """Whether an event of ``level`` would reach anyone: the application configured
    structlog, or the standard library's ``opsched`` loggers pass that level."""
    return structlog.is_configured() or _ROOT.isEnabledFor(level)
