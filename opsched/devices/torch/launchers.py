"""The torch devices' launcher of every operator: how the framework computes it.

Each operator a torch device supports has one module here with two functions:
``call(tensors, scalars)`` computes one request into its output tensors, and
``launch(requests)`` computes requests of one fusion key as one batch-invariant launch (the
device runs each request alone through the same ``launch`` when the batch raises). Adding
an operator to the torch devices is one module and one line below; no operator
description knows torch.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

from opsched.devices.torch import glu_backward, group_norm_backward, group_norm_grad
from opsched.ops import GLU_BACKWARD, GROUP_NORM_BACKWARD, GROUP_NORM_GRAD

__all__ = ["ALONE_BYTES", "LAUNCHERS", "TorchLauncher"]


class TorchLauncher(NamedTuple):
    """One operator's framework calls."""

    #: One request: ``call(tensors, scalars)`` writes its output tensors.
    call: Callable[[Mapping[str, Any], Mapping[str, Any]], None]
    #: Requests of one fusion key, batch-invariant: ``launch(requests)``.
    launch: Callable[[Sequence[Any]], None]


#: The launcher of each operator, by its name.
LAUNCHERS: dict[str, TorchLauncher] = {
    GLU_BACKWARD.name: TorchLauncher(glu_backward.call, glu_backward.launch),
    GROUP_NORM_GRAD.name: TorchLauncher(group_norm_grad.call, group_norm_grad.launch),
    GROUP_NORM_BACKWARD.name: TorchLauncher(group_norm_backward.call, group_norm_backward.launch),
}

#: Requests of at least this many bytes (inputs and outputs) run on their own tensors in
#: every launch (:attr:`~opsched.devices.Device.runs_alone_from`): an operator's largest
#: operand is about a third of its request's bytes or more (GroupNormBackward's input,
#: grad_out and dx alike, beside small statistics), so at 4 bytes an element it holds well
#: over the 8192 elements any launcher above stacks at most. (A FLOAT64 request of this
#: size may still stack; running it alone gives the same bits, only not its share of a
#: launch.)
ALONE_BYTES = 128 << 10
