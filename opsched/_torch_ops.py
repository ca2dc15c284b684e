"""The operators in torch, and numpy <-> torch conversion; imported only when torch is used.

- GluBackward is ``torch.ops.aten.glu_backward`` (on Ascend, torch_npu runs
  ``aclnnGluBackward`` for it).
- GroupNormalizationGrad has no aten binding: it is the SPEC formula in torch operations,
  computed in float32 and rounded once, like the numpy reference.

Nothing else in opsched imports torch; :func:`require_torch` turns its absence into an
ImportError that says how to install it.
"""

from __future__ import annotations

import importlib.util
from typing import Any

import ml_dtypes
import numpy as np

__all__ = [
    "from_torch",
    "glu_backward",
    "group_norm_backward",
    "group_norm_grad",
    "require_torch",
    "to_torch",
    "torch_available",
]

INSTALL_HINT = "pip install 'opsched[torch]'"


def torch_available() -> bool:
    """Whether torch can be imported (without importing it)."""
    return importlib.util.find_spec("torch") is not None


def require_torch(what: str) -> Any:
    """Import torch, or raise ImportError naming ``what`` needed it and how to get it."""
    try:
        import torch
    except ImportError as exc:
        msg = f"{what} needs PyTorch, which is not installed; install it with {INSTALL_HINT}"
        raise ImportError(msg) from exc
    return torch


def to_torch(array: np.ndarray, device: Any = "cpu", *, share: bool = False) -> Any:
    """A torch tensor with ``array``'s values (bfloat16 through its bits).

    A copy, unless ``share`` and the tensor can be a view of the array's memory on the CPU
    (non-negative strides, writeable): then writes through the tensor reach the array.
    """
    import torch

    viewable = share and str(device) == "cpu" and array.flags.writeable
    viewable = viewable and all(s >= 0 for s in array.strides)
    source = array if viewable else np.ascontiguousarray(array)
    if array.dtype == ml_dtypes.bfloat16:
        tensor = torch.from_numpy(source.view(np.int16)).view(torch.bfloat16)
    else:
        tensor = torch.from_numpy(source)
    return tensor if viewable else tensor.to(device, copy=True)


def from_torch(tensor: Any) -> np.ndarray:
    """A numpy array with ``tensor``'s values (bfloat16 through its bits)."""
    import torch

    tensor = tensor.detach().cpu().contiguous()
    if tensor.dtype == torch.bfloat16:
        return tensor.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    return tensor.numpy()


def glu_backward(grad_out: Any, x: Any, dim: int) -> Any:
    """GluBackward through aten (the device operator on torch_npu)."""
    import torch

    return torch.ops.aten.glu_backward(grad_out, x, dim)


def group_norm_backward(
    grad_out: Any, x: Any, mean: Any, rstd: Any, gamma: Any, n: int, c: int, hxw: int,
    group: int, mask: Any,
) -> Any:  # fmt: skip
    """GroupNormBackward through aten (``aclnnGroupNormBackward`` on torch_npu)."""
    import torch

    return torch.ops.aten.native_group_norm_backward(
        grad_out, x, mean, rstd, gamma, n, c, hxw, group, list(mask)
    )


def group_norm_grad(x: Any, dy: Any, gamma: Any, mean: Any, rstd: Any) -> Any:
    """GroupNormalizationGrad: the SPEC formula in torch operations, in float32."""
    import torch

    n, g = x.shape[0], x.shape[1]
    m = x.numel() // max(n * g, 1)
    f32 = torch.float32
    x_, dy_, gamma_ = (t.to(f32).reshape(n, g, m) for t in (x, dy, gamma))
    mean_ = mean.to(f32).reshape(n, g, 1)
    rstd_ = rstd.to(f32).reshape(n, g, 1)
    xhat = (x_ - mean_) * rstd_
    s1 = (dy_ * gamma_).sum(-1, keepdim=True)
    s2 = (dy_ * gamma_ * xhat).sum(-1, keepdim=True)
    dx = (rstd_ / m) * gamma_ * (m * dy_ - s1 - xhat * s2)
    return dx.reshape(x.shape).to(x.dtype)
