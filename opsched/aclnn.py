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

from kernels._common import DEFAULT_BLOCK
from opsched._executor import Executor, null_executor
from opsched._products import product_named
from opsched.ops import GLU_BACKWARD, GROUP_NORM_BACKWARD, GROUP_NORM_GRAD, Operator

__all__ = [
    "Executor",
    "glu_backward",
    "glu_backward_get_workspace_size",
    "group_norm_backward",
    "group_norm_backward_get_workspace_size",
    "group_norm_grad",
    "group_norm_grad_get_workspace_size",
]


def _get_workspace_size(
    op: Operator, tensors: dict[str, Any], scalars: dict[str, Any], product: str = "generic"
) -> tuple[int, Executor]:
    scalars = op.check_on(product_named(product), tensors, scalars, allocate=False)
    plan = op.plan(tensors, scalars, DEFAULT_BLOCK)
    size = op.workspace_size(plan)
    return size, Executor(op, tensors, scalars, plan, size)


def _launch(
    op: Operator, workspace: object, workspace_size: object, executor: object, stream: object
) -> None:
    if executor is None:
        raise null_executor(op.name)
    if not isinstance(executor, Executor):
        msg = f"{op.name}: executor must be an opsched Executor, got {type(executor).__qualname__}"
        raise TypeError(msg)
    if stream is not None:
        msg = f"{op.name}: stream must be None (run in the calling thread), got {stream!r}"
        raise TypeError(msg)
    work = executor.prepare_launch(op, workspace, workspace_size)
    work()


def glu_backward_get_workspace_size(
    grad_out: np.ndarray, self: np.ndarray, dim: int, out: np.ndarray, *, product: str = "generic"
) -> tuple[int, Executor]:
    """Check a GluBackward call and plan it (``aclnnGluBackwardGetWorkspaceSize``).

    Args:
        grad_out: the upstream gradient, ``self``'s shape with ``shape[dim]`` halved.
        self: the GLU input, split in halves ``a``, ``b`` along ``dim``.
        dim: the split dimension, in ``[-self.ndim, self.ndim - 1]``.
        out: the output, ``self``'s shape and dtype (any strides; may overlap the inputs).

    Returns:
        ``(workspace_size, executor)``; the size is 0 for an empty ``self``.

    Raises:
        InnerError: ``product`` lacks the operator (561003, ``opsched products``).
        ParamNullptrError: a tensor is None (161001).
        ParamInvalidError: a dtype, rank, dim or shape is wrong (161002), in SPEC order.
        TypeError: an argument is not a numpy array, or ``dim`` is not an integer.
    """
    tensors = {"grad_out": grad_out, "self": self, "out": out}
    return _get_workspace_size(GLU_BACKWARD, tensors, {"dim": dim}, product)


def glu_backward(
    workspace: np.ndarray | None, workspace_size: int, executor: Executor, stream: Any = None
) -> None:
    """Launch a planned GluBackward (``aclnnGluBackward``).

    Raises:
        ParamInvalidError: executor misuse or a too-small workspace (161002).
        InnerError: ``executor`` is None (561103).
        RuntimeLaunchError: the kernel failed (361001), its exception chained.
    """
    _launch(GLU_BACKWARD, workspace, workspace_size, executor, stream)


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
    """Check a GroupNormalizationGrad call and plan it.

    Args:
        x, dy, gamma: ``(N, G, *rest)``, 3 to 8 dims, one dtype (FLOAT, FLOAT16, BFLOAT16);
            ``gamma`` already broadcast to ``x``'s shape.
        mean, rstd: ``(N, G)``.
        dx: the output, ``x``'s shape and dtype.

    Returns:
        ``(workspace_size, executor)``; the size is 0 for an empty ``x``.

    Raises:
        InnerError: ``product`` lacks the operator (561003, ``opsched products``).
        ParamNullptrError: a tensor is None (161001).
        ParamInvalidError: a dtype, rank or shape is wrong (161002), in SPEC order.
        TypeError: an argument is not a numpy array.
    """
    tensors = {"x": x, "dy": dy, "gamma": gamma, "mean": mean, "rstd": rstd, "dx": dx}
    return _get_workspace_size(GROUP_NORM_GRAD, tensors, {}, product)


def group_norm_grad(
    workspace: np.ndarray | None, workspace_size: int, executor: Executor, stream: Any = None
) -> None:
    """Launch a planned GroupNormalizationGrad (``aclnnGroupNormalizationGrad``).

    Raises:
        ParamInvalidError: executor misuse or a too-small workspace (161002).
        InnerError: ``executor`` is None (561103).
        RuntimeLaunchError: the kernel failed (361001), its exception chained.
    """
    _launch(GROUP_NORM_GRAD, workspace, workspace_size, executor, stream)


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
        grad_out, input: ``N * C * HxW`` elements (any shape with that count, e.g.
            ``(N, C, H, W)``), FLOAT, FLOAT16 or BFLOAT16.
        mean, rstd: ``N * group`` elements, laid out as ``(N, group)``.
        gamma: ``C`` elements, or None (ones).
        N, C, HxW, group: the geometry; ``group`` divides ``C``.
        output_mask: three bools: compute dx, dgamma, dbeta.
        dx, dgamma, dbeta: the outputs (``input``'s shape; ``gamma``'s shape, or ``(C,)``
            without gamma); None where ``output_mask`` is False. One dtype throughout.

    Returns:
        ``(workspace_size, executor)``.

    Raises:
        InnerError: ``product`` lacks the operator (561003, ``opsched products``).
        ParamNullptrError: ``grad_out``, ``input``, ``mean`` or ``rstd`` is None (161001).
        ParamInvalidError: a bad output_mask, a requested output missing, a dtype, group,
            rank, element count or output shape (161002), in that order.
        TypeError: an argument is not a numpy array, an integer or a bool.
    """
    tensors = {
        "grad_out": grad_out, "input": input, "mean": mean, "rstd": rstd, "gamma": gamma,
        "dx": dx, "dgamma": dgamma, "dbeta": dbeta,
    }  # fmt: skip
    scalars = {"N": N, "C": C, "HxW": HxW, "group": group, "output_mask": output_mask}
    return _get_workspace_size(GROUP_NORM_BACKWARD, tensors, scalars, product)


def group_norm_backward(
    workspace: np.ndarray | None, workspace_size: int, executor: Executor, stream: Any = None
) -> None:
    """Launch a planned GroupNormBackward (``aclnnGroupNormBackward``).

    Raises:
        ParamInvalidError: executor misuse or a too-small workspace (161002).
        InnerError: ``executor`` is None (561103).
        RuntimeLaunchError: the kernel failed (361001), its exception chained.
    """
    _launch(GROUP_NORM_BACKWARD, workspace, workspace_size, executor, stream)
