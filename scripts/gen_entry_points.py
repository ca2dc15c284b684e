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
    *,
    is_async: bool = False,
) -> list[str]:
    lead = f"{indent}{'async ' if is_async else ''}def {name}("
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
        *kw, "priority: int = 0", "deadline: float | None = None", "timeout: float | None = None"
    ]


def _args_tuple(op: Operator) -> str:
    names = [p.name for p in op.parameters]
    return f"({', '.join(names)},)" if len(names) == 1 else f"({', '.join(names)})"


def _dict(name: str, items: Sequence[str], indent: str) -> list[str]:
    """``name = {items}`` (annotated when empty, for the type checker)."""
    if not items:
        return [f"{indent}{name}: dict[str, Any] = {{}}"]
    return _call(f"{name} = {{", items, indent, "}")


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
    ("out", "where to write the result (allocated when None)."),
    ("priority", "higher runs first; FIFO among equal priorities."),
    ("deadline", "absolute ``time.monotonic()`` by which the request must have launched."),
    ("timeout", "seconds from now, an alternative to ``deadline`` (the earlier wins)."),
)


# ------------------------------------------------------------------------- the regions


def scheduler_methods(op: Operator) -> list[str]:
    i, params = "    ", [_param(op, p) for p in op.parameters] + _keywords(op)
    call = [_const(op), _args_tuple(op), "out", *WAIT_KW]
    lines = _signature(op.method, "sched", params, op.result_annotation, i, is_async=True)
    lines += _doc(
        [op.summary, "", *_args_doc(op, _WAIT_DOCS), "", "Raises: as :meth:`submit`."], i * 2
    )
    lines += _call("return await sched.submit(", call, i * 2)
    lines.append("")
    lines += _signature(f"{op.method}_nowait", "sched", params, "Pending", i)
    lines += _doc(
        [
            f"Queue a {op.name} without waiting; ``await`` the returned :class:`Pending`.",
            "",
            f"Arguments as :meth:`{op.method}`; raises as :meth:`submit_nowait`.",
        ],
        i * 2,
    )
    lines += _call("return sched.submit_nowait(", call, i * 2)
    return lines


def module_functions(op: Operator) -> list[str]:
    params = [_param(op, p) for p in op.parameters] + _keywords(op)
    lines = _signature(op.method, None, params, op.result_annotation, "", is_async=True)
    text = f"{op.name} on the current scheduler; see :meth:`Scheduler.{op.method}`."
    lines += _doc([text], "    ")
    lines.append("    scheduler = await current_scheduler()")
    call = [_const(op), _args_tuple(op), "out", *WAIT_KW]
    lines += _call("return await scheduler.submit(", call, "    ")
    return lines


def graph_methods(op: Operator) -> list[str]:
    i = "    "
    params = [_param(op, p, tensor_type="Any") for p in op.parameters]
    params += ["*", "name: str | None = None"]
    lines = _signature(op.method, "graph", params, "Node", i)
    text = [
        f"Add a {op.name} node (arguments as :meth:`Scheduler.{op.method}`; nodes and",
        "placeholders may stand for arrays).",
        "",
        "Raises:",
        "    ParamNullptrError, ParamInvalidError, TypeError: the SPEC checks, at once,",
        "        naming the node.",
    ]
    lines += _doc(text, i * 2)
    tensors = [f'"{p.name}": {p.name}' for p in op.parameters if p.name in op.tensor_names]
    scalars = [f'"{p.name}": {p.name}' for p in op.parameters if p.name not in op.tensor_names]
    lines += _call("args = {", tensors, i * 2, "}")
    lines += _dict("scalars", scalars, i * 2)
    lines.append(f"{i * 2}return graph.add({_const(op)}, args, scalars, name)")
    return lines


def sync_methods(op: Operator) -> list[str]:
    i, params = "    ", [_param(op, p) for p in op.parameters] + _keywords(op)
    names = [p.name for p in op.parameters]
    kw = ["out=out", *(f"{k}={k}" for k in WAIT_KW)]
    lines = _signature(op.method, "facade", params, op.result_annotation, i)
    lines += _doc([f"Blocking :meth:`Scheduler.{op.method}` (same arguments and errors)."], i * 2)
    lines += _call(f"return facade.submit_{op.method}(", [*names, *kw], i * 2, ").result()")
    lines.append("")
    future = f"Future[{op.result_annotation}]"
    lines += _signature(f"submit_{op.method}", "facade", params, future, i)
    lines += _doc(
        [
            f"Queue a {op.name}; the future resolves with its result (or raises its error).",
            "",
            "Bad arguments raise here, at once. ``future.cancel()`` withdraws a queued request.",
        ],
        i * 2,
    )
    lines.append(f"{i * 2}facade._portal.check_thread()")
    call = [_const(op), _args_tuple(op), "out", *(f"{k}={k}" for k in WAIT_KW)]
    lines += _call("return facade.scheduler.submit_threadsafe(", call, i * 2)
    return lines


def sync_functions(op: Operator) -> list[str]:
    params = [_param(op, p) for p in op.parameters] + _keywords(op)
    names = [p.name for p in op.parameters]
    kw = ["out=out", *(f"{k}={k}" for k in WAIT_KW)]
    lines = _signature(op.method, None, params, op.result_annotation, "")
    lines += _doc(
        [
            f"Blocking {op.name} on the process-wide default scheduler (started on first",
            "use, stopped at interpreter exit); see :meth:`Scheduler."
            f"{op.method}`.",
        ],
        "    ",
    )
    lines += _call(f"return _default_scheduler().{op.method}(", [*names, *kw], "    ")
    return lines


def aclnn_functions(op: Operator) -> list[str]:
    params = [_param(op, p, defaults=False) for p in op.parameters]
    params += [f"{name}: {op.output_annotation}" for name in op.outputs]
    params += ["*", 'product: str = "generic"']
    aclnn = f"aclnn{op.name}"
    lines = _signature(
        f"{op.method}_get_workspace_size", None, params, "tuple[int, Executor]", ""
    )
    outs = [(name, "an output, written by the launch.") for name in op.outputs]
    outs.append(("product", "check as this Ascend product's runtime would (``opsched products``)."))
    lines += _doc(
        [
            f"Check a {op.name} call and plan it (``{aclnn}GetWorkspaceSize``).",
            "",
            *_args_doc(op, outs),
            "",
            "Returns:",
            "    ``(workspace_size, executor)``.",
            "",
            "Raises:",
            "    InnerError: ``product`` lacks the operator (561003).",
            "    ParamNullptrError: a required tensor is None (161001).",
            "    ParamInvalidError: a dtype, rank, shape or scalar is wrong (161002), in SPEC",
            "        order.",
            "    TypeError: an argument of the wrong kind.",
        ],
        "    ",
    )
    tensors = [f'"{n}": {n}' for n in op.tensor_names]
    scalars = [f'"{p.name}": {p.name}' for p in op.parameters if p.name not in op.tensor_names]
    lines += _call("tensors = {", tensors, "    ", "}")
    lines += _dict("scalars", scalars, "    ")
    lines.append(f"    return get_workspace_size({_const(op)}, tensors, scalars, product)")
    lines += ["", ""]
    launch_params = [
        "workspace: np.ndarray | None",
        "workspace_size: int",
        "executor: Executor",
        "stream: Any = None",
    ]
    lines += _signature(op.method, None, launch_params, "None", "")
    lines += _doc(
        [
            f"Launch a planned {op.name} (``{aclnn}``).",
            "",
            "Raises:",
            "    ParamInvalidError: executor misuse or a too-small workspace (161002).",
            "    InnerError: ``executor`` is None (561103).",
            "    RuntimeLaunchError: the kernel failed (361001), its exception chained.",
        ],
        "    ",
    )
    lines.append(f"    launch({_const(op)}, workspace, workspace_size, executor, stream)")
    return lines


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
    lines: list[str] = []
    indented = writer(next(iter(OPERATORS.values())))[0].startswith("    ")
    for k, op in enumerate(OPERATORS.values()):
        if k:
            lines += [""] if indented else ["", ""]
        lines += writer(op)
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
