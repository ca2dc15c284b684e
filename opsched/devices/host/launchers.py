"""The host devices' launcher of every operator (:class:`~.launcher.HostLauncher`).

Adding an operator to the host devices is one module beside this one and one line below.
"""

from __future__ import annotations

from opsched.devices.host.glu_backward import GluBackwardLauncher
from opsched.devices.host.group_norm_backward import GroupNormBackwardLauncher
from opsched.devices.host.group_norm_grad import GroupNormalizationGradLauncher
from opsched.devices.host.launcher import HostLauncher

__all__ = ["LAUNCHERS", "launcher_of"]

#: The launcher of each operator, by its name.
LAUNCHERS: dict[str, HostLauncher] = {
    launcher.op.name: launcher
    for launcher in (
        GluBackwardLauncher(),
        GroupNormalizationGradLauncher(),
        GroupNormBackwardLauncher(),
    )
}


def launcher_of(name: str) -> HostLauncher:
    """The host launcher of the operator called ``name``.

    Raises:
        KeyError: the host devices have no launcher for it.
    """
    return LAUNCHERS[name]
