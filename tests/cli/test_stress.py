"""The stress harness: a short run in CI, and proof that its checks can fail."""

from __future__ import annotations

import io
import json
import subprocess
import sys
from typing import Any

import numpy as np
import pytest

from opsched.cli.stress import StressOptions, run_stress
from opsched.cli.stress.driver import _replay_command
from opsched.core import dispatch
from opsched.core.engine import Engine
from opsched.devices.host import HostDevice
from opsched.devices.host.glu_backward import GluBackwardLauncher
from opsched.devices.pool import WorkspacePool
from opsched.devices.streams import ThreadStream

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
    # the harness's own time is counted apart: some, and less than the whole run
    assert 0 < data["harness_seconds"] < data["seconds"]
    assert data["scheduler_throughput_per_s"] > data["throughput_per_s"] > 0
    assert data["cores_busy"] > 0
    assert "the harness's own cost" in text


def test_reference_device_run_passes():
    status, text = stress(device="reference", **SMALL)
    assert status == 0, text


@pytest.mark.usefixtures("fused_batches")
@pytest.mark.parametrize("device", ["cpu", "torch:cpu"])
def test_small_workspace_cap_passes(device):
    # seed 5 draws templates whose padded fused block is over a 2 MB cap, though alone
    # they need little (admitted: fused in chunks or run on their own arrays), and one
    # whose solo launch needs more (refused on cpu; torch:cpu has no pool to cap)
    status, text = stress(
        requests=3000,
        clients=16,
        sync_clients=1,
        seed=5,
        device=device,
        workspace_limit_bytes=2_000_000,
        watchdog=3.0,
    )
    assert status == 0, text
    assert ("over the workspace cap" in text) == (device == "cpu"), text


def test_replay_command_names_the_caps():
    # a discrepancy's replay line reruns the request under the run's own caps
    command = _replay_command(StressOptions(max_queued_requests=8, workspace_limit_bytes=1 << 20))
    assert command == (
        "opsched stress --seed 0 --max-queued-requests 8 --workspace-limit-bytes 1048576 "
        "--replay {index}"
    )


def test_replay_runs_one_request():
    status, text = stress(replay=123, **SMALL)
    assert status == 0 and "1 requests" in text.splitlines()[0], text


def broken(monkeypatch, what: str) -> None:
    """Break the scheduler one way, for a few requests only."""
    if what == "drops":
        real = dispatch.finish

        def drop(request, *args):
            if request.id % 211 == 7 and request.graph is None:
                return  # never resolved
            real(request, *args)

        monkeypatch.setattr(dispatch, "finish", drop)
    elif what == "duplicates":
        real = dispatch.finish

        def twice(request, *args):
            real(request, *args)
            if request.id % 97 == 5:
                real(request, *args)  # a second delivery of the same request

        monkeypatch.setattr(dispatch, "finish", twice)
    elif what == "corrupts":
        # one wrong element in some GluBackward results, gathered or run on their own arrays
        real_scatter, real_here = GluBackwardLauncher.scatter, HostDevice.run_solo

        def spoil(request):
            if request.op.name == "GluBackward" and request.id % 13 == 3:
                out = request.tensors["out"]
                if out.size:
                    out.reshape(-1)[0] += 1

        def scatter(self, layout, fused):
            real_scatter(self, layout, fused)
            for r in layout.requests:
                spoil(r)

        def run_solo(self, request, **kwargs):
            real_here(self, request, **kwargs)
            spoil(request)

        monkeypatch.setattr(GluBackwardLauncher, "scatter", scatter)
        monkeypatch.setattr(HostDevice, "run_solo", run_solo)
    elif what == "counts a refusal twice":
        real_checked = Engine._checked_counted

        def counted(self, op, *args):
            try:
                return real_checked(self, op, *args)
            except Exception:
                self.counters.rejected += 1  # counted twice: the sums still add up
                raise

        monkeypatch.setattr(Engine, "_checked_counted", counted)
    elif what == "leaks":
        real = WorkspacePool.release
        calls = {"n": 0}

        def leak(self, block, event=None):
            calls["n"] += 1
            if calls["n"] == 5:
                return  # this block never comes back
            real(self, block, event)

        monkeypatch.setattr(WorkspacePool, "release", leak)
    elif what == "strands a thread":
        real_close = ThreadStream.close

        def strand(self):
            if self.index == 1 and not STRANDED:
                STRANDED.append((self, real_close))  # its worker never told to stop
                return
            real_close(self)

        monkeypatch.setattr(ThreadStream, "close", strand)


#: Streams a "strands a thread" run left running, stopped by the test afterwards.
STRANDED: list[tuple[ThreadStream, Any]] = []


@pytest.mark.parametrize(
    ("what", "check"),
    [
        ("drops", "every request resolved exactly once"),
        ("duplicates", "counters match the harness's"),
        ("counts a refusal twice", "counters match the harness's"),
        ("corrupts", "every result right"),
        ("leaks", "workspace blocks all returned"),
        ("strands a thread", "no scheduler thread alive"),
    ],
)
def test_a_broken_scheduler_is_reported(monkeypatch, what, check):
    broken(monkeypatch, what)
    try:
        status, text = stress(**SMALL)
    finally:
        while STRANDED:
            stream, close = STRANDED.pop()
            close(stream)
    assert status == 1, text
    line = next(line for line in text.splitlines() if line.strip().startswith(check))
    assert "FAILED" in line, text
    assert "verdict: FAIL" in text


def test_command_line_with_report(tmp_path):
    report = tmp_path / "r.json"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "opsched",
            "stress",
            "--requests",
            "400",
            "--clients",
            "4",
            "--sync-clients",
            "1",
            "--templates",
            "32",
            "--report",
            str(report),
            "--progress",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
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
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert proc.returncode == 2 and words in proc.stderr, proc.stderr


def _negate(out: np.ndarray) -> None:
    np.negative(out, out=out)


def _off_by_1e4(out: np.ndarray) -> None:
    """A FLOAT result 1e-4 too large: inside the vendor's FLOAT tolerance, far outside what
    the kernels promise (about 1,700 float32 roundings)."""
    if out.dtype == np.float32:
        np.multiply(out, np.float32(1.0001), out=out)


def _negate_glu_kernels(monkeypatch, *, graphs_only: bool = False, wrong=_negate) -> None:
    """Make GluBackward's kernel negate its output (or apply ``wrong`` to it), on every
    path: fused launches, solo launches, the usual launch through a runner (blocking calls,
    single-use two-phase executors) and the solo two-phase oracle alike (so results stay
    bit-identical to the solo call, and only an independent oracle can tell).
    ``graphs_only``: only when the launch serves a graph node (a wrong result on graphs
    alone)."""
    from opsched._lru import LRU
    from opsched.devices.host import HostDevice
    from opsched.devices.host.executor import PLANS

    real_fused = HostDevice._run_fused

    def fused(self, op, plan, arrays, workspace, requests, errors):
        real_fused(self, op, plan, arrays, workspace, requests, errors)
        if graphs_only and op.name == "GluBackward":
            for r in requests:
                if r.graph is not None:
                    wrong(r.tensors["out"])

    real_prepare = GluBackwardLauncher.prepare

    def negated_prepare(self, plan, tensors):  # every launch of the fast kernel
        launch = real_prepare(self, plan, tensors)
        if graphs_only:  # (graph nodes: in the fused launch, above, and run_solo, below)
            return launch

        def perturbed(t, workspace):
            launch(t, workspace)
            wrong(t["out"])

        return perturbed

    real_here = HostDevice.run_solo

    def here(self, request, **kwargs):  # a lone request run where it was made: graph nodes too
        real_here(self, request, **kwargs)
        if graphs_only and request.graph is not None and request.op.name == "GluBackward":
            wrong(request.tensors["out"])

    monkeypatch.setattr(HostDevice, "run_solo", here)
    monkeypatch.setattr(GluBackwardLauncher, "prepare", negated_prepare)
    monkeypatch.setattr(HostDevice, "_run_fused", fused)
    # the two-phase API's plan cache is the process's: runners an earlier test cached
    # would launch the real kernel, and the negated ones made here must not outlive this
    # test. An empty cache for its duration (the test then depended on the order the
    # suite ran in: CI saw one result right and the rest wrong)
    monkeypatch.setattr(PLANS, "_plans", LRU(PLANS.limit))


def test_a_wrong_kernel_on_every_path_fails_the_verdict(monkeypatch):
    _negate_glu_kernels(monkeypatch)
    status, text = stress(**SMALL)
    assert status == 1, text
    line = next(line for line in text.splitlines() if "every result right" in line)
    assert "FAILED" in line and "verdict: FAIL" in text
    assert "outside the kernels' error bound of the float64 oracle" in text
    assert "replay: opsched stress --seed 0" in text and "--replay " in text


def test_a_float_kernel_off_by_1e4_on_every_path_fails_the_verdict(monkeypatch):
    _negate_glu_kernels(monkeypatch, wrong=_off_by_1e4)
    status, text = stress(**SMALL)
    assert status == 1, text
    wrong = [line for line in text.splitlines() if "outside the kernels' error bound" in line]
    assert wrong and all("float32" in line for line in wrong), text


def test_the_kernels_bound_holds_their_results_and_refuses_an_error_of_1e4():
    from opsched.cli.stress import oracle
    from opsched.cli.stress.workload import make_template

    opts = StressOptions(large=0.05)
    refused = 0
    for index in range(256):
        t = make_template(3, index, opts)
        assert oracle.within_bound(t.expected, t.oracle, t.bound), t.describe
        if t.kind == "glu" and t.expected.dtype == np.float32 and t.expected.size:
            off = t.expected * np.float32(1.0001)
            # the vendor's tolerance would pass it
            assert oracle.within_tolerance("glu", off, t.oracle)
            refused += not oracle.within_bound(off, t.oracle, t.bound)
    assert refused >= 10  # every FLOAT GLU template whose result is not all zeros


def test_a_wrong_result_on_graphs_only_fails_the_verdict(monkeypatch):
    _negate_glu_kernels(monkeypatch, graphs_only=True)
    status, text = stress(graphs=0.5, **SMALL)
    assert status == 1, text
    wrong = [line for line in text.splitlines() if "graph GN" in line]
    assert wrong and all("replay:" in line for line in wrong), text
