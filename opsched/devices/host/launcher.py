"""The host devices' launcher of an operator: how the cpu and reference devices run it.

One :class:`HostLauncher` per operator (one module each beside this one, registered in
:mod:`opsched.devices.host.launchers`) holds what running the operator's numpy kernels
takes and no other device needs: the kernel's plan, its prepared launch (the cpu device's
fast kernel, the reference device's reference kernel: one entry each), and the fused
launch's layout, gather and scatter. What is true of the operator on every device (its
call, checks, outputs, fusion key, split, oracle) is its description's
(:class:`~opsched.ops.Operator`).

A fused launch gathers many requests of one fusion key into contiguous arrays of a
bucketed capacity (the fused geometry), runs the operator's own kernel on them once, and
scatters each request's slice of the output back. Each element or group is computed by the
same float operations on the same contiguous buffers as when launched alone, so the results
are bit-identical. An operator whose kernel has a table loop (:meth:`HostLauncher.table`)
also runs requests together without copying them: one compiled call walks each request's
own arrays, found by address, with the arguments of its solo launch.
"""

from __future__ import annotations

import abc
import operator
from collections.abc import Callable, Hashable, Iterator, Mapping, Sequence
from typing import Any, ClassVar, NamedTuple

import numpy as np

from opsched.ops import Operator
from opsched.ops._base import FusedGeometry, Launch, Tensors
from opsched.ops._fusion import signature_groups

__all__ = ["HostLauncher", "Layout", "Table"]


class Layout(NamedTuple):
    """Where a fused launch's requests lie in its arrays, worked out once a launch: its
    ``requests`` (objects with ``.tensors``, ``.scalars`` and ``.units``) by signature,
    each ``groups`` entry the indices of one signature's requests, in order
    (:func:`~opsched.ops._fusion.signature_groups`), one group after another in the arrays;
    ``bounds``: each group's first unit, then the units in use."""

    requests: Sequence[Any]
    groups: list[list[int]]
    bounds: list[int]

    @classmethod
    def of(cls, requests: Sequence[Any]) -> Layout:
        """The layout of ``requests`` gathered one signature group after another."""
        groups = signature_groups(requests)
        bounds = [0]
        for members in groups:
            bounds.append(bounds[-1] + len(members) * requests[members[0]].units)
        return cls(requests, groups, bounds)

    def spans(self) -> Iterator[tuple[list[int], Any, int, int]]:
        """Each group's members, its first request (whose shapes and scalars all share),
        its first unit and the unit after its last."""
        requests, bounds = self.requests, self.bounds
        for i, members in enumerate(self.groups):
            yield members, requests[members[0]], bounds[i], bounds[i + 1]

    def operands(self, members: list[int], *names: str) -> list[list[Any]]:
        """Operands ``names`` of the requests ``members``: a list each, in order (read in C,
        no Python step per request)."""
        tensors = list(map(_TENSORS, map(self.requests.__getitem__, members)))
        return [list(map(operator.itemgetter(name), tensors)) for name in names]


#: A request's arrays by argument name.
_TENSORS = operator.attrgetter("tensors")


#: A table launch (:meth:`HostLauncher.table`): its call (None: none), the requests it
#: computes, the rest.
Table = tuple[Callable[[], None] | None, list[Any], list[Any]]


class HostLauncher(abc.ABC):
    """One operator on the host devices; stateless, one instance per operator."""

    #: The operator's description.
    op: ClassVar[Operator]
    #: The bytes (inputs and outputs) from which a request's solo launch on the cpu device
    #: costs no more than its share of a fused launch of 256 tiny requests (its gather and
    #: scatter, the dispatcher's round, its waiter's wake-up): the scheduler then runs it
    #: at submit while no launch is in flight (:attr:`~opsched.devices.Device.runs_alone_from`).
    #: Where the two cross depends on what the operator's solo launch prepares for its
    #: compiled call; ``opsched bench scheduler --parts alone`` measures both routes at sizes
    #: around it.
    alone_from: ClassVar[int]

    @abc.abstractmethod
    def plan(self, tensors: Tensors, scalars: Mapping[str, Any], block: int) -> Any:
        """Plan a launch (geometry, staging, workspace layout) for checked arguments."""

    def workspace_size(self, plan: Any) -> int:
        """Bytes of workspace the planned launch uses (every plan carries its own count)."""
        return int(plan.workspace_bytes)

    @abc.abstractmethod
    def prepare(self, plan: Any, tensors: Tensors) -> Launch:
        """The cpu device's launcher: the fast kernel for ``plan``, its per-layout work done
        here, once, on ``tensors``: ``launch(tensors, workspace)`` then runs it on any
        arrays laid out as these (the same shapes, dtypes and strides, and an output
        overlapping an input only where ``tensors``' did), its scratch in ``workspace``
        (at least :meth:`workspace_size` bytes), or where that is None in memory of its
        own. The only way a fast kernel is launched: solo, fused (on the launch's gathered
        arrays), split, a blocking call's cached plan, the two-phase executor. The returned
        launch holds no array."""

    @abc.abstractmethod
    def reference(self, tensors: Tensors, scalars: Mapping[str, Any]) -> Any:
        """Return the reference kernel's result (a new array; a tuple for several outputs)
        for a checked request."""

    def prepare_reference(self, plan: Any, tensors: Tensors) -> Launch:
        """The reference device's launcher (as :meth:`prepare`): :meth:`reference` for
        ``plan`` into the output arrays; also on a fused launch's arrays."""
        scalars, out = self.plan_scalars(plan), self.op.outputs[0]

        def launch(t: Tensors, workspace: np.ndarray | None) -> None:
            np.copyto(t[out], self.reference(t, scalars))

        return launch

    def plan_scalars(self, plan: Any) -> dict[str, Any]:
        """The scalar arguments a plan was made for (none by default)."""
        return {}

    def unplanned_overlap(self, plan: Any, tensors: Tensors) -> bool:
        """True when an output overlaps an input but ``plan`` does not stage the output
        (arrays rebound on a repeatable executor planned for separate buffers)."""
        return not plan.stage_out and self.op.overlaps_any(tensors)

    def table(self, requests: Sequence[Any]) -> Table:
        """A table launch of those ``requests`` (one fusion key) that can take part: one
        compiled call computing each on its own arrays (outputs left to the launch are
        allocated now), with its solo launch's bits; the requests it computes, and those
        it cannot (each runs its own launch). The call holds the GIL only to start and to
        return; it must run while the requests' arrays are alive. The operator's rows
        come from :meth:`table_row`, its call from :meth:`table_call`."""
        rows, taken, rest = [], [], []
        for request in requests:
            row = self.table_row(request)
            if row is None:
                rest.append(request)
            else:
                rows.append(row)
                taken.append(request)
        if not rows:
            return None, taken, rest
        return self.table_call(rows, taken[0]), taken, rest

    def table_row(self, request: Any) -> tuple[int, ...] | None:
        """``request``'s row of a table launch (its outputs left to the launch allocated
        now), or None where it runs its own launch. Default: no table loop, every request
        its own launch."""
        return None

    def table_call(self, rows: list[tuple[int, ...]], first: Any) -> Callable[[], None]:
        """The one compiled call computing ``rows`` (:meth:`table_row`'s; ``first``: one
        of their requests, whose dtypes all share)."""
        msg = f"{self.op.name} has no table loop"
        raise NotImplementedError(msg)

    @abc.abstractmethod
    def fused_geometry(self, key: Hashable, capacity: int) -> FusedGeometry:
        """The arrays and scalars of a fused launch of ``capacity`` units."""

    @abc.abstractmethod
    def fused_parts(self, layout: Layout, fused: Tensors) -> list[dict[str, np.ndarray]]:
        """The kernel calls of a fused launch (gathered by :meth:`gather`): views of the
        fused arrays each one computes. Only the part in use: a launch never computes its
        capacity's padding."""

    @abc.abstractmethod
    def fused_plan(self, key: Hashable, capacity: int, block: int) -> Any:
        """The kernel plan of a fused launch (contiguous gathered operands, no overlap)."""

    @abc.abstractmethod
    def gather(self, layout: Layout, fused: Tensors) -> None:
        """Copy the inputs of the layout's requests into the fused arrays where it places
        them. A few numpy calls a signature group, none a request, where the layouts
        allow."""

    @abc.abstractmethod
    def scatter(self, layout: Layout, fused: Tensors) -> None:
        """Copy each request's slice of the fused outputs into its own output arrays."""
