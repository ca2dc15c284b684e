"""opsched: an asyncio task-graph scheduler for batched NPU operators.

The public surface is what ``__all__`` lists; everything else lives in the rooms below it
(``core``, ``devices``, ``ops``, ``cli``; see ``docs/architecture.md``). ``import opsched``
is enough to reach the synchronous facade (:mod:`opsched.sync`) and the two-phase
device-style API (:mod:`opsched.aclnn`).
"""

import importlib.metadata

from opsched import (
    aclnn,
    sync,
)
from opsched._api import (
    Graph,
    Scheduler,
    current_scheduler,
    glu_backward,
    group_norm_backward,
    group_norm_grad,
    open_scheduler,
    run,
)
from opsched._errors import (
    AclnnError,
    DeadlineExceededError,
    GraphExecutionError,
    InnerError,
    ParamInvalidError,
    ParamNullptrError,
    QueueFullError,
    RequestWithdrawnError,
    RuntimeLaunchError,
    SchedulerClosedError,
    Status,
    UpstreamFailedError,
)
from opsched.core.config import SchedulerConfig
from opsched.core.graph import Node, Placeholder
from opsched.core.graph_run import NodeState
from opsched.core.requests import Pending, RequestState
from opsched.core.scheduler import SchedulerState
from opsched.core.stats import SchedulerStatistics
from opsched.devices import (
    CacheStatistics,
    Event,
    InjectedFault,
    PoolStatistics,
    Stream,
    StreamStatistics,
)
from opsched.devices.host.executor import Executor, ExecutorState, PlanCacheStatistics

try:
    __version__ = importlib.metadata.version("opsched")
except importlib.metadata.PackageNotFoundError:  # a checkout on the path, not installed
    __version__ = "0+unknown"

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
    "PlanCacheStatistics",
    "PoolStatistics",
    "QueueFullError",
    "RequestState",
    "RequestWithdrawnError",
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
    "sync",
]
