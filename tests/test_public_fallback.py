"""Every private internal of another package sits behind a gate with a public fallback,
and the fallbacks compute what the internals do: the scheduler's and the kernels' suites
run again with ``OPSCHED_PUBLIC_ONLY=1`` (opsched/_compat.py, kernels/_jit.py)."""

from __future__ import annotations

import ast
import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent

#: The modules that read another package's internals, each behind its gate.
GATED = {
    "opsched/core/loop.py": ("ANYIO_INTERNALS", "PYTHON_INTERNALS"),
    "opsched/core/requests.py": ("PYTHON_INTERNALS",),
    "kernels/_jit.py": ("NUMBA_INTERNALS",),
    "kernels/_cache.py": ("internals",),
}

#: Private-looking modules that are documented public API.
PUBLIC_UNDERSCORED = {"__future__", "_thread"}

#: Internal modules without an underscore: numba's public API is ``numba``,
#: ``numba.types`` and ``numba.extending``; its compiler's modules are its own.
INTERNAL_MODULES = ("numba.core", "numba.np", "numba.cpython", "numba.misc")

#: The suites run with every fallback forced: the scheduler on both loops, the thread
#: futures, the kernels' bits, the two-phase API.
SUITES = (
    "tests/core",
    "tests/test_sync.py",
    "tests/test_sync_in_caller.py",
    "tests/test_module_api.py",
    "tests/test_bad_input.py",
    "tests/test_bits.py",
    "tests/test_readonly_inputs.py",
    "tests/test_aclnn.py",
    "tests/ops/test_jit.py",
    "tests/ops/test_kernels.py",
)


def _private_uses(path: pathlib.Path) -> list[str]:
    """Imports of another package's private modules or names, and ``getattr`` of a
    private attribute by name, in ``path``."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            modules = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            modules = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id == "getattr"
            and len(node.args) >= 2
            and isinstance(node.args[1], ast.Constant)
            and str(node.args[1].value).startswith("_")
        ):
            found.append(f"{path.relative_to(ROOT)}:{node.lineno} getattr {node.args[1].value}")
            continue
        else:
            continue
        for module in modules:
            parts = module.split(".")
            if parts[0] in ("opsched", "kernels") or parts[0] in PUBLIC_UNDERSCORED:
                continue
            internal = any(module == m or module.startswith(m + ".") for m in INTERNAL_MODULES)
            if internal or any(p.startswith("_") for p in parts):
                found.append(f"{path.relative_to(ROOT)}:{node.lineno} {module}")
    return found


def test_private_internals_are_read_only_in_the_gated_modules():
    sources = [*ROOT.joinpath("opsched").rglob("*.py"), *ROOT.joinpath("kernels").glob("*.py")]
    linked = ROOT / "opsched" / "kernels"  # the link to kernels/, checked as itself
    uses = [u for p in sources if linked not in p.parents for u in _private_uses(p)]
    ungated = [u for u in uses if u.split(":")[0] not in GATED]
    assert not ungated, "\n".join(ungated)
    assert {u.split(":")[0] for u in uses} == set(GATED)  # the scan sees what is there
    for module, gates in GATED.items():
        text = (ROOT / module).read_text()
        assert all(gate in text for gate in gates), module


def test_the_gates_close_when_the_fallbacks_are_forced():
    probe = """
import asyncio
from opsched import _compat
from opsched.core import loop, requests
from kernels import _jit

async def main():
    handle = loop.current_loop()
    return handle.ready(), handle.cancelled is loop._always

ready, always = asyncio.run(main())
print(_compat.PYTHON_INTERNALS, _compat.ANYIO_INTERNALS, _jit.NUMBA_INTERNALS,
      requests.new_request_future is requests.RequestFuture,
      ready == loop.UNKNOWN_READY, always, _jit.lanes is _jit._heap_lanes,
      _jit.fold is _jit._scalar_fold)
"""
    env = {**os.environ, "OPSCHED_PUBLIC_ONLY": "1"}
    out = subprocess.run(
        [sys.executable, "-c", probe], env=env, cwd=ROOT, capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["False"] * 3 + ["True"] * 5


@pytest.mark.timeout(900)
def test_the_suites_pass_with_every_public_fallback(tmp_path):
    # A cache directory of its own: the kernels compiled with the public loops never
    # meet those compiled with numba's internals (their fingerprints differ too).
    env = {**os.environ, "OPSCHED_PUBLIC_ONLY": "1", "NUMBA_CACHE_DIR": str(tmp_path)}
    env.pop("PYTEST_ADDOPTS", None)
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", *SUITES],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
