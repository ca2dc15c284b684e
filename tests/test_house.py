"""The house rules (docs/architecture.md), read from the code's own imports.

Each rule names its room and what it must never import or name; a module that breaks one
fails here with the file, the line and the import. Also: no module over 800 lines, every
module opens with a docstring, ``import opsched`` reaches ``opsched.sync`` and
``opsched.aclnn``, and the generated entry points match the operator descriptions.
"""

from __future__ import annotations

import ast
import io
import pathlib
import subprocess
import sys
import tokenize

import pytest

from opsched.ops import OPERATORS

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "opsched"
KERNELS = ROOT / "kernels"
MAX_LINES = 800


def _modules(folder: pathlib.Path) -> list[pathlib.Path]:
    """Python files of a room (the link opsched/kernels is kernels/, checked as itself)."""
    linked = PACKAGE / "kernels"
    return sorted(p for p in folder.rglob("*.py") if linked not in p.parents or folder == KERNELS)


def _imports(path: pathlib.Path) -> list[tuple[int, str]]:
    """``(line, module)`` for every import in ``path``, relative ones made absolute."""
    tree = ast.parse(path.read_text(), str(path))
    if path.is_relative_to(KERNELS):
        package = ["opsched", "kernels", *path.relative_to(KERNELS).parts[:-1]]
    else:
        package = list(path.relative_to(ROOT).parts[:-1])
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join([*package[: len(package) - node.level + 1], base]).strip(".")
            found.append((node.lineno, base))
            # ``from opsched import ops`` imports the module opsched.ops
            found += [(node.lineno, f"{base}.{alias.name}") for alias in node.names]
    return found


def _room(path: pathlib.Path) -> str:
    return str(path.relative_to(ROOT))


def _breaks(files: list[pathlib.Path], forbidden: tuple[str, ...]) -> list[str]:
    """The imports of ``files`` that are, or are inside, a ``forbidden`` module."""
    return [
        f"{_room(path)}:{line} imports {module}"
        for path in files
        for line, module in _imports(path)
        if any(module == f or module.startswith(f + ".") for f in forbidden)
    ]


OPERATOR_MODULES = tuple(type(op).__module__ for op in OPERATORS.values())
SPECIFIC_DEVICES = ("opsched.devices.host", "opsched.devices.torch")
CORE = _modules(PACKAGE / "core")
#: Everything but the CLI room (``opsched/cli/`` and ``python -m opsched``).
LIBRARY = [
    p
    for p in _modules(PACKAGE)
    if not p.is_relative_to(PACKAGE / "cli") and p != PACKAGE / "__main__.py"
]


@pytest.mark.parametrize(
    ("room", "files", "forbidden"),
    [
        (
            "kernels never import opsched",
            _modules(KERNELS),
            (
                "opsched.core",
                "opsched.ops",
                "opsched.devices",
                "opsched.cli",
                "opsched._api",
                "opsched._errors",
                "opsched.sync",
                "opsched.aclnn",
                "kernels",
            ),
        ),
        (
            "the core never imports torch, the kernels, the CLI, a specific device or an "
            "operator module",
            CORE,
            (
                "torch",
                "torch_npu",
                "opsched.kernels",
                "kernels",
                "opsched.cli",
                *SPECIFIC_DEVICES,
                *OPERATOR_MODULES,
            ),
        ),
        ("devices never import the core", _modules(PACKAGE / "devices"), ("opsched.core",)),
        (
            "operators never import the core or the devices",
            _modules(PACKAGE / "ops"),
            ("opsched.core", "opsched.devices", "opsched.cli", "torch"),
        ),
        ("the library never imports the CLI", LIBRARY, ("opsched.cli",)),
        (
            "torch only in the torch devices' folder and the CLI",
            [p for p in LIBRARY if not p.is_relative_to(PACKAGE / "devices" / "torch")],
            ("torch", "torch_npu"),
        ),
    ],
)
def test_import_rule(room, files, forbidden):
    assert files, room
    assert _breaks(files, forbidden) == [], room


def test_the_core_never_names_an_operator():
    names = set()
    for op in OPERATORS.values():
        names |= {op.name, op.method, op.method.upper()}
    found = [
        f"{_room(path)}:{n}: {name}"
        for path in CORE
        for n, line in enumerate(path.read_text().splitlines(), 1)
        for name in sorted(names)
        if name in line
    ]
    assert found == []


def test_sync_imports_no_private_helper():
    tree = ast.parse((PACKAGE / "sync.py").read_text())
    private = [
        f"line {node.lineno}: {alias.name}"
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom) and node.module != "__future__"
        for alias in node.names
        if alias.name.startswith("_") and not (alias.asname or "").startswith("_")
    ]
    assert private == []


def test_no_module_over_800_lines_and_each_says_what_it_is_for():
    too_long, undocumented = [], []
    for path in [*_modules(PACKAGE), *_modules(KERNELS)]:
        text = path.read_text()
        if text.count("\n") > MAX_LINES:
            too_long.append(f"{_room(path)}: {text.count(chr(10))} lines")
        if ast.get_docstring(ast.parse(text)) is None:
            undocumented.append(_room(path))
    assert too_long == []
    assert undocumented == []


def test_import_opsched_reaches_sync_and_aclnn():
    code = (
        "import opsched\n"
        "assert callable(opsched.sync.glu_backward), 'opsched.sync'\n"
        "assert callable(opsched.aclnn.glu_backward_get_workspace_size), 'opsched.aclnn'\n"
        "import sys\n"
        "assert 'torch' not in sys.modules, 'import opsched imported torch'\n"
        "assert 'opsched.cli' not in sys.modules, 'import opsched imported the CLI'\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False
    )
    assert proc.returncode == 0, proc.stderr


def test_no_top_level_kernels_package_is_importable_from_an_install():
    """The kernels install as opsched.kernels: nothing may import a top-level ``kernels``."""
    assert _breaks([*_modules(PACKAGE), *_modules(KERNELS)], ("kernels",)) == []


def test_generated_entry_points_are_up_to_date():
    proc = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "gen_entry_points.py"), "--check"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_every_operator_has_every_entry_point():
    import opsched
    import opsched.aclnn
    import opsched.sync

    for op in OPERATORS.values():
        m = op.method
        faces = {
            "opsched": (opsched, m),
            "Scheduler": (opsched.Scheduler, m),
            "Scheduler nowait": (opsched.Scheduler, f"{m}_nowait"),
            "Graph": (opsched.Graph, m),
            "sync": (opsched.sync, m),
            "SyncScheduler": (opsched.sync.SyncScheduler, m),
            "SyncScheduler submit": (opsched.sync.SyncScheduler, f"submit_{m}"),
            "aclnn plan": (opsched.aclnn, f"{m}_get_workspace_size"),
            "aclnn launch": (opsched.aclnn, m),
        }
        missing = [face for face, (owner, name) in faces.items() if not hasattr(owner, name)]
        assert missing == [], op.name


def test_no_operator_description_names_torch():
    # How a framework computes an operator is its device's launcher
    # (opsched/devices/torch/launchers.py), never the operator's description.
    named = [
        f"{_room(path)}:{token.start[0]}"
        for path in _modules(PACKAGE / "ops")
        for token in tokenize.generate_tokens(io.StringIO(path.read_text()).readline)
        if (token.type == tokenize.NAME and token.string.startswith("torch"))
        or (token.type == tokenize.NAME and token.string.startswith("framework"))
    ]
    assert named == []


def test_the_torch_devices_have_one_launcher_for_every_operator():
    pytest.importorskip("torch")
    from opsched.devices.torch.launchers import LAUNCHERS

    assert sorted(LAUNCHERS) == sorted(OPERATORS)


def _runtime_imports(path: pathlib.Path, room: str) -> set[str]:
    """The modules of ``room`` (``opsched.core``) that ``path`` imports when it runs: its
    imports outside ``if TYPE_CHECKING:`` blocks."""
    found = set()
    for statement in ast.parse(path.read_text()).body:
        if isinstance(statement, ast.If) and "TYPE_CHECKING" in ast.unparse(statement.test):
            continue
        for node in ast.walk(statement):
            if isinstance(node, ast.ImportFrom) and node.module:
                if node.module.startswith(room + "."):
                    found.add(node.module.split(".")[2])
                elif node.module == room:
                    found |= {alias.name for alias in node.names}
    return found


def test_the_core_modules_import_each_other_without_a_cycle():
    modules = {p.stem: p for p in CORE if p.stem != "__init__"}
    edges = {m: _runtime_imports(p, "opsched.core") & set(modules) for m, p in modules.items()}
    done: set[str] = set()

    def visit(module: str, path: list[str]) -> None:
        assert module not in path, " -> ".join([*path[path.index(module) :], module])
        if module in done:
            return
        for imported in sorted(edges[module]):
            visit(imported, [*path, module])
        done.add(module)

    for module in sorted(modules):
        visit(module, [])
    assert edges["engine"] and edges["scheduler"]  # the scan sees the imports there are


def test_an_operator_is_a_description_and_each_device_brings_its_launcher():
    # What runs an operator is its device's: the host devices' launchers (plan, prepared
    # kernel launches, fused layout, gather, scatter) live in opsched/devices/host/, the
    # torch devices' in opsched/devices/torch/; a description defines none of it.
    from opsched.devices.host.launchers import LAUNCHERS
    from opsched.ops import Operator

    launching = {
        "plan",
        "prepare",
        "prepare_reference",
        "reference",
        "fused_geometry",
        "fused_parts",
        "fused_plan",
        "gather",
        "scatter",
        "run",
        "runner",
    }
    for op in OPERATORS.values():
        assert not launching & set(vars(type(op))), op.name
    assert not launching & set(vars(Operator))
    assert sorted(LAUNCHERS) == sorted(OPERATORS)
    assert all(launcher.op is OPERATORS[name] for name, launcher in LAUNCHERS.items())
