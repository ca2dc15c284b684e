"""The stress harness: a short run in CI, and proof that its checks can fail."""

from __future__ import annotations

import io
import json
import subprocess
import sys

import pytest

from opsched.cli.stress import StressOptions, run_stress
from opsched.core.dispatch import Dispatcher
from opsched.devices.pool import WorkspacePool
from opsched.ops.glu_backward import GluBackward

SMALL = {"requests": 1500, "clients": 8, "sync_clients": 1, "templates": 64, "watchdog": 3.0}


def stress(**options):
    out = io.StringIO()
    status = run_stress(StressOptions(**options), out)
    return status, out.getvalue()


def test_ci_run_of_20000_requests_passes(tmp_path):
    report = tmp_path / "report.json"
    status, text = stress(requests=20000, clients=64, sync_clients=2, report=str(report))
    assert status == 0, text
    data = json.loads(report.read_text())
    assert data["ok"] and data["requests"] == 20000
    assert all(check["held"] for check in data["checks"].values())
    # every kind of case was exercised
    assert {"completed", "invalid", "cancelled", "expired", "faulted"} <= set(data["outcomes"])
    assert data["scheduler"]["graph_runs"] > 0 and data["scheduler"]["queued_peak"] > 1
    assert data["latency_ms"]["p99"] >= data["latency_ms"]["p50"] > 0


def test_reference_device_run_passes():
    status, text = stress(device="reference", **SMALL)
    assert status == 0, text


def test_replay_runs_one_request():
    status, text = stress(replay=123, **SMALL)
    assert status == 0 and "1 requests" in text.splitlines()[0], text


def broken(monkeypatch, what: str) -> None:
    """Break the scheduler one way, for a few requests only."""
    if what == "drops":
        real = Dispatcher._resolve

        def drop(self, request):
            if request.id % 211 == 7 and request.graph is None:
                return  # never resolved
            real(self, request)

        monkeypatch.setattr(Dispatcher, "_resolve", drop)
    elif what == "duplicates":
        real = Dispatcher._resolve

        def twice(self, request):
            real(self, request)
            if request.id % 97 == 5:
                self.counters.completed += 1  # resolved (counted) a second time

        monkeypatch.setattr(Dispatcher, "_resolve", twice)
    elif what == "corrupts":
        real = GluBackward.scatter

        def corrupt(self, requests, fused, offsets):
            real(self, requests, fused, offsets)
            for r in requests:
                out = r.tensors["out"]
                if r.id % 13 == 3 and out.size:
                    out.reshape(-1)[0] += 1  # one wrong element

        monkeypatch.setattr(GluBackward, "scatter", corrupt)
    elif what == "leaks":
        real = WorkspacePool.release
        calls = {"n": 0}

        def leak(self, block, event=None):
            calls["n"] += 1
            if calls["n"] == 5:
                return  # this block never comes back
            real(self, block, event)

        monkeypatch.setattr(WorkspacePool, "release", leak)


@pytest.mark.parametrize(
    ("what", "check"),
    [
        ("drops", "every request resolved exactly once"),
        ("duplicates", "statistics add up"),
        ("corrupts", "every result right"),
        ("leaks", "workspace blocks all returned"),
    ],
)
def test_a_broken_scheduler_is_reported(monkeypatch, what, check):
    broken(monkeypatch, what)
    status, text = stress(**SMALL)
    assert status == 1, text
    line = next(line for line in text.splitlines() if line.strip().startswith(check))
    assert "FAILED" in line, text
    assert "verdict: FAIL" in text


def test_command_line_with_report(tmp_path):
    report = tmp_path / "r.json"
    proc = subprocess.run(
        [sys.executable, "-m", "opsched", "stress", "--requests", "400", "--clients", "4",
         "--sync-clients", "1", "--templates", "32", "--report", str(report), "--progress"],
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "verdict: PASS" in proc.stdout and "req" in proc.stderr  # tqdm drew its bar
    assert json.loads(report.read_text())["requests"] == 400


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (["--cancel", "1.5"], "--cancel=1.5 is out of range"),
        (["--invalid", "0.6", "--fault", "0.6"], "add up to 1.2"),
        (["--clients", "0", "--sync-clients", "0"], "at least one client"),
        (["--requests", "0"], "--requests=0 must be >= 1"),
    ],
)
def test_bad_options_are_clear_errors(args, words):
    proc = subprocess.run(
        [sys.executable, "-m", "opsched", "stress", *args],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert proc.returncode == 2 and words in proc.stderr, proc.stderr
