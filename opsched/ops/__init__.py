"""Operator descriptions: one module per operator, and the product table.

Each module is the single place that knows what is true of its operator on every device:
the public call's parameters (the entry points are generated from them:
``scripts/gen_entry_points.py``), the checks of docs/operators.md in order, outputs, the
fusion key and units, how it splits, its tolerance, its float64 oracle and its example
inputs. How a device runs it is that device's launcher (``opsched/devices/host/``,
``opsched/devices/torch/``). A new operator is one new module here, its kernels, a line
in :data:`OPERATORS`, a launcher per device that supports it, and a regenerated set of
entry points.

This room never imports the scheduler core, the devices or the CLI.
"""

from opsched.ops._base import DTYPE_NAMES, Operator, Parameter, entry_point, register_array_type
from opsched.ops.glu_backward import GLU_BACKWARD
from opsched.ops.group_norm_backward import GROUP_NORM_BACKWARD
from opsched.ops.group_norm_grad import GROUP_NORM_GRAD

__all__ = [
    "DTYPE_NAMES",
    "GLU_BACKWARD",
    "GROUP_NORM_BACKWARD",
    "GROUP_NORM_GRAD",
    "OPERATORS",
    "Operator",
    "Parameter",
    "entry_point",
    "register_array_type",
]

#: Every operator, by its aclnn name, in the order of the generated entry points.
OPERATORS: dict[str, Operator] = {
    op.name: op for op in (GLU_BACKWARD, GROUP_NORM_GRAD, GROUP_NORM_BACKWARD)
}
