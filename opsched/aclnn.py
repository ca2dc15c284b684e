"""The two-phase aclnn API, for users porting device code and as the kernels' seam.

Each operator is called in two steps, as on the device::

    size, executor = aclnn.glu_backward_get_workspace_size(grad_out, x, -1, out)
    workspace = np.empty(size, np.uint8) if size else None
    aclnn.glu_backward(workspace, size, executor)

Step one runs every SPEC check in order (raising the first failing status) and plans the
launch; step two runs it. ``stream=None`` runs in the calling thread. ``product=`` checks
the call against an Ascend product's support table (``opsched products``): an operator it
lacks is 561003, a dtype outside its list 161002.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from opsched import ops
from opsched.ops.executor import Executor, get_workspace_size, launch

__all__ = [
    "Executor",
    "glu_backward",
    "glu_backward_get_workspace_size",
    "group_norm_backward",
    "group_norm_backward_get_workspace_size",
    "group_norm_grad",
    "group_norm_grad_get_workspace_size",
]


# BEGIN GENERATED functions: scripts/gen_entry_points.py writes this; do not edit
def glu_backward_get_workspace_size(
    grad_out: np.ndarray,
    self: np.ndarray,
    dim: int,
    out: np.ndarray,
    *,
    product: str = "generic",
) -> tuple[int, Executor]:
    """Check a GluBackward call and plan it (``aclnnGluBackwardGetWorkspaceSize``).

    Args:
        grad_out: the upstream gradient: self's shape, shape[dim] halved.
        self: the GLU input, split in halves a, b along dim.
        dim: the split dimension, in [-self.ndim, self.ndim - 1].
        out: an output, written by the launch.
        product: check as this Ascend product's runtime would (``opsched products``).

    Returns:
        ``(workspace_size, executor)``.

    Raises:
        InnerError: ``product`` lacks the operator (561003).
        ParamNullptrError: a required tensor is None (161001).
        ParamInvalidError: a dtype, rank, shape or scalar is wrong (161002), in SPEC
            order.
        TypeError: an argument of the wrong kind.
    """
    tensors = {"grad_out": grad_out, "self": self, "out": out}
    scalars = {"dim": dim}
    return get_workspace_size(ops.GLU_BACKWARD, tensors, scalars, product)


def glu_backward(
    workspace: np.ndarray | None,
    workspace_size: int,
    executor: Executor,
    stream: Any = None,
) -> None:
    """Launch a planned GluBackward (``aclnnGluBackward``).

    Raises:
        ParamInvalidError: executor misuse or a too-small workspace (161002).
        InnerError: ``executor`` is None (561103).
        RuntimeLaunchError: the kernel failed (361001), its exception chained.
    """
    launch(ops.GLU_BACKWARD, workspace, workspace_size, executor, stream)


def group_norm_grad_get_workspace_size(
    x: np.ndarray,
    dy: np.ndarray,
    gamma: np.ndarray,
    mean: np.ndarray,
    rstd: np.ndarray,
    dx: np.ndarray,
    *,
    product: str = "generic",
) -> tuple[int, Executor]:
    """Check a GroupNormalizationGrad call and plan it
    (``aclnnGroupNormalizationGradGetWorkspaceSize``).

    Args:
        x: (N, G, *rest), 3 to 8 dims: FLOAT, FLOAT16 or BFLOAT16.
        dy: the upstream gradient, x's shape and dtype.
        gamma: already broadcast to x's shape.
        mean: (N, G).
        rstd: (N, G).
        dx: an output, written by the launch.
        product: check as this Ascend product's runtime would (``opsched products``).

    Returns:
        ``(workspace_size, executor)``.

    Raises:
        InnerError: ``product`` lacks the operator (561003).
        ParamNullptrError: a required tensor is None (161001).
        ParamInvalidError: a dtype, rank, shape or scalar is wrong (161002), in SPEC
            order.
        TypeError: an argument of the wrong kind.
    """
    tensors = {"x": x, "dy": dy, "gamma": gamma, "mean": mean, "rstd": rstd, "dx": dx}
    scalars: dict[str, Any] = {}
    return get_workspace_size(ops.GROUP_NORM_GRAD, tensors, scalars, product)


def group_norm_grad(
    workspace: np.ndarray | None,
    workspace_size: int,
    executor: Executor,
    stream: Any = None,
) -> None:
    """Launch a planned GroupNormalizationGrad (``aclnnGroupNormalizationGrad``).

    Raises:
        ParamInvalidError: executor misuse or a too-small workspace (161002).
        InnerError: ``executor`` is None (561103).
        RuntimeLaunchError: the kernel failed (361001), its exception chained.
    """
    launch(ops.GROUP_NORM_GRAD, workspace, workspace_size, executor, stream)


def group_norm_backward_get_workspace_size(
    grad_out: np.ndarray,
    input: np.ndarray,
    mean: np.ndarray,
    rstd: np.ndarray,
    gamma: np.ndarray | None,
    N: int,
    C: int,
    HxW: int,
    group: int,
    output_mask: Sequence[bool],
    dx: np.ndarray | None,
    dgamma: np.ndarray | None,
    dbeta: np.ndarray | None,
    *,
    product: str = "generic",
) -> tuple[int, Executor]:
    """Check a GroupNormBackward call and plan it (``aclnnGroupNormBackwardGetWorkspaceSize``).

    Args:
        grad_out: N * C * HxW elements (e.g. (N, C, H, W)).
        input: the forward input, grad_out's shape and dtype.
        mean: N * group elements, laid out as (N, group).
        rstd: N * group elements, laid out as (N, group).
        gamma: C elements, or None (ones).
        N: the batch size.
        C: the channels.
        HxW: the elements per channel.
        group: the groups; it divides C.
        output_mask: compute (dx, dgamma, dbeta).
        dx: an output, written by the launch.
        dgamma: an output, written by the launch.
        dbeta: an output, written by the launch.
        product: check as this Ascend product's runtime would (``opsched products``).

    Returns:
        ``(workspace_size, executor)``.

    Raises:
        InnerError: ``product`` lacks the operator (561003).
        ParamNullptrError: a required tensor is None (161001).
        ParamInvalidError: a dtype, rank, shape or scalar is wrong (161002), in SPEC
            order.
        TypeError: an argument of the wrong kind.
    """
    tensors = {
        "grad_out": grad_out,
        "input": input,
        "mean": mean,
        "rstd": rstd,
        "gamma": gamma,
        "dx": dx,
        "dgamma": dgamma,
        "dbeta": dbeta,
    }
    scalars = {"N": N, "C": C, "HxW": HxW, "group": group, "output_mask": output_mask}
    return get_workspace_size(ops.GROUP_NORM_BACKWARD, tensors, scalars, product)


def group_norm_backward(
    workspace: np.ndarray | None,
    workspace_size: int,
    executor: Executor,
    stream: Any = None,
) -> None:
    """Launch a planned GroupNormBackward (``aclnnGroupNormBackward``).

    Raises:
        ParamInvalidError: executor misuse or a too-small workspace (161002).
        InnerError: ``executor`` is None (561103).
        RuntimeLaunchError: the kernel failed (361001), its exception chained.
    """
    launch(ops.GROUP_NORM_BACKWARD, workspace, workspace_size, executor, stream)
# END GENERATED functions
