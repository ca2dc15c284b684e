"""The stress verdict: submitting each request and checking what came back."""

from __future__ import annotations

import functools
import threading
import time
from array import array
from typing import Any

import attrs
import numpy as np

import opsched
import opsched.sync
from opsched import ops
from opsched._errors import AclnnError, DeadlineExceededError, RuntimeLaunchError
from opsched.cli.solo import same_bits, solo_workspace
from opsched.cli.stress import oracle
from opsched.cli.stress.workload import StressOptions, _Case, _corrupt, _Template
from opsched.devices.pool import WorkspacePool
from opsched.ops import DTYPE_NAMES
from opsched.ops.products import Product

# ------------------------------------------------------------------------------ the run


@attrs.define(eq=False)
class _Tally:
    """What the harness saw. Mutated from the loop and the sync threads (under ``lock``)."""

    lock: threading.Lock = attrs.field(factory=threading.Lock)
    outcomes: dict[str, int] = attrs.field(factory=dict)
    resolved: set[int] = attrs.field(factory=set)
    discrepancies: list[str] = attrs.field(factory=list)
    latencies: array = attrs.field(factory=lambda: array("d"))
    launched_expired: int = 0
    #: Outcomes of graph runs only (their requests are nodes, counted apart).
    graph_outcomes: dict[str, int] = attrs.field(factory=dict)
    #: How to rerun one request: the command with ``{index}`` to fill in.
    replay: str = "opsched stress --replay {index}"
    #: CPU time the harness itself spent, over every client: drawing each case, making its
    #: arguments, arming its watchdog and checking its outcome against the solo call and
    #: the oracle. Its Python holds the GIL the scheduler needs, so the run's time less
    #: this is the scheduler's share of it.
    harness_seconds: float = 0.0

    def add_harness_time(self, seconds: float) -> None:
        """Add one client's harness time (each client adds its own once, at its end)."""
        with self.lock:
            self.harness_seconds += seconds

    def record(
        self,
        case: _Case,
        outcome: str,
        problem: str | None = None,
        latency: float | None = None,
        *,
        graph: bool = False,
    ) -> None:
        with self.lock:
            if case.index in self.resolved:
                self.outcomes["duplicated"] = self.outcomes.get("duplicated", 0) + 1
                self._note(f"request {case.index} resolved twice")
                return
            self.resolved.add(case.index)
            self.outcomes[outcome] = self.outcomes.get(outcome, 0) + 1
            if graph:
                self.graph_outcomes[outcome] = self.graph_outcomes.get(outcome, 0) + 1
            if problem is not None:
                where = f"request {case.index} ({case.fate}, template {case.template})"
                replay = self.replay.format(index=case.index)
                self._note(f"{where}: {problem}; replay: {replay}")
            if latency is not None:
                self.latencies.append(latency)

    def _note(self, text: str) -> None:
        if len(self.discrepancies) < 50:
            self.discrepancies.append(text)


class _Harness:
    """Submits the cases and checks each outcome."""

    def __init__(
        self, opts: StressOptions, templates: list[_Template], tally: _Tally, product: Product
    ) -> None:
        self.opts = opts
        self.templates = templates
        #: per template: the status the product answers it with (None: supported)
        self.unsupported = [_product_verdict(product, t) for t in templates]
        #: per template: its solo launch needs more workspace than the run's cap, so the
        #: scheduler refuses it at submit (161002) once its arguments pass the checks (the
        #: numpy devices' pool; a torch device's memory is the framework allocator's)
        cap = WorkspacePool(opts.workspace_limit_bytes)
        capped = not opts.device.startswith("torch")
        self.over_cap = [capped and not cap.fits(_solo_workspace(t)) for t in templates]
        #: opsched's own kernels (the numpy devices) are held to their documented error
        #: bound; a framework's kernels to the vendor's tolerance (oracle.py)
        self.own_kernels = not opts.device.startswith("torch")
        self.tally = tally
        # The out arrays of fault and deadline cases, by data address, kept alive until
        # checked: an address is only unique while its array lives.
        self.faulty: dict[int, np.ndarray] = {}
        self.expiring: dict[int, np.ndarray] = {}

    def injector(self, requests: Any) -> bool:
        """Fault injector: fails launches with a fault case; notes launched expired ones."""
        fail = False
        for r in requests:
            out = _address(next(r.tensors[n] for n in r.op.outputs if r.tensors[n] is not None))
            if out in self.expiring:
                self.tally.launched_expired += 1
            fail = fail or out in self.faulty
        return fail

    def prepare(self, case: _Case) -> tuple[str, tuple[Any, ...], dict[str, Any], Any]:
        """The call for ``case``: (op, args, kwargs, what to expect: a status for a request
        that must be rejected, else None)."""
        t = self.templates[case.template]
        unsupported = self.unsupported[case.template]
        if case.fate == "invalid" and t.kind != "graph":
            op, args, broken, status = _corrupt(t, case.corruption)
            # The product's verdict comes first: a missing operator before any check, an
            # unsupported dtype before everything but a missing tensor.
            if unsupported == 561003 or (unsupported == 161002 and status != 161001):
                status = unsupported
            return op, args, broken, status
        if unsupported is None and self.over_cap[case.template]:
            unsupported = OVER_CAP
        kw: dict[str, Any] = {"priority": case.index % 3}
        if t.kind != "graph":
            outs = [None if e is None else np.empty(e.shape, e.dtype) for e in t.entries]
            kw["out"] = tuple(outs) if t.kind == "gnb" else outs[0]
            out = next(o for o in outs if o is not None)  # the array the injector sees
            if case.fate == "fault":
                self.faulty[_address(out)] = out
            if case.fate == "deadline":
                self.expiring[_address(out)] = out
                kw["deadline"] = time.monotonic() - 1.0  # already passed: must never launch
        elif case.fate == "deadline":
            kw["deadline"] = time.monotonic() - 1.0
        return t.kind, t.args, kw, unsupported

    def check(
        self,
        case: _Case,
        status: Any,
        result: Any,
        error: BaseException | None,
        latency: float,
        out: Any = None,
    ) -> None:
        """Compare what happened with what should have."""
        t = self.templates[case.template]
        record = functools.partial(self.tally.record, graph=t.kind == "graph")
        if isinstance(out, tuple):
            out = next(o for o in out if o is not None)
        if out is not None:  # unmark: once checked, its memory may be reused by a new array
            self.faulty.pop(_address(out), None)
            self.expiring.pop(_address(out), None)
        fate = case.fate
        if t.kind == "graph" and fate in ("invalid", "fault"):
            fate = "valid"  # graphs are not corrupted nor faulted: they run as valid work
        if status is not None and fate != "invalid":
            fate = "unsupported"  # the product rejects it at submit, whatever its fate
        if fate == "fault" and not any(e.size for e in t.expected_arrays):
            fate = "valid"  # an empty request launches nothing, so nothing can fault
        if fate in ("invalid", "unsupported"):
            if isinstance(error, AclnnError) and error.status == status:
                if fate == "invalid":
                    record(case, fate)
                elif self.unsupported[case.template] is None:
                    record(case, OVER_CAP_OUTCOME)
                else:
                    record(case, f"unsupported {status}")
            else:
                record(case, "wrong", f"expected status {status}, got {error!r}")
        elif fate == "cancel":
            if error is None and result is None:
                record(case, "cancelled")
            else:
                record(case, "wrong", f"cancelled request produced {error or 'a result'}")
        elif fate == "deadline":
            expired = isinstance(error, DeadlineExceededError) or (
                isinstance(error, opsched.GraphExecutionError)
                and any(isinstance(e, DeadlineExceededError) for e in error.failed.values())
            )
            if expired:
                record(case, "expired")
            else:
                record(case, "wrong", f"expected DeadlineExceededError, got {error or 'a result'}")
        elif fate == "fault":
            if isinstance(error, RuntimeLaunchError) and isinstance(
                error.__cause__, opsched.InjectedFault
            ):
                record(case, "faulted")
            else:
                record(case, "wrong", f"expected RuntimeLaunchError, got {error or 'a result'}")
        elif error is not None:
            record(case, "wrong", f"{t.describe}: raised {error!r}")
        elif not same_bits(result, t.expected):
            record(case, "wrong", f"{t.describe}: not bit-identical to the solo call")
        elif self.own_kernels and not oracle.within_bound(result, t.oracle, t.bound):
            problem = f"{t.describe}: outside the kernels' error bound of the float64 oracle"
            record(case, "wrong", problem)
        elif not self.own_kernels and not oracle.within_tolerance(t.kind, result, t.oracle):
            problem = f"{t.describe}: outside the vendor's tolerance of the float64 oracle"
            record(case, "wrong", problem)
        else:
            record(case, "completed", latency=latency)


#: The operators each kind of template calls, in the order a graph's nodes are checked.
_KIND_OPS = {
    "glu": ("GluBackward",),
    "gn": ("GroupNormalizationGrad",),
    "gnb": ("GroupNormBackward",),
    "graph": ("GroupNormalizationGrad", "GluBackward"),
}


#: The status of a request refused at submit for the workspace cap (ParamInvalidError's),
#: and its outcome's name.
OVER_CAP = 161002
OVER_CAP_OUTCOME = "over the workspace cap"
#: The outcomes of requests refused at submit, by prefix (the accounting counts them).
REFUSED = ("unsupported", OVER_CAP_OUTCOME)
_OPS = {"glu": ops.GLU_BACKWARD, "gn": ops.GROUP_NORM_GRAD, "gnb": ops.GROUP_NORM_BACKWARD}


def _solo_workspace(t: _Template) -> int:
    """Bytes of workspace the template's request needs launched alone (0 for a graph:
    its nodes' dtypes have compiled loops, whose workspace is small)."""
    return 0 if t.kind == "graph" else solo_workspace(_OPS[t.kind], *t.args)


def _product_verdict(product: Product, t: _Template) -> int | None:
    """What ``product`` answers the template's requests with, from its table alone: 561003
    for an operator it lacks, 161002 for a dtype outside its list, None when supported."""
    x = t.args[1] if t.kind in ("glu", "gnb") else t.args[0]
    dtype = DTYPE_NAMES[x.dtype]
    for op in _KIND_OPS[t.kind]:
        support = product.ops.get(op)
        if support is None:
            return 561003
        if dtype not in support.dtypes:
            return 161002
    return None


async def _submit_async(
    sched: opsched.Scheduler, kind: str, args: tuple[Any, ...], kw: dict[str, Any]
) -> Any:
    if kind == "glu":
        return await sched.glu_backward(*args, **kw)
    if kind == "gn":
        return await sched.group_norm_grad(*args, **kw)
    if kind == "gnb":
        return await sched.group_norm_backward(*args, **kw)
    g = opsched.Graph()
    x, dy, gamma, mean, rstd, gate = args
    a = g.group_norm_grad(x, dy, gamma, mean, rstd)
    b = g.glu_backward(a, gate, dim=-1)
    kw = {k: v for k, v in kw.items() if k in ("priority", "deadline")}
    (out,) = await sched.run(g, outputs=[b], **kw)
    return out


def _submit_sync(
    sched: opsched.sync.SyncScheduler, kind: str, args: tuple[Any, ...], kw: dict[str, Any]
) -> Any:
    if kind == "glu":
        return sched.submit_glu_backward(*args, **kw)
    if kind == "gn":
        return sched.submit_group_norm_grad(*args, **kw)
    if kind == "gnb":
        return sched.submit_group_norm_backward(*args, **kw)
    return None  # graphs go through the async clients


def _address(array: Any) -> int:
    """Where an output array's data starts: what names a request's ``out=`` to the fault
    injector, the same for the caller's numpy array and the tensor a torch device views it
    as (alive while its case is in flight, so no two in flight share it)."""
    data_ptr = getattr(array, "data_ptr", None)
    if data_ptr is not None:
        return int(data_ptr())
    return int(array.__array_interface__["data"][0])
