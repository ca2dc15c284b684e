"""numpy <-> torch conversion, and each operator called once in torch (the per-request
framework call the benchmarks and checks compare against); torch is imported only when used.

- GluBackward is ``torch.ops.aten.glu_backward`` (on Ascend, torch_npu runs
  ``aclnnGluBackward`` for it); GroupNormBackward ``native_group_norm_backward``.
- GroupNormalizationGrad has no aten binding: it is its operator description's framework
  call (the formula of docs/operators.md in torch operations, in float32, rounded once).

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


def glu_backward(grad_out: Any, x: Any, dim: int, *, out: Any = None) -> Any:
    """GluBackward through aten (the device operator on torch_npu); into ``out`` (a tensor
    of ``x``'s shape and dtype, aten's ``grad_input`` variant) when given, else a new
    tensor. Returns the result."""
    import torch

    if out is None:
        return torch.ops.aten.glu_backward(grad_out, x, dim)
    return torch.ops.aten.glu_backward.grad_input(grad_out, x, dim, grad_input=out)


def group_norm_backward(
    grad_out: Any,
    x: Any,
    mean: Any,
    rstd: Any,
    gamma: Any,
    n: int,
    c: int,
    hxw: int,
    group: int,
    mask: Any,
) -> Any:
    """GroupNormBackward through aten (``aclnnGroupNormBackward`` on torch_npu)."""
    import torch

    return torch.ops.aten.native_group_norm_backward(
        grad_out, x, mean, rstd, gamma, n, c, hxw, group, list(mask)
    )


def group_norm_grad(x: Any, dy: Any, gamma: Any, mean: Any, rstd: Any, *, out: Any = None) -> Any:
    """GroupNormalizationGrad in torch: the torch launcher's call of one request, into
    ``out`` (a tensor of ``x``'s shape and dtype) when given, else a new tensor. Returns dx."""
    import torch

    from opsched.devices.torch import group_norm_grad as launcher

    dx = torch.empty_like(x) if out is None else out
    tensors = {"x": x, "dy": dy, "gamma": gamma, "mean": mean, "rstd": rstd, "dx": dx}
    launcher.call(tensors, {})
    return dx
