"""opsched: an asyncio task-graph scheduler for batched NPU operators.

The public surface is what ``__all__`` lists; everything else lives in private modules.
The two-phase device-style API is the :mod:`opsched.aclnn` module.
"""

from opsched import aclnn
from opsched._errors import (
    AclnnError,
    DeadlineExceededError,
    InnerError,
    ParamInvalidError,
    ParamNullptrError,
    QueueFullError,
    RuntimeLaunchError,
    SchedulerClosedError,
    Status,
)
from opsched._executor import Executor, ExecutorState

__version__ = "0.1.0"

__all__ = [
    "AclnnError",
    "DeadlineExceededError",
    "Executor",
    "ExecutorState",
    "InnerError",
    "ParamInvalidError",
    "ParamNullptrError",
    "QueueFullError",
    "RuntimeLaunchError",
    "SchedulerClosedError",
    "Status",
    "__version__",
    "aclnn",
]
