"""The host devices (``cpu``, ``reference``): numpy kernels on the CPU, one folder.

- :mod:`.device`: :class:`CpuDevice` and :class:`ReferenceDevice`, the workspace pool, the
  executor cache, the fused layout;
- :mod:`.launchers`: each operator's :class:`~.launcher.HostLauncher` (one module per
  operator): its plan, its kernels' launches, its fused layout, gather and scatter;
- :mod:`.executor`: the executors of the two-phase API (``opsched.aclnn``), which runs the
  cpu device's kernels in the calling thread.
"""

from opsched.devices.host.device import (
    LONE_BYTES,
    POOLED_INTERMEDIATE_BYTES,
    SOLO_BATCH_MAX,
    CpuDevice,
    FusedLayout,
    HostDevice,
    ReferenceDevice,
    bucket,
)

__all__ = [
    "LONE_BYTES",
    "POOLED_INTERMEDIATE_BYTES",
    "SOLO_BATCH_MAX",
    "CpuDevice",
    "FusedLayout",
    "HostDevice",
    "ReferenceDevice",
    "bucket",
]
