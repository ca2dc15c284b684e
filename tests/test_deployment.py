"""Deploying the library: importing compiles nothing, a kernel compiles when a request first
needs it, and a read-only install with no writable directory imports and computes."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import opsched
from opsched.cli.main import main
from opsched.kernels import _jit

ROOT = Path(opsched.__file__).resolve().parent.parent

_FIRST_CALL = """
import numpy as np
import opsched
from opsched.kernels import _jit

print(_jit.compiled())
import opsched.sync

out = opsched.sync.glu_backward(np.ones((8, 32), np.float32), np.ones((8, 64), np.float32))
print(_jit.compiled())
print(float(out[0, 0]))
"""


def _python(code: str, env: dict[str, str] | None = None, prefix: list[str] | None = None):
    return subprocess.run(
        [*(prefix or []), sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=110,
        env=env,
        check=False,
    )


def test_import_compiles_nothing_and_a_call_compiles_only_its_own_kernel():
    proc = _python(_FIRST_CALL)
    assert proc.returncode == 0, proc.stderr
    before, after, value = proc.stdout.splitlines()
    assert before == "[]"
    assert after == "['opsched.kernels.glu._glu_rows_float32']"
    assert float(value) == pytest.approx(0.5 * (1 / (1 + np.exp(-1.0))) * 2, rel=1e-6)


def test_warm_compiles_every_entry_point(capsys):
    assert main(["warm"]) == 0
    assert "27 kernel entry points" in capsys.readouterr().out
    assert len(_jit.compiled()) == 27
    names = {name.rsplit(".", 1)[1] for name in _jit.compiled()}
    assert {
        "_glu_bfloat16",
        "_glu_rows_float16",
        "_gn_rows_float32",
        "_gn_float16",
        "_gnb_float32",
        "_sigmoid_loop",
    } <= names
    assert {"_glu_table_float16", "_gnb_table_float32", "_addresses3", "_addresses8"} <= names


def _can_mount_read_only() -> bool:
    if shutil.which("unshare") is None:
        return False
    probe = subprocess.run(
        ["unshare", "-rm", "sh", "-c", f"mount --bind -o ro {ROOT} {ROOT}"],
        capture_output=True,
        check=False,
    )
    return probe.returncode == 0


_READ_ONLY = """
import logging

logging.basicConfig(level=logging.INFO, format="%(name)s %(message)s")
import numpy as np
import opsched.sync

rng = np.random.default_rng(0)
x = rng.standard_normal((4, 64)).astype(np.float32)
out = opsched.sync.glu_backward(np.ones((4, 32), np.float32), x)
print(out.shape)
"""


@pytest.mark.skipif(not _can_mount_read_only(), reason="needs unshare and bind mounts")
def test_a_read_only_install_without_a_home_imports_and_computes(tmp_path):
    # The checkout and the interpreter's tree are mounted read-only, HOME points into
    # them: numba finds no directory to cache in, so the kernels compile in memory.
    prefix = Path(sys.base_prefix).resolve()
    script = tmp_path / "run.sh"
    script.write_text(
        f"mount --bind -o ro {ROOT} {ROOT} && mount --bind -o ro {prefix} {prefix} && "
        f'exec {sys.executable} -c "$OPSCHED_CODE"\n'
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith(("NUMBA_", "XDG_"))}
    env.update(HOME=str(ROOT / "no-such-home"), OPSCHED_CODE=_READ_ONLY)
    proc = subprocess.run(
        ["unshare", "-rm", "sh", str(script)],
        capture_output=True,
        text=True,
        timeout=110,
        env=env,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "(4, 64)"
    said = [line for line in proc.stderr.splitlines() if line.startswith("opsched.kernels")]
    assert len(said) == 1 and "compiling them in memory" in said[0], proc.stderr
