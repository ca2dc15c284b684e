"""Write every operator's public entry points from its description (``opsched/ops/``).

Each operator is described once (its parameters, summary and types, in its module); this
script writes the typed, documented entry points of every face from those descriptions,
between ``BEGIN GENERATED`` / ``END GENERATED`` markers:

- ``opsched/_api.py``: ``Scheduler.<op>`` / ``<op>_nowait``, module-level ``opsched.<op>``,
  ``Graph.<op>``;
- ``opsched/sync.py``: ``SyncScheduler.<op>`` / ``submit_<op>``, ``opsched.sync.<op>``;
- ``opsched/aclnn.py``: ``<op>_get_workspace_size`` and ``<op>`` (the two-phase call).

Every generated entry point is a thin wrapper over one generic call (``Scheduler.submit``,
``submit_nowait``, ``submit_threadsafe``, ``GraphBuilder.add``, ``get_workspace_size`` /
``launch``). Usage::

    python scripts/gen_entry_points.py          # rewrite the regions
    python scripts/gen_entry_points.py --check  # exit 1 if any region is out of date

A test runs ``--check``, so CI fails when a description changed and this was not re-run.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import pathlib
import sys
import textwrap
import types
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

ROOT = pathlib.Path(__file__).resolve().parent.parent


def _load_descriptions() -> types.ModuleType:
    """Import ``opsched.ops`` from this checkout without running ``opsched/__init__.py``
    (it re-exports the very functions this script writes, so it cannot import before they
    exist): ``opsched`` and ``opsched.kernels`` are set up as bare packages first."""
    package = types.ModuleType("opsched")
    package.__path__ = [str(ROOT / "opsched")]
    sys.modules["opsched"] = package
    kernels = ROOT / "kernels"
    spec = importlib.util.spec_from_file_location(
        "opsched.kernels", kernels / "__init__.py", submodule_search_locations=[str(kernels)]
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["opsched.kernels"] = module
    spec.loader.exec_module(module)
    return importlib.import_module("opsched.ops")


if TYPE_CHECKING:
    from opsched.ops import Operator, Parameter

OPERATORS: dict[str, Operator] = _load_descriptions().OPERATORS
WIDTH = 100
WAIT_KW = ("priority", "deadline", "timeout")


def _const(op: Operator) -> str:
    return f"ops.{op.method.upper()}"


def _call(head: str, args: Sequence[str], indent: str, tail: str = ")") -> list[str]:
    """``head(args...)`` on one line if it fits, else wrapped as ruff would."""
    one = f"{indent}{head}{', '.join(args)}{tail}"
    if len(one) <= WIDTH:
        return [one]
    inner = indent + "    "
    joined = f"{inner}{', '.join(args)}"
    if len(joined) <= WIDTH:
        return [f"{indent}{head}", joined, f"{indent}{tail}"]
    return [f"{indent}{head}", *(f"{inner}{a}," for a in args), f"{indent}{tail}"]


def _signature(
    name: str,
    receiver: str | None,
    params: Sequence[str],
    returns: str,
    indent: str,
) -> list[str]:
    lead = f"{indent}def {name}("
    items = ([receiver] if receiver else []) + list(params)
    one = f"{lead}{', '.join(items)}) -> {returns}:"
    if len(one) <= WIDTH:
        return [one]
    return [lead, *(f"{indent}    {p}," for p in items), f"{indent}) -> {returns}:"]


def _param(op: Operator, p: Parameter, *, defaults: bool = True, tensor_type: str = "") -> str:
    name, annotation, default = p.name, p.annotation, p.default
    if tensor_type and name in op.tensor_names:
        annotation = tensor_type
    text = f"{name}: {annotation}"
    return f"{text} = {default}" if defaults and default is not None else text


def _keywords(op: Operator, *, out: bool = True) -> list[str]:
    kw = ["*"]
    if out:
        kw.append(f"out: {op.out_annotation} = None")
    return [
        *kw,
        "priority: int = 0",
        "deadline: float | None = None",
        "timeout: float | None = None",
    ]


def _args_tuple(op: Operator) -> str:
    names = [p.name for p in op.parameters]
    return f"({', '.join(names)},)" if len(names) == 1 else f"({', '.join(names)})"


def _doc(lines: Sequence[str], indent: str) -> list[str]:
    """A docstring of ``lines``, each wrapped to the line width (continuations of an
    indented line, such as an ``Args:`` entry, indented four more)."""
    wrapped: list[str] = []
    for k, line in enumerate(lines):
        if not line:
            wrapped.append("")
            continue
        lead = " " * (len(line) - len(line.lstrip()))
        first = f'{indent}"""' if k == 0 else indent
        more = indent + (lead + "    " if lead else "")
        wrapped += textwrap.wrap(
            line.lstrip(),
            WIDTH - 3,  # room for a closing quote on a one-line docstring
            initial_indent=first + lead,
            subsequent_indent=more,
            break_on_hyphens=False,
        )
    if len(wrapped) == 1:
        return [wrapped[0] + '"""']
    return [*wrapped, f'{indent}"""']


def _args_doc(op: Operator, extra: Sequence[tuple[str, str]] = ()) -> list[str]:
    lines = ["Args:"]
    for p in op.parameters:
        lines.append(f"    {p.name}: {p.doc}")
    for name, text in extra:
        lines.append(f"    {name}: {text}")
    return lines


_WAIT_DOCS = (
    ("out, priority, deadline, timeout", "as :meth:`submit` (``out`` allocated when None)."),
)


# ------------------------------------------------------------------------- the regions


def scheduler_methods(op: Operator) -> list[str]:
    """The one typed signature of the operator: its awaitable Scheduler method (and the
    ``_nowait`` twin, typed from it)."""
    i, params = "    ", [_param(op, p) for p in op.parameters] + _keywords(op)
    call = [_const(op), _args_tuple(op), "out", *WAIT_KW]
    # A plain function returning the engine's coroutine (awaited the same way): a
    # coroutine of its own, or a hop through the face's submit(), would be one more call
    # a request.
    returns = f"Coroutine[Any, Any, {op.result_annotation}]"
    lines = _signature(op.method, "sched", params, returns, i)
    lines += _doc(
        [
            op.summary,
            "",
            "Awaitable (a coroutine): ``await`` it for the result.",
            "",
            *_args_doc(op, _WAIT_DOCS),
            "",
            "Raises: as :meth:`submit`.",
        ],
        i * 2,
    )
    lines += _call("return sched._engine.submit(", call, i * 2)
    lines.append("")
    lines.append(f"{i}{op.method}_nowait = _nowait({_const(op)}, {op.method})")
    return lines


def graph_methods(op: Operator) -> list[str]:
    return [f"    {op.method} = _node({_const(op)}, Scheduler.{op.method})"]


def module_functions(op: Operator) -> list[str]:
    """``opsched.<op>``: the method's signature, handing the call to the current
    scheduler's engine as the method does (no hop through the method itself)."""
    params = [_param(op, p) for p in op.parameters] + _keywords(op)
    call = [_const(op), _args_tuple(op), "out", *WAIT_KW]
    returns = f"Coroutine[Any, Any, {op.result_annotation}]"
    lines = _signature(op.method, None, params, returns, "")
    lines += _doc(
        [
            f"{op.name} (``aclnn{op.name}``) on the current scheduler, found when it is "
            f"called: see :meth:`Scheduler.{op.method}`."
        ],
        "    ",
    )
    lines += _call("return _here().engine.submit(", call, "    ")
    return lines


def sync_methods(op: Operator) -> list[str]:
    m, const = op.method, _const(op)
    return [
        f"    {m} = _blocking({const}, Scheduler.{m})",
        f"    submit_{m} = _threadsafe({const}, Scheduler.{m})",
    ]


def sync_functions(op: Operator) -> list[str]:
    return [f"{op.method} = _on_default(SyncScheduler.{op.method})"]


def aclnn_functions(op: Operator) -> list[str]:
    const = _const(op)
    return [
        f"{op.method}_get_workspace_size = _planner({const})",
        f"{op.method} = _launcher({const})",
    ]


Region = Callable[["Operator"], list[str]]

#: file -> region name -> how each operator's part of it is written.
REGIONS: dict[str, dict[str, Region]] = {
    "opsched/_api.py": {
        "scheduler": scheduler_methods,
        "graph": graph_methods,
        "functions": module_functions,
    },
    "opsched/sync.py": {
        "sync scheduler": sync_methods,
        "functions": sync_functions,
    },
    "opsched/aclnn.py": {"functions": aclnn_functions},
}


def render(region: str, writer: Region) -> list[str]:
    """Each operator's part of a region, blank lines between multi-line parts as ruff
    wants them (one in a class, two at module level)."""
    lines: list[str] = []
    part: list[str] = []
    for k, op in enumerate(OPERATORS.values()):
        part = writer(op)
        if k and len(part) > 2:
            lines += [""] if part[0].startswith("    ") else ["", ""]
        lines += part
    if part and part[0].startswith("def "):  # module-level functions: two lines after
        lines += ["", ""]
    return lines


def begin(region: str) -> str:
    return f"# BEGIN GENERATED {region}: scripts/gen_entry_points.py writes this; do not edit"


def end(region: str) -> str:
    return f"# END GENERATED {region}"


def regenerate(path: pathlib.Path, regions: dict[str, Region]) -> str:
    text = path.read_text()
    for region, writer in regions.items():
        head, tail = begin(region), end(region)
        start = text.index(head)
        stop = text.index(tail, start)
        indent = text[text.rindex("\n", 0, start) + 1 : start]
        body = "\n".join(render(region, writer))
        text = f"{text[: start + len(head)]}\n{body}\n{indent}{text[stop:]}"
    return text


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if a region is stale")
    args = parser.parse_args(argv)
    stale = []
    for name, regions in REGIONS.items():
        path = ROOT / name
        new = regenerate(path, regions)
        if new != path.read_text():
            stale.append(name)
            if not args.check:
                path.write_text(new)
    if args.check and stale:
        print(f"out of date: {', '.join(stale)}; run python scripts/gen_entry_points.py")
        return 1
    if not args.check:
        print(f"rewrote: {', '.join(stale)}" if stale else "up to date")
    return 0


if __name__ == "__main__":
    sys.exit(main())
