"""``open_scheduler`` and the module-level operator functions.

``await opsched.glu_backward(...)`` uses the scheduler of the enclosing ``open_scheduler``
block (a context variable, so it follows tasks), else the default scheduler of the running
event loop, created on first use. The default scheduler lives in a background task of that
loop (a plain task on asyncio, a system task on trio); when the loop ends, that task is
cancelled and closes the scheduler: queued requests fail, stream threads are joined, nothing
is left pending or running.
"""

from __future__ import annotations

import contextvars
import os
from collections.abc import AsyncIterator, Callable, Coroutine, Hashable, Mapping, Sequence
from contextlib import asynccontextmanager
from typing import Any

import anyio
import numpy as np

from opsched._config import SchedulerConfig
from opsched._devices import make_device
from opsched._graph import Graph, Node, Placeholder
from opsched._loop import current_loop
from opsched._scheduler import Scheduler, SchedulerState
from opsched._trace import Tracer

__all__ = [
    "current_scheduler",
    "run",
    "glu_backward",
    "group_norm_backward",
    "group_norm_grad",
    "open_scheduler",
    "resolve_config",
]

_current: contextvars.ContextVar[Scheduler | None] = contextvars.ContextVar(
    "opsched_scheduler", default=None
)
_defaults: dict[Hashable, Scheduler] = {}


def resolve_config(
    config: SchedulerConfig | str | os.PathLike[str] | None, overrides: dict[str, Any]
) -> SchedulerConfig:
    """A config from a SchedulerConfig, a TOML path or None, with keyword overrides."""
    if config is None:
        base = SchedulerConfig()
    elif isinstance(config, SchedulerConfig):
        base = config
    elif isinstance(config, str | os.PathLike):
        base = SchedulerConfig.from_toml(config)
    else:
        msg = (
            "config must be a SchedulerConfig, a path to a TOML file or None, got "
            f"{type(config).__qualname__}"
        )
        raise TypeError(msg)
    return base.evolve(overrides) if overrides else base


def _new_scheduler(
    config: SchedulerConfig, device: str, trace: str | os.PathLike[str] | None = None
) -> Scheduler:
    dev = make_device(device, config.streams)
    tracer = None
    try:
        tracer = Tracer(trace, dev.name, len(dev.streams)) if trace is not None else None
        scheduler = Scheduler(config, dev, current_loop(), tracer=tracer)
    except BaseException:  # a bad trace path or product: stop the streams already started
        dev.close()
        if tracer is not None:
            tracer.write()
        raise
    scheduler._open()
    return scheduler


@asynccontextmanager
async def open_scheduler(
    config: SchedulerConfig | str | os.PathLike[str] | None = None,
    *,
    device: str = "cpu",
    trace: str | os.PathLike[str] | None = None,
    **overrides: Any,
) -> AsyncIterator[Scheduler]:
    """Open a scheduler for the block; leaving it drains pending requests.

    Args:
        config: a SchedulerConfig, a path to a TOML file, or None for the defaults.
        device: ``"cpu"`` (numpy kernels on worker-thread streams) or ``"reference"``
            (reference kernels, inline, deterministic: for tests).
        trace: write a Chrome trace-event / Perfetto JSON timeline of the scheduler's
            launches to this path when the scheduler closes (see ``docs/tracing.md``).
        **overrides: single config fields, e.g. ``streams=2``.

    Yields:
        The open :class:`Scheduler`; module-level calls inside the block use it.

    Raises:
        ValueError, TypeError: a bad config value or an unknown setting or device.
    """
    scheduler = _new_scheduler(resolve_config(config, overrides), device, trace)
    _start_service(scheduler, scheduler._serve)
    token = _current.set(scheduler)
    try:
        yield scheduler
    except BaseException:
        with anyio.CancelScope(shield=True):
            await scheduler.aclose(cancel_pending=True)
        raise
    else:
        await scheduler.aclose()
    finally:
        _current.reset(token)
        scheduler._close_now()  # no-op unless a cancellation interrupted the drain


async def current_scheduler() -> Scheduler:
    """The scheduler module-level calls use here (creating the loop's default if needed)."""
    scheduler = _current.get()
    if scheduler is not None and scheduler.state is SchedulerState.OPEN:
        return scheduler
    loop = current_loop()
    scheduler = _defaults.get(loop.key)
    if scheduler is None or scheduler.state is not SchedulerState.OPEN:
        scheduler = _new_scheduler(SchedulerConfig(), "cpu")
        _defaults[loop.key] = scheduler

        async def serve() -> None:
            try:
                await scheduler._serve()
            finally:  # the loop is ending: close without waiting
                _defaults.pop(loop.key, None)
                scheduler._close_now()

        _start_service(scheduler, serve)
    return scheduler


def _start_service(scheduler: Scheduler, serve: Callable[[], Coroutine[Any, Any, None]]) -> None:
    """Run ``serve`` in the background of the running loop, outside any task group.

    A plain task on asyncio (cancelled by ``asyncio.run`` at its end), a system task on
    trio (cancelled when the main task returns). The task returns once the scheduler closes.
    """
    if scheduler._loop.library == "trio":
        import trio

        trio.lowlevel.spawn_system_task(serve, name="opsched scheduler service")
    else:
        import asyncio

        scheduler._service = asyncio.get_running_loop().create_task(
            serve(), name="opsched scheduler service"
        )


async def glu_backward(
    grad_out: np.ndarray,
    self: np.ndarray,
    dim: int = -1,
    *,
    out: np.ndarray | None = None,
    priority: int = 0,
    deadline: float | None = None,
    timeout: float | None = None,
) -> np.ndarray:
    """GluBackward on the current scheduler; see :meth:`Scheduler.glu_backward`."""
    scheduler = await current_scheduler()
    return await scheduler.glu_backward(
        grad_out, self, dim, out=out, priority=priority, deadline=deadline, timeout=timeout
    )


async def group_norm_grad(
    x: np.ndarray,
    dy: np.ndarray,
    gamma: np.ndarray,
    mean: np.ndarray,
    rstd: np.ndarray,
    *,
    out: np.ndarray | None = None,
    priority: int = 0,
    deadline: float | None = None,
    timeout: float | None = None,
) -> np.ndarray:
    """GroupNormalizationGrad on the current scheduler; see
    :meth:`Scheduler.group_norm_grad`."""
    scheduler = await current_scheduler()
    return await scheduler.group_norm_grad(
        x, dy, gamma, mean, rstd, out=out, priority=priority, deadline=deadline, timeout=timeout
    )


async def group_norm_backward(
    grad_out: np.ndarray,
    input: np.ndarray,
    mean: np.ndarray,
    rstd: np.ndarray,
    gamma: np.ndarray | None,
    N: int,
    C: int,
    HxW: int,
    group: int,
    output_mask: Sequence[bool] = (True, True, True),
    **kw: Any,
) -> tuple[np.ndarray | None, np.ndarray | None, np.ndarray | None]:
    """GroupNormBackward on the current scheduler; see :meth:`Scheduler.group_norm_backward`
    (keywords ``out``, ``priority``, ``deadline``, ``timeout``)."""
    scheduler = await current_scheduler()
    return await scheduler.group_norm_backward(
        grad_out, input, mean, rstd, gamma, N, C, HxW, group, output_mask, **kw
    )


async def run(
    graph: Graph,
    outputs: Sequence[Node],
    *,
    inputs: Mapping[Node | Placeholder, np.ndarray] | None = None,
    priority: int = 0,
    deadline: float | None = None,
    timeout: float | None = None,
) -> list[np.ndarray]:
    """Run a graph on the current scheduler; see :meth:`Scheduler.run`."""
    scheduler = await current_scheduler()
    return await scheduler.run(
        graph, outputs, inputs=inputs, priority=priority, deadline=deadline, timeout=timeout
    )
