"""opsched: an asyncio task-graph scheduler for batched NPU operators.

The public surface is what ``__all__`` lists; everything else lives in private modules.
The two-phase device-style API is the :mod:`opsched.aclnn` module.
"""

from opsched import aclnn
from opsched._api import (
    current_scheduler,
    glu_backward,
    group_norm_backward,
    group_norm_grad,
    open_scheduler,
    run,
)
from opsched._batching import RequestState
from opsched._cache import CacheStatistics
from opsched._config import SchedulerConfig
from opsched._devices import Event, InjectedFault, Stream, StreamStatistics
from opsched._errors import (
    AclnnError,
    DeadlineExceededError,
    GraphExecutionError,
    InnerError,
    ParamInvalidError,
    ParamNullptrError,
    QueueFullError,
    RuntimeLaunchError,
    SchedulerClosedError,
    Status,
    UpstreamFailedError,
)
from opsched._executor import Executor, ExecutorState
from opsched._graph import Graph, Node, NodeState, Placeholder
from opsched._pool import PoolStatistics
from opsched._scheduler import Pending, Scheduler, SchedulerState, SchedulerStatistics

__version__ = "0.1.0"

__all__ = [
    "AclnnError",
    "CacheStatistics",
    "DeadlineExceededError",
    "Event",
    "Executor",
    "ExecutorState",
    "Graph",
    "GraphExecutionError",
    "InjectedFault",
    "InnerError",
    "Node",
    "NodeState",
    "ParamInvalidError",
    "ParamNullptrError",
    "Pending",
    "Placeholder",
    "PoolStatistics",
    "QueueFullError",
    "RequestState",
    "RuntimeLaunchError",
    "Scheduler",
    "SchedulerClosedError",
    "SchedulerConfig",
    "SchedulerState",
    "SchedulerStatistics",
    "Status",
    "Stream",
    "StreamStatistics",
    "UpstreamFailedError",
    "__version__",
    "aclnn",
    "current_scheduler",
    "glu_backward",
    "group_norm_backward",
    "group_norm_grad",
    "open_scheduler",
    "run",
]
