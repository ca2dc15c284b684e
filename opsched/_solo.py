"""Each operator called alone through the two-phase API, into fresh outputs.

The oracle the demo and the stress harness check the scheduler against, and the baseline of
the scheduler and graph benchmarks: check, plan, workspace, launch, for one request.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from opsched import aclnn

__all__ = ["solo_glu", "solo_gn", "solo_gnb"]

_ALL = (True, True, True)


def _workspace(size: int) -> np.ndarray | None:
    return np.empty(size, np.uint8) if size else None


def solo_glu(grad_out: np.ndarray, x: np.ndarray, dim: int) -> np.ndarray:
    """GluBackward of one request."""
    out = np.empty(x.shape, x.dtype)
    size, executor = aclnn.glu_backward_get_workspace_size(grad_out, x, dim, out)
    aclnn.glu_backward(_workspace(size), size, executor)
    return out


def solo_gn(
    x: np.ndarray, dy: np.ndarray, gamma: np.ndarray, mean: np.ndarray, rstd: np.ndarray
) -> np.ndarray:
    """GroupNormalizationGrad of one request."""
    dx = np.empty(x.shape, x.dtype)
    size, executor = aclnn.group_norm_grad_get_workspace_size(x, dy, gamma, mean, rstd, dx)
    aclnn.group_norm_grad(_workspace(size), size, executor)
    return dx


def solo_gnb(
    grad_out: np.ndarray,
    x: np.ndarray,
    mean: np.ndarray,
    rstd: np.ndarray,
    gamma: np.ndarray | None,
    n: int,
    c: int,
    hxw: int,
    group: int,
    mask: Sequence[bool] = _ALL,
) -> tuple[np.ndarray | None, np.ndarray | None, np.ndarray | None]:
    """GroupNormBackward of one request: ``(dx, dgamma, dbeta)``, None where not asked."""
    stat_shape = gamma.shape if gamma is not None else (c,)
    dx = np.empty(x.shape, x.dtype) if mask[0] else None
    dgamma = np.empty(stat_shape, mean.dtype) if mask[1] else None
    dbeta = np.empty(stat_shape, mean.dtype) if mask[2] else None
    size, executor = aclnn.group_norm_backward_get_workspace_size(
        grad_out, x, mean, rstd, gamma, n, c, hxw, group, mask, dx, dgamma, dbeta
    )
    aclnn.group_norm_backward(_workspace(size), size, executor)
    return dx, dgamma, dbeta
