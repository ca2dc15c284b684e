"""Operator descriptors: one module per operator (see ``_base.Operator``)."""

from opsched.ops._base import Operator
from opsched.ops.glu_backward import GLU_BACKWARD
from opsched.ops.group_norm_backward import GROUP_NORM_BACKWARD
from opsched.ops.group_norm_grad import GROUP_NORM_GRAD

__all__ = ["GLU_BACKWARD", "GROUP_NORM_BACKWARD", "GROUP_NORM_GRAD", "OPERATORS", "Operator"]

#: Every operator, by its aclnn name.
OPERATORS: dict[str, Operator] = {
    op.name: op for op in (GLU_BACKWARD, GROUP_NORM_GRAD, GROUP_NORM_BACKWARD)
}
