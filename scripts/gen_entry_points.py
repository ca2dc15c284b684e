"""Write every operator's public entry points from its description (``opsched/ops/``).

Each operator is described once (its parameters, summary and types, in its module); this
script writes the typed, documented entry points of every face from those descriptions,
between ``BEGIN GENERATED`` / ``END GENERATED`` markers:

- ``opsched/_api.py``: ``Scheduler.<op>`` / ``<op>_nowait``, module-level ``opsched.<op>``,
  ``Graph.<op>``;
- ``opsched/sync.py``: ``SyncScheduler.<op>`` / ``submit_<op>``, ``opsched.sync.<op>``;
- ``opsched/aclnn.py``: ``<op>_get_workspace_size`` and ``<op>`` (the two-phase call);
- ``opsched/ops/<op>.py``: the operator's fast paths over its positional arguments
  (``call_tensors``, ``arguments``, ``signature``), flat code from its parameters.

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
import subprocess
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

_OPS = _load_descriptions()
OPERATORS: dict[str, Operator] = _OPS.OPERATORS
_Parameter: type[Parameter] = _OPS.Parameter
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
    call = [f"({_const(op)}", _args_tuple(op), "out", *WAIT_KW[:-1], f"{WAIT_KW[-1]})"]
    # A plain function returning the engine's coroutine (awaited the same way): a
    # coroutine of its own, or a hop through the face's submit(), would be one more call
    # a request. The call travels as one value, a Call (a plain tuple).
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
    call = [f"({_const(op)}", _args_tuple(op), "out", *WAIT_KW[:-1], f"{WAIT_KW[-1]})"]
    returns = f"Coroutine[Any, Any, {op.result_annotation}]"
    lines = _signature(op.method, None, params, returns, "")
    lines += _doc(
        [
            f"{op.name} (``aclnn{op.name}``) on the current scheduler, found when it is "
            f"called: see :meth:`Scheduler.{op.method}`."
        ],
        "    ",
    )
    # The current scheduler by C-level lookups alone in steady state (the enclosing
    # block's, else the running asyncio loop's default): finding it costs no Python call,
    # so a module-level call costs what the method's does; _here() does the rest.
    lines += [
        "    opened = _current.get()",
        "    if opened is None or opened.engine.state is not OPEN:",
        "        try:",
        "            opened = _defaults[get_running_loop()]",
        "        except (RuntimeError, KeyError):  # no asyncio loop, or no default yet",
        "            opened = _here()",
        "        if opened.engine.state is not OPEN:",
        "            opened = _here()",
    ]
    lines += _call("return opened.engine.submit(", call, "    ")
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


# ------------------------------------------------- each operator's fast paths (ops/<op>.py)
#
# A repeated call's hot path reads its positional arguments three ways: the key of the
# checks' cache with the tensors of its request (``call_tensors``, one step), the argument
# dicts (``arguments``) and the checks' own key (``signature``). Each is written here from
# the operator's parameters as flat code (no loop, no generic call), falling back to the
# base class's generic version for anything else. A parameter's kind comes from its
# annotation.

#: Annotation -> kind.
KINDS = {
    "np.ndarray": "array",
    "np.ndarray | None": "optional array",
    "int": "int",
    "Sequence[bool]": "bools",
}


def _kind(op: Operator, p: Parameter) -> str:
    kind = KINDS.get(p.annotation)
    if kind is None:
        msg = (
            f"{op.name}.{p.name}: no fast path for a parameter annotated {p.annotation!r}; "
            f"known: {sorted(KINDS)}"
        )
        raise SystemExit(msg)
    return kind


def _var(name: str) -> str:
    """A local name for an argument (``self`` is the method's own)."""
    return f"{name}_" if name == "self" else name


def _guard(op: Operator, p: Parameter, array_test: str) -> str:
    """The test that the argument ``p`` is of the kind the fast path handles."""
    v, kind = _var(p.name), _kind(op, p)
    if kind == "array":
        return array_test.format(v)
    if kind == "optional array":
        return f"({v} is None or {array_test.format(v)})"
    if kind == "int":
        return f"type({v}) is int"
    count = len(p.default_value) if p.default_value is not None else 0
    items = " and ".join(f"type({v}[{i}]) is bool" for i in range(count))
    return f"(type({v}) is tuple and len({v}) == {count} and {items})"


def _key_part(op: Operator, name: str, kind: str) -> list[str]:
    v = _var(name)
    if kind == "array":
        return [f"{v}.shape", f"{v}.dtype"]
    if kind == "optional array":
        return [f"None if {v} is None else ({v}.shape, {v}.dtype)"]
    return [v]


def _unpack(op: Operator, indent: str) -> list[str]:
    """Bind the positional ``args`` to local names, the trailing defaults filled in; else
    hand the call to the generic version (``fallback``, formatted with ``args``)."""
    params = op.parameters
    required = sum(1 for p in params if p.default is None)
    lines: list[str] = []
    for count in range(len(params), required - 1, -1):
        head = "if" if count == len(params) else "elif"
        given = [_var(p.name) for p in params[:count]]
        lines.append(f"{indent}{head} count == {count}:")
        target = given[0] + "," if len(given) == 1 else ", ".join(given)
        lines.append(f"{indent}    {target} = args")
        for p in params[count:]:
            lines.append(f"{indent}    {_var(p.name)} = {p.default}")
    return lines


def fast_paths(op: Operator) -> list[str]:
    """The operator's ``call_tensors``, ``arguments`` and ``signature``."""
    i, ii, iii = "    ", "        ", "            "
    params = op.parameters
    tensors = [p for p in params if p.name in op.tensor_names]
    scalars = [p for p in params if p.name not in op.tensor_names]
    kinds = {p.name: _kind(op, p) for p in params}
    multi = len(op.outputs) > 1
    entries = [f'"{p.name}": {_var(p.name)}' for p in tensors]
    entries += [f'"{name}": {"None" if multi else "out"}' for name in op.outputs]
    lines = [
        f"{i}def call_tensors(",
        f"{ii}self, args: Sequence[Any], out: Any",
        f"{i}) -> tuple[Hashable | None, dict[str, Any] | None]:",
    ]
    lines += _doc(["The checks' cache key of a positional call and its tensors (generated)."], ii)
    lines.append(f"{ii}count = len(args)")
    lines += _unpack(op, ii)
    lines += [f"{ii}else:", f"{iii}return super().call_tensors(args, out)"]
    guards = [_guard(op, p, "type({0}) in kinds") for p in params]
    lines.append(f"{ii}kinds = ARRAY_TYPES")
    lines.append(f"{ii}if (")
    lines += [f"{iii}{g}" if k == 0 else f"{iii}and {g}" for k, g in enumerate(guards)]
    lines.append(f"{ii}):")
    parts = [x for p in params for x in _key_part(op, p.name, kinds[p.name])]
    lines.append(f"{iii}return (")
    lines += [f"{iii}    {x}," for x in parts]
    if multi:  # outputs given: a tuple, checked by ``arguments``
        lines.append(f"{iii}), (")
        lines.append(f"{iii}    self.arguments(args, out)[0]")
        lines.append(f"{iii}    if out is not None")
        lines.append(f"{iii}    else {{")
        lines += [f"{iii}        {e}," for e in entries]
        lines.append(f"{iii}    }}")
        lines.append(f"{iii})")
    else:
        lines.append(f"{iii}), {{")
        lines += [f"{iii}    {e}," for e in entries]
        lines.append(f"{iii}}}")
    lines.append(f"{ii}return super().call_tensors(args, out)")
    lines.append("")
    # arguments
    lines.append(
        f"{i}def arguments(self, args: Sequence[Any], out: Any) -> "
        "tuple[dict[str, Any], dict[str, Any]]:"
    )
    lines += _doc(["The argument dicts of a positional call (generated)."], ii)
    lines.append(f"{ii}count = len(args)")
    lines += _unpack(op, ii)
    lines += [f"{ii}else:", f"{iii}return super().arguments(args, out)"]
    if multi:
        lines += [f"{ii}if out is not None:", f"{iii}return super().arguments(args, out)"]
    scalar_entries = [f'"{p.name}": {_var(p.name)}' for p in scalars]
    lines.append(f"{ii}return (")
    lines.append(f"{iii}{{")
    lines += [f"{iii}    {e}," for e in entries]
    lines.append(f"{iii}}},")
    lines.append(f"{iii}{{" + ", ".join(scalar_entries) + "},")
    lines.append(f"{ii})")
    lines.append("")
    # signature
    lines.append(
        f"{i}def signature(self, tensors: Mapping[str, Any], scalars: Mapping[str, Any]) -> "
        "Hashable | None:"
    )
    lines += _doc(["The checks' own cache key of a request (generated)."], ii)
    names = [*(p.name for p in tensors), *op.outputs]
    for name in names:
        lines.append(f'{ii}{_var(name)} = tensors["{name}"]')
    for p in scalars:
        lines.append(f'{ii}{_var(p.name)} = scalars["{p.name}"]')
    sig_kinds = {**kinds, **{name: "optional array" for name in op.outputs}}
    fake = {name: _Parameter(name, _annotation(sig_kinds[name]), "") for name in op.outputs}
    sig_params = [*tensors, *fake.values(), *scalars]
    guards = [_guard(op, p, "type({0}) is np.ndarray") for p in sig_params]
    lines.append(f"{ii}if (")
    lines += [f"{iii}{g}" if k == 0 else f"{iii}and {g}" for k, g in enumerate(guards)]
    lines.append(f"{ii}):")
    parts = [x for p in sig_params for x in _key_part(op, p.name, sig_kinds[p.name])]
    lines.append(f"{iii}return (")
    lines += [f"{iii}    {x}," for x in parts]
    lines.append(f"{iii})")
    lines.append(f"{ii}return super().signature(tensors, scalars)")
    return lines


def _annotation(kind: str) -> str:
    return next(a for a, k in KINDS.items() if k == kind)


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


def _only(op: Operator) -> Region:
    """:func:`fast_paths` of ``op`` alone (its own module's region)."""

    def writer(other: Operator) -> list[str]:
        return fast_paths(other) if other is op else []

    return writer


for _op in OPERATORS.values():
    _module = type(_op).__module__.replace(".", "/") + ".py"
    REGIONS[_module] = {"fast paths": _only(_op)}


def render(region: str, writer: Region) -> list[str]:
    """Each operator's part of a region, blank lines between multi-line parts as ruff
    wants them (one in a class, two at module level)."""
    lines: list[str] = []
    for op in OPERATORS.values():
        part = writer(op)
        if not part:
            continue
        if lines and len(part) > 2:
            lines += [""] if part[0].startswith("    ") else ["", ""]
        lines += part
    if lines and lines[0].startswith("def "):  # module-level functions: two lines after
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
    return _formatted(text, path)


def _formatted(text: str, path: pathlib.Path) -> str:
    """``text`` as ``ruff format`` writes it (the project's formatter, a dev dependency):
    the regions are written plainly and laid out by the same tool as the rest."""
    run = subprocess.run(
        [sys.executable, "-m", "ruff", "format", "--stdin-filename", str(path), "-"],
        input=text,
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    if run.returncode != 0:
        msg = f"ruff format failed on {path}: {run.stderr.strip()}"
        raise SystemExit(msg)
    return run.stdout


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
