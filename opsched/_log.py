"""Library-safe logging: opsched's structlog events reach the application's configuration.

The library never calls ``structlog.configure()``. Unconfigured, structlog would print every
event, debug ones included, to stdout; so opsched emits its events only once the application
(or the ``opsched`` command) has configured structlog, and is silent otherwise.
"""

from __future__ import annotations

import structlog

__all__ = ["enabled", "get_logger"]


def get_logger(name: str) -> structlog.typing.FilteringBoundLogger:
    """The logger of an opsched module."""
    return structlog.get_logger(name)


def enabled() -> bool:
    """Whether events should be emitted: the application has configured structlog."""
    return structlog.is_configured()
