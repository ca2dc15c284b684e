"""The scheduler profiles shipped with opsched: ``default``, ``throughput`` and ``latency``.

Each is a TOML file of :class:`opsched.SchedulerConfig` knobs, installed with the package
as ``opsched.configs`` and reachable by name (``open_scheduler(config="latency")``,
``opsched demo --config throughput``) or by path.
"""
