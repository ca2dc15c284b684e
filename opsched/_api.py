"""The async faces: ``open_scheduler``, the public :class:`Scheduler` and :class:`Graph`,
and the module-level operator functions.

``await opsched.glu_backward(...)`` uses the scheduler of the enclosing ``open_scheduler``
block (a context variable, so it follows tasks), else the default scheduler of the running
event loop, created on first use. The default scheduler lives in a background task of that
loop (a plain task on asyncio, a system task on trio); when the loop ends, that task is
cancelled and closes the scheduler: queued requests fail, stream threads are joined, nothing
is left pending or running.

Each operator's typed signature is written once, as its :class:`Scheduler` method, generated
from the operator's description (``scripts/gen_entry_points.py`` rewrites the regions between
the markers) over the core's generic :meth:`~opsched.core.scheduler.Scheduler.submit`. Its
twins (``_nowait``, the module-level function, the graph builder method, and the sync
facade's) are one-line wrappers typed from that method (``ParamSpec``), over the matching
generic call.
"""

from __future__ import annotations

import asyncio
import contextvars
import os
from asyncio import get_running_loop
from collections.abc import AsyncIterator, Callable, Coroutine, Hashable, Mapping, Sequence
from contextlib import asynccontextmanager
from typing import Any, Concatenate, NamedTuple, ParamSpec, TypeVar, cast

import anyio
import numpy as np

from opsched import ops
from opsched.core import scheduler as _core
from opsched.core.config import SchedulerConfig
from opsched.core.engine import OPEN, Engine
from opsched.core.graph import GraphBuilder, Node, Placeholder
from opsched.core.loop import current_loop
from opsched.core.requests import Pending
from opsched.core.trace import Tracer
from opsched.devices import make_device
from opsched.ops import Operator, entry_point

__all__ = [
    "Graph",
    "Scheduler",
    "current_scheduler",
    "glu_backward",
    "group_norm_backward",
    "group_norm_grad",
    "open_engine",
    "open_scheduler",
    "resolve_config",
    "run",
]


S = TypeVar("S", bound=_core.Scheduler)
P = ParamSpec("P")
R = TypeVar("R")


def _nowait(
    op: Operator, method: Callable[Concatenate[S, P], Coroutine[Any, Any, R]]
) -> Callable[Concatenate[S, P], Pending]:
    """``method``'s twin that queues without waiting and returns a :class:`Pending`."""

    def nowait(
        sched: S,
        /,
        *args: Any,
        out: Any = None,
        priority: int = 0,
        deadline: float | None = None,
        timeout: float | None = None,
        **named: Any,
    ) -> Pending:
        if named:  # operator arguments given by name
            args = op.bind(args, named)
        return sched.submit_nowait(op, args, out, priority, deadline, timeout)

    doc = (
        f"Queue a {op.name} without waiting; ``await`` the returned :class:`Pending`.\n\n"
        f"Arguments as :meth:`{op.method}`. Raises QueueFullError when "
        "``max_queued_requests`` are queued (and the argument errors)."
    )
    name = f"{op.method}_nowait"
    return cast(Any, entry_point(nowait, method, name, doc, first="sched", returns="Pending"))


class Scheduler(_core.Scheduler):
    """Fuses queued operator requests into launches on a device's streams.

    Create one with :func:`opsched.open_scheduler`; the module-level functions use the
    scheduler of the enclosing ``open_scheduler`` block or a default one per event loop.
    Each operator has an awaitable method and a ``_nowait`` twin returning a
    :class:`Pending`; both are :meth:`submit` / :meth:`submit_nowait` with named arguments.
    """

    # BEGIN GENERATED scheduler: scripts/gen_entry_points.py writes this; do not edit
    def glu_backward(
        sched,
        grad_out: np.ndarray,
        self: np.ndarray,
        dim: int = -1,
        *,
        out: np.ndarray | None = None,
        priority: int = 0,
        deadline: float | None = None,
        timeout: float | None = None,
    ) -> Coroutine[Any, Any, np.ndarray]:
        """GluBackward (``aclnnGluBackward``): the gradient of GLU; returns ``out``.

        Awaitable (a coroutine): ``await`` it for the result.

        Args:
            grad_out: the upstream gradient: self's shape, shape[dim] halved.
            self: the GLU input, split in halves a, b along dim.
            dim: the split dimension, in [-self.ndim, self.ndim - 1].
            out, priority, deadline, timeout: as :meth:`submit` (``out`` allocated when None).

        Raises: as :meth:`submit`.
        """
        return sched._engine.submit(
            (ops.GLU_BACKWARD, (grad_out, self, dim), out, priority, deadline, timeout)
        )

    glu_backward_nowait = _nowait(ops.GLU_BACKWARD, glu_backward)

    def group_norm_grad(
        sched,
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
    ) -> Coroutine[Any, Any, np.ndarray]:
        """GroupNormalizationGrad (``aclnnGroupNormalizationGrad``); returns ``dx``.

        Awaitable (a coroutine): ``await`` it for the result.

        Args:
            x: (N, G, *rest), 3 to 8 dims: FLOAT, FLOAT16 or BFLOAT16.
            dy: the upstream gradient, x's shape and dtype.
            gamma: already broadcast to x's shape.
            mean: (N, G).
            rstd: (N, G).
            out, priority, deadline, timeout: as :meth:`submit` (``out`` allocated when None).

        Raises: as :meth:`submit`.
        """
        return sched._engine.submit(
            (ops.GROUP_NORM_GRAD, (x, dy, gamma, mean, rstd), out, priority, deadline, timeout)
        )

    group_norm_grad_nowait = _nowait(ops.GROUP_NORM_GRAD, group_norm_grad)

    def group_norm_backward(
        sched,
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
        *,
        out: tuple[np.ndarray | None, np.ndarray | None, np.ndarray | None] | None = None,
        priority: int = 0,
        deadline: float | None = None,
        timeout: float | None = None,
    ) -> Coroutine[Any, Any, tuple[np.ndarray | None, np.ndarray | None, np.ndarray | None]]:
        """GroupNormBackward (``aclnnGroupNormBackward``): the true group-norm gradient; returns
        ``(dx, dgamma, dbeta)``, None where ``output_mask`` is False.

        Awaitable (a coroutine): ``await`` it for the result.

        Args:
            grad_out: N * C * HxW elements (e.g. (N, C, H, W)).
            input: the forward input, grad_out's shape and dtype.
            mean: N * group elements, laid out as (N, group).
            rstd: N * group elements, laid out as (N, group).
            gamma: C elements, or None (ones).
            N: the batch size.
            C: the channels.
            HxW: the elements per channel.
            group: the groups; it divides C.
            output_mask: compute (dx, dgamma, dbeta).
            out, priority, deadline, timeout: as :meth:`submit` (``out`` allocated when None).

        Raises: as :meth:`submit`.
        """
        return sched._engine.submit(
            (
                ops.GROUP_NORM_BACKWARD,
                (grad_out, input, mean, rstd, gamma, N, C, HxW, group, output_mask),
                out,
                priority,
                deadline,
                timeout,
            ),
        )

    group_norm_backward_nowait = _nowait(ops.GROUP_NORM_BACKWARD, group_norm_backward)
    # END GENERATED scheduler


def _node(op: Operator, method: Callable[..., Any]) -> Callable[..., Node]:
    """``method``'s twin that adds a graph node (its arguments may be nodes and
    placeholders; ``name=`` names the node)."""

    def add(graph: GraphBuilder, /, *args: Any, name: str | None = None, **named: Any) -> Node:
        if named:
            args = op.bind(args, named)
        tensors, scalars = op.arguments(args, None)
        for output in op.outputs:
            del tensors[output]
        return graph.add(op, tensors, scalars, name)

    doc = (
        f"Add a {op.name} node (arguments as :meth:`Scheduler.{op.method}`; nodes and "
        "placeholders may stand for arrays).\n\nRaises:\n    ParamNullptrError, "
        "ParamInvalidError, TypeError: the operator's checks (docs/operators.md), at once, "
        "naming the node."
    )
    return entry_point(
        add, method, op.method, doc, first="graph", keywords=("name",), returns="Node"
    )


class Graph(GraphBuilder):
    """A graph of operator calls, built once, checked at build time, run many times.

    Example::

        g = opsched.Graph()
        a = g.group_norm_grad(x, dy, gamma, mean, rstd)
        b = g.glu_backward(a, gate, dim=-1)
        outs = await sched.run(g, outputs=[a, b])
    """

    # BEGIN GENERATED graph: scripts/gen_entry_points.py writes this; do not edit
    glu_backward = _node(ops.GLU_BACKWARD, Scheduler.glu_backward)
    group_norm_grad = _node(ops.GROUP_NORM_GRAD, Scheduler.group_norm_grad)
    group_norm_backward = _node(ops.GROUP_NORM_BACKWARD, Scheduler.group_norm_backward)
    # END GENERATED graph


class _Opened(NamedTuple):
    """An open scheduler: the face callers get, and the engine its calls go to."""

    scheduler: Scheduler
    engine: Engine


#: The scheduler of the enclosing ``open_scheduler`` block (a context variable, so it
#: follows tasks), and each loop's default.
_current: contextvars.ContextVar[_Opened | None] = contextvars.ContextVar(
    "opsched_scheduler", default=None
)
_defaults: dict[Hashable, _Opened] = {}
# A forked child has none of the parent's loops' default schedulers: it makes its own.
os.register_at_fork(after_in_child=_defaults.clear)


def resolve_config(
    config: SchedulerConfig | str | os.PathLike[str] | None, overrides: dict[str, Any]
) -> SchedulerConfig:
    """A config from a SchedulerConfig, a TOML path or None, with keyword overrides."""
    if config is None:
        base = SchedulerConfig()
    elif isinstance(config, SchedulerConfig):
        base = config
    elif isinstance(config, str | os.PathLike):
        base = SchedulerConfig.load(config)
    else:
        msg = (
            "config must be a SchedulerConfig, a profile's name, a path to a TOML file or "
            "None, got "
            f"{type(config).__qualname__}"
        )
        raise TypeError(msg)
    return base.evolve(overrides) if overrides else base


def _new_engine(
    config: SchedulerConfig, device: str, trace: str | os.PathLike[str] | None = None
) -> Engine:
    """An open engine on a new device (the device's streams closed again on failure)."""
    dev = make_device(
        device,
        config.streams,
        workspace_limit_bytes=config.workspace_limit_bytes,
        executor_cache_limit=config.executor_cache_limit,
        fuse_max_bytes=config.fuse_max_bytes,
        split_min_bytes=config.split_min_bytes,
        malloc_keep_bytes=config.malloc_keep_bytes,
    )
    tracer = None
    try:
        tracer = Tracer(trace, dev.name, len(dev.streams)) if trace is not None else None
        engine = Engine(config, dev, current_loop(), tracer=tracer)
    except BaseException:  # a bad trace path or product: stop the streams already started
        dev.close()
        if tracer is not None:
            tracer.write()
        raise
    engine.open()
    return engine


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
        device: ``"cpu"`` (numpy kernels on worker-thread streams), ``"reference"``
            (reference kernels, inline, deterministic: for tests), or a torch device
            (``"torch:cpu"``, ``"torch:cuda[:N]"``, ``"torch:npu[:N]"``).
        trace: write a Chrome trace-event / Perfetto JSON timeline of the scheduler's
            launches to this path when the scheduler closes (see ``docs/tracing.md``).
        **overrides: single config fields, e.g. ``streams=2``.

    Yields:
        The open :class:`Scheduler`; module-level calls inside the block use it.

    Raises:
        ValueError, TypeError: a bad config value or an unknown setting or device.
    """
    async with open_engine(config, device, trace, overrides) as opened:
        yield opened.scheduler


@asynccontextmanager
async def open_engine(
    config: SchedulerConfig | str | os.PathLike[str] | None,
    device: str,
    trace: str | os.PathLike[str] | None,
    overrides: dict[str, Any],
) -> AsyncIterator[_Opened]:
    """:func:`open_scheduler`, yielding the scheduler and its engine (the sync facade
    hands its calls to the engine, as the generated methods do)."""
    engine = _new_engine(resolve_config(config, overrides), device, trace)
    scheduler = Scheduler(engine)
    _start_service(engine, engine.serve)
    opened = _Opened(scheduler, engine)
    token = _current.set(opened)
    try:
        yield opened
    except BaseException:
        with anyio.CancelScope(shield=True):
            await scheduler.aclose(cancel_pending=True)
        raise
    else:
        await scheduler.aclose()
    finally:
        _forget_current(token, scheduler)
        engine.close_now()  # no-op unless a cancellation interrupted the drain


def _forget_current(token: contextvars.Token[_Opened | None], scheduler: Scheduler) -> None:
    """Stop module-level calls here from using ``scheduler`` as its block ends. The block
    may end in another task than the one that entered it (an ``AsyncExitStack`` handed
    on, an abandoned block finalised when its loop ends): that task's context cannot
    take the token, so its own value is put back where it is this scheduler."""
    try:
        _current.reset(token)
    except ValueError:  # the token belongs to another task's context
        here = _current.get()
        if here is not None and here.scheduler is scheduler:
            old = token.old_value
            _current.set(None if old is contextvars.Token.MISSING else old)


async def current_scheduler() -> Scheduler:
    """The scheduler module-level calls use here (creating the loop's default if needed)."""
    return _here().scheduler


def _here() -> _Opened:
    """The scheduler module-level calls use here, and its engine: the enclosing
    ``open_scheduler`` block's, else the running loop's default (made on first use). Every
    module-level call runs it: one context-variable read in a block, one dict lookup
    outside."""
    opened = _current.get()
    if opened is not None and opened.engine.state is OPEN:
        return opened
    # The running asyncio loop's default, found by the loop itself: current_loop() builds
    # a whole handle (about 6 us, as much again as the rest of a tiny request). On trio,
    # or with no loop running, asyncio has none and the handle decides.
    try:
        opened = _defaults.get(asyncio.get_running_loop())
    except RuntimeError:
        opened = None
    if opened is not None and opened.engine.state is OPEN:
        return opened
    loop = current_loop()
    opened = _defaults.get(loop.key)
    if opened is None or opened.engine.state is not OPEN:
        engine = _new_engine(SchedulerConfig(), "cpu")
        opened = _defaults[loop.key] = _Opened(Scheduler(engine), engine)

        async def serve() -> None:
            try:
                await engine.serve()
            finally:  # the loop is ending: close without waiting
                _defaults.pop(loop.key, None)
                engine.close_now()

        _start_service(engine, serve)
    return opened


def _start_service(engine: Engine, serve: Callable[[], Coroutine[Any, Any, None]]) -> None:
    """Run ``serve`` in the background of the running loop, outside any task group.

    A plain task on asyncio (cancelled by ``asyncio.run`` at its end), a system task on
    trio (cancelled when the main task returns). The task returns once the scheduler closes.
    """
    if engine.loop.library == "trio":
        import trio

        trio.lowlevel.spawn_system_task(serve, name="opsched scheduler service")
    else:
        engine.service = asyncio.get_running_loop().create_task(
            serve(), name="opsched scheduler service"
        )


async def run(
    graph: GraphBuilder,
    outputs: Sequence[Node],
    *,
    inputs: Mapping[Node | Placeholder, Any] | None = None,
    priority: int = 0,
    deadline: float | None = None,
    timeout: float | None = None,
) -> list[Any]:
    """Run a graph on the current scheduler; see :meth:`Scheduler.run`."""
    return await _here().scheduler.run(
        graph, outputs, inputs=inputs, priority=priority, deadline=deadline, timeout=timeout
    )


# BEGIN GENERATED functions: scripts/gen_entry_points.py writes this; do not edit
def glu_backward(
    grad_out: np.ndarray,
    self: np.ndarray,
    dim: int = -1,
    *,
    out: np.ndarray | None = None,
    priority: int = 0,
    deadline: float | None = None,
    timeout: float | None = None,
) -> Coroutine[Any, Any, np.ndarray]:
    """GluBackward (``aclnnGluBackward``) on the current scheduler, found when it is called: see
    :meth:`Scheduler.glu_backward`.
    """
    opened = _current.get()
    if opened is None or opened.engine.state is not OPEN:
        try:
            opened = _defaults[get_running_loop()]
        except (RuntimeError, KeyError):  # no asyncio loop, or no default yet
            opened = _here()
        if opened.engine.state is not OPEN:
            opened = _here()
    return opened.engine.submit(
        (ops.GLU_BACKWARD, (grad_out, self, dim), out, priority, deadline, timeout)
    )


def group_norm_grad(
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
) -> Coroutine[Any, Any, np.ndarray]:
    """GroupNormalizationGrad (``aclnnGroupNormalizationGrad``) on the current scheduler, found
    when it is called: see :meth:`Scheduler.group_norm_grad`.
    """
    opened = _current.get()
    if opened is None or opened.engine.state is not OPEN:
        try:
            opened = _defaults[get_running_loop()]
        except (RuntimeError, KeyError):  # no asyncio loop, or no default yet
            opened = _here()
        if opened.engine.state is not OPEN:
            opened = _here()
    return opened.engine.submit(
        (ops.GROUP_NORM_GRAD, (x, dy, gamma, mean, rstd), out, priority, deadline, timeout)
    )


def group_norm_backward(
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
    *,
    out: tuple[np.ndarray | None, np.ndarray | None, np.ndarray | None] | None = None,
    priority: int = 0,
    deadline: float | None = None,
    timeout: float | None = None,
) -> Coroutine[Any, Any, tuple[np.ndarray | None, np.ndarray | None, np.ndarray | None]]:
    """GroupNormBackward (``aclnnGroupNormBackward``) on the current scheduler, found when it is
    called: see :meth:`Scheduler.group_norm_backward`.
    """
    opened = _current.get()
    if opened is None or opened.engine.state is not OPEN:
        try:
            opened = _defaults[get_running_loop()]
        except (RuntimeError, KeyError):  # no asyncio loop, or no default yet
            opened = _here()
        if opened.engine.state is not OPEN:
            opened = _here()
    return opened.engine.submit(
        (
            ops.GROUP_NORM_BACKWARD,
            (grad_out, input, mean, rstd, gamma, N, C, HxW, group, output_mask),
            out,
            priority,
            deadline,
            timeout,
        ),
    )


# END GENERATED functions
