"""The two-phase aclnn API, for users porting device code and as the kernels' seam.

Each operator is called in two steps, as on the device::

    size, executor = aclnn.glu_backward_get_workspace_size(grad_out, x, -1, out)
    workspace = np.empty(size, np.uint8) if size else None
    aclnn.glu_backward(workspace, size, executor)

Step one runs every check of docs/operators.md in order (raising the first failing status) and plans
the launch; step two runs it. ``stream=None`` runs in the calling thread. ``product=`` checks the
call against an Ascend product's support table (``opsched products``): an operator it
lacks is 561003, a dtype outside its list 161002.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any, Protocol

import numpy as np

from opsched import ops
from opsched.devices.host.executor import (
    PLANS,
    Executor,
    PlanCacheStatistics,
    get_workspace_size,
    launch,
)
from opsched.ops import Operator

__all__ = [
    "Executor",
    "glu_backward",
    "glu_backward_get_workspace_size",
    "group_norm_backward",
    "group_norm_backward_get_workspace_size",
    "group_norm_grad",
    "group_norm_grad_get_workspace_size",
    "plan_cache_statistics",
]


class Launch(Protocol):
    """Phase two of an operator: ``launch(workspace, workspace_size, executor)``."""

    def __call__(
        self,
        workspace: np.ndarray | None,
        workspace_size: int,
        executor: Executor,
        stream: Any = None,
    ) -> None: ...


def _planner(op: Operator) -> Callable[..., tuple[int, Executor]]:
    """Phase one of ``op``: its parameters, then its outputs, all positional (as on the
    device), and ``product=``."""
    names = [p.name for p in op.parameters] + list(op.outputs)
    tensor_names = set(op.tensor_names)
    # Where each kind of argument sits, for two comprehensions per call (no membership test
    # per argument: this runs for every call).
    tensor_at = [(n, i) for i, n in enumerate(names) if n in tensor_names]
    scalar_at = [(n, i) for i, n in enumerate(names) if n not in tensor_names]
    kinds = inspect.Parameter.POSITIONAL_OR_KEYWORD
    signature = inspect.Signature(
        [inspect.Parameter(p.name, kinds, annotation=p.annotation) for p in op.parameters]
        + [inspect.Parameter(n, kinds, annotation=op.output_annotation) for n in op.outputs]
        + [inspect.Parameter("product", inspect.Parameter.KEYWORD_ONLY, default="generic")],
        return_annotation="tuple[int, Executor]",
    )

    def plan(*args: Any, **named: Any) -> tuple[int, Executor]:
        product = named.pop("product", "generic")
        if named or len(args) != len(names):  # keywords, or a wrong count: bind (or raise)
            try:
                bound = signature.bind(*args, **named)
            except TypeError as exc:  # Python's message names no function: say which
                msg = (
                    f"{op.method}_get_workspace_size: {exc}; it takes "
                    f"({', '.join(names)}, *, product='generic'), got {len(args)} "
                    f"positional argument(s)" + (f" and {sorted(named)}" if named else "")
                )
                raise TypeError(msg) from None
            args = tuple(bound.arguments[n] for n in names)
        tensors = {name: args[i] for name, i in tensor_at}
        scalars = {name: args[i] for name, i in scalar_at}
        return get_workspace_size(op, tensors, scalars, product)

    outputs = ", ".join(f"``{name}``" for name in op.outputs)
    plan.__doc__ = (
        f"Check a {op.name} call and plan it (``aclnn{op.name}GetWorkspaceSize``).\n\n"
        f"Arguments as :meth:`opsched.Scheduler.{op.method}`, then the outputs ({outputs}) "
        "the launch writes; ``product`` checks the call as that Ascend product's runtime "
        "would (``opsched products``).\n\n"
        "Returns:\n    ``(workspace_size, executor)``.\n\n"
        "Raises:\n"
        "    InnerError: ``product`` lacks the operator (561003).\n"
        "    ParamNullptrError: a required tensor is None (161001).\n"
        "    ParamInvalidError: a dtype, rank, shape or scalar is wrong (161002), in the "
        "order of docs/operators.md.\n"
        "    TypeError: an argument of the wrong kind, or a wrong number of arguments."
    )
    plan.__signature__ = signature  # type: ignore[attr-defined]
    plan.__name__ = plan.__qualname__ = f"{op.method}_get_workspace_size"
    return plan


def _launcher(op: Operator) -> Launch:
    """Phase two of ``op``: launch a planned executor in the calling thread."""

    def run(
        workspace: np.ndarray | None,
        workspace_size: int,
        executor: Executor,
        stream: Any = None,
    ) -> None:
        launch(op, workspace, workspace_size, executor, stream)

    run.__doc__ = (
        f"Launch a planned {op.name} (``aclnn{op.name}``).\n\n"
        "Raises:\n"
        "    ParamInvalidError: executor misuse or a too-small workspace (161002).\n"
        "    InnerError: ``executor`` is None (561103).\n"
        "    RuntimeLaunchError: the kernel failed (361001), its exception chained."
    )
    run.__name__ = run.__qualname__ = op.method
    return run


def plan_cache_statistics() -> PlanCacheStatistics:
    """The counters of the plan cache every ``*_get_workspace_size`` goes through: a call on
    plain, C-contiguous arrays whose geometry was planned before skips the checks and the
    planning (docs/aclnn.md)."""
    return PLANS.statistics()


# BEGIN GENERATED functions: scripts/gen_entry_points.py writes this; do not edit
glu_backward_get_workspace_size = _planner(ops.GLU_BACKWARD)
glu_backward = _launcher(ops.GLU_BACKWARD)
group_norm_grad_get_workspace_size = _planner(ops.GROUP_NORM_GRAD)
group_norm_grad = _launcher(ops.GROUP_NORM_GRAD)
group_norm_backward_get_workspace_size = _planner(ops.GROUP_NORM_BACKWARD)
group_norm_backward = _launcher(ops.GROUP_NORM_BACKWARD)
# END GENERATED functions
