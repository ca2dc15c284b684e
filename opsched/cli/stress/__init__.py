"""``opsched stress``: the most demanding user the scheduler meets, with an exact verdict.

Requests are drawn from a pool of seeded *templates* (both operators, every dtype, ranks 1 to
8, empty tensors, non-contiguous views, occasionally large tensors, small graphs). Each
template's result under the solo oracle (the request alone through the two-phase API) is
computed once, so every valid result is compared bit for bit cheaply. Each request is then
independently made invalid (a corruption whose status (docs/operators.md) is known by construction),
cancelled, given a deadline that has already passed, or hit by an injected launch fault.

Verified for every request: the right result or exactly the right error; resolved exactly
once (a watchdog catches lost ones; scheduler counters are cross-checked with the harness's
own, which catches duplicates); an expired request never launched. After shutdown: every
workspace block back in the pool, executors released, no scheduler thread alive,
``statistics()`` adding up, peak RSS within the stated bound. Exit status 0 only if all held.

Everything is reproducible from ``--seed``: a discrepancy prints the request index and its
template, and ``--replay INDEX`` reruns that single request.
"""

from opsched.cli.stress.driver import run_stress
from opsched.cli.stress.workload import StressOptions

__all__ = ["StressOptions", "run_stress"]
