"""The command line and the set-up promise."""

from __future__ import annotations

import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_demo_runs_and_prints_both_operators():
    proc = subprocess.run(
        [sys.executable, "-m", "opsched", "demo"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    assert "GluBackward" in proc.stdout and "GroupNormalizationGrad" in proc.stdout
    assert "0.334656" in proc.stdout  # sigmoid(-0.6872), the seed's first gradient
    assert proc.stdout.count("results bit-identical to solo launches: True") == 2
    assert "2560 requests in" in proc.stdout and "5000 requests in" in proc.stdout


def test_unknown_command_fails_with_usage():
    proc = subprocess.run(
        [sys.executable, "-m", "opsched", "frobnicate"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert proc.returncode == 2 and "invalid choice" in proc.stderr


def test_ci_runs_the_readme_test_command():
    readme = (ROOT / "README.md").read_text()
    ci = (ROOT / ".ci" / "run").read_text()
    assert "<!-- test-command -->" in readme and "<!-- demo-command -->" in readme
    assert "test-command" in ci
