"""``python -m opsched demo``: both operators through the two-phase API on the seeds."""

from __future__ import annotations

from typing import TextIO

import numpy as np

from opsched import aclnn
from opsched._seeds import glu_seed, group_norm_seed

__all__ = ["run_demo"]


def _workspace(size: int) -> np.ndarray | None:
    return np.empty(size, np.uint8) if size else None


def run_demo(out: TextIO) -> int:
    """Run the seed examples, print inputs' shapes and results; return an exit status."""
    np.set_printoptions(precision=6, suppress=True, linewidth=100)
    grad_out, x, dim = glu_seed()
    result = np.empty_like(x)
    size, executor = aclnn.glu_backward_get_workspace_size(grad_out, x, dim, result)
    aclnn.glu_backward(_workspace(size), size, executor)
    print("GluBackward (aclnnGluBackward), seed example", file=out)
    print(f"  self {x.shape} FLOAT, grad_out all ones {grad_out.shape}, dim={dim}", file=out)
    print(f"  workspace: {size} bytes", file=out)
    print("  out =", file=out)
    print("    " + str(result).replace("\n", "\n    "), file=out)

    x, dy, gamma, mean, rstd = group_norm_seed()
    dx = np.empty_like(x)
    size, executor = aclnn.group_norm_grad_get_workspace_size(x, dy, gamma, mean, rstd, dx)
    aclnn.group_norm_grad(_workspace(size), size, executor)
    print("\nGroupNormalizationGrad (aclnnGroupNormalizationGrad), seed example", file=out)
    print(
        f"  x {x.shape} FLOAT with x[..., i] = (i % 128) / 128, dy = 0.5, gamma = 1, "
        "mean = 0, rstd = 1",
        file=out,
    )
    print(f"  workspace: {size} bytes", file=out)
    print(f"  dx[0, 0, :8]   = {dx[0, 0, :8]}", file=out)
    print(f"  dx[1, 3, -4:]  = {dx[1, 3, -4:]}", file=out)
    print("  (every group equals -31.75 / 128 * x: s1 = 64 cancels M * dy)", file=out)
    return 0
