"""Every exception opsched raises, and the aclnn status codes.

Operator argument problems are :class:`AclnnError` subclasses carrying the device's status
code, so code ported from the C API can switch on ``err.status``. Scheduler-level problems
(queue full, deadline passed, scheduler closed) use their own classes, each also subclassing
the builtin a Python user would reach for (``TimeoutError``, ``RuntimeError``).
"""

from __future__ import annotations

import enum
from typing import Any

import anyio

__all__ = [
    "AclnnError",
    "DeadlineExceededError",
    "GraphExecutionError",
    "InnerError",
    "ParamInvalidError",
    "ParamNullptrError",
    "QueueFullError",
    "RequestWithdrawnError",
    "RuntimeLaunchError",
    "SchedulerClosedError",
    "Status",
    "UpstreamFailedError",
]


class Status(enum.IntEnum):
    """aclnn return codes (``aclnnStatus``); member names drop the ``ACLNN_`` prefix."""

    SUCCESS = 0
    #: ACLNN_ERR_PARAM_NULLPTR: a required tensor argument is missing (None).
    ERR_PARAM_NULLPTR = 161001
    #: ACLNN_ERR_PARAM_INVALID: wrong dtype, rank, shape or dim, or an executor misused.
    ERR_PARAM_INVALID = 161002
    #: ACLNN_ERR_RUNTIME_ERROR: the launch itself failed (for us: the kernel raised).
    ERR_RUNTIME_ERROR = 361001
    #: ACLNN_ERR_INNER: an internal invariant broke.
    ERR_INNER = 561000
    #: ACLNN_ERR_INNER_INFERSHAPE_ERROR: shape inference failed.
    ERR_INNER_INFERSHAPE_ERROR = 561001
    #: ACLNN_ERR_INNER_TILING_ERROR: tiling failed.
    ERR_INNER_TILING_ERROR = 561002
    #: ACLNN_ERR_INNER_FIND_KERNEL_ERROR: no kernel for this operator / dtype / product.
    ERR_INNER_FIND_KERNEL_ERROR = 561003
    #: ACLNN_ERR_INNER_CREATE_EXECUTOR: an executor could not be created.
    ERR_INNER_CREATE_EXECUTOR = 561101
    #: ACLNN_ERR_INNER_NOT_TRANS_EXECUTOR: an executor was not transferred.
    ERR_INNER_NOT_TRANS_EXECUTOR = 561102
    #: ACLNN_ERR_INNER_NULLPTR: an internal null (e.g. launching a ``None`` executor).
    ERR_INNER_NULLPTR = 561103


class AclnnError(Exception):
    """An operator call failed with an aclnn status; ``.status`` holds the code.

    Raised as one of the subclasses below; catch this class to handle them all.
    """

    status: Status = Status.ERR_INNER

    def __init__(self, message: str, *, status: Status | None = None) -> None:
        super().__init__(message)
        if status is not None:
            self.status = status

    def __str__(self) -> str:
        return f"{super().__str__()} [{self.status.name} {int(self.status)}]"


class ParamNullptrError(AclnnError):
    """A required tensor argument was None (161001)."""

    status = Status.ERR_PARAM_NULLPTR


class ParamInvalidError(AclnnError):
    """An argument's dtype, rank, shape or value is outside the contract, or an executor was
    used wrongly (161002)."""

    status = Status.ERR_PARAM_INVALID


class RuntimeLaunchError(AclnnError):
    """A launch failed on its stream (361001); the kernel's exception is chained."""

    status = Status.ERR_RUNTIME_ERROR


class InnerError(AclnnError):
    """An internal failure (the 561000 family; ``.status`` says which)."""

    status = Status.ERR_INNER

    @classmethod
    def caused_by(cls, what: str, exc: BaseException) -> InnerError:
        """``what`` went wrong because ``exc`` was raised: the error naming both, ``exc``
        chained (as ``raise ... from exc`` would)."""
        error = cls(f"{what}: {type(exc).__name__}: {exc}")
        error.__cause__ = exc
        return error


class QueueFullError(anyio.WouldBlock):
    """A ``*_nowait`` submission found ``max_queued_requests`` requests already queued
    (an ``anyio.WouldBlock``, as a full channel's ``send_nowait`` raises)."""


class DeadlineExceededError(TimeoutError):
    """A request's deadline passed while it was queued; it was never launched."""


class SchedulerClosedError(RuntimeError):
    """The scheduler is closing or closed: new requests are refused, and
    ``aclose(cancel_pending=True)`` fails the pending ones with this error."""


class RequestWithdrawnError(RuntimeError):
    """The request was withdrawn before it launched, because every task awaiting it was
    cancelled: a later ``await`` of its :class:`~opsched.Pending` raises this."""


class UpstreamFailedError(RuntimeError):
    """A graph node produced no result because a node it depends on failed (chained)."""


class GraphExecutionError(Exception):
    """A graph run had failed nodes. Independent branches still completed.

    Attributes:
        failed: node name -> the exception that node ended with.
        outputs: the requested outputs in order; None for those that did not complete.
    """

    def __init__(self, failed: dict[str, BaseException], outputs: list[Any]) -> None:
        names = ", ".join(f"{name!r} ({type(err).__name__}: {err})" for name, err in failed.items())
        super().__init__(f"{len(failed)} graph node(s) failed: {names}")
        self.failed = failed
        self.outputs = outputs
