"""The command line on tiny workloads: exit codes, files written, their JSON layout.

Commands run in this process, through ``main(argv)``; one smoke test runs ``python -m
opsched`` in a new interpreter, as a user does.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import pathlib
import re
import subprocess
import sys

import pytest
import structlog

from opsched.cli.main import main
from opsched.core.trace import load_trace

ROOT = pathlib.Path(__file__).resolve().parents[2]


def opsched_cmd(*args, cwd) -> subprocess.CompletedProcess[str]:
    """``opsched ARGS`` run in this process in ``cwd``: its exit status and output."""
    out, err = io.StringIO(), io.StringIO()
    here = os.getcwd()
    os.chdir(cwd)
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                code = main(list(args))
            except SystemExit as exc:  # argparse: --help, usage errors
                code = exc.code if isinstance(exc.code, int) else 1
    finally:
        os.chdir(here)
        structlog.reset_defaults()  # -v configured it to print into ``err``
    return subprocess.CompletedProcess(args, code, out.getvalue(), err.getvalue())


def test_python_m_opsched_runs_the_demo_in_a_new_interpreter(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "opsched", "demo", "--device", "reference"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.count("results bit-identical to solo launches: True") == 2


def test_demo_runs_checks_and_writes_its_trace(tmp_path):
    proc = opsched_cmd("demo", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert "GluBackward" in out and "GroupNormalizationGrad" in out
    assert "0.334656" in out  # sigmoid(-0.6872), the seed's first gradient
    assert out.count("results bit-identical to solo launches: True") == 2
    assert "5000 requests in" in out
    # the summary table: one row per workload, both bit-identical
    assert re.search(r"async training loop\s+5120\s+\d+", out)
    assert re.search(r"sync batch script\s+5000\s+\d+.*yes$", out, re.MULTILINE)
    launches = int(re.search(r"5120 requests in (\d+) launches", out).group(1))
    events = load_trace(tmp_path / "opsched-demo.trace.json")
    assert sum(1 for e in events if e["ph"] == "X") == launches
    assert sum(1 for e in events if e["ph"] == "f") > 0  # the graph's edges


def test_demo_takes_the_common_options(tmp_path):
    config = tmp_path / "one.toml"
    config.write_text("streams = 1\n")
    proc = opsched_cmd(
        "demo",
        "--device",
        "reference",
        "--config",
        str(config),
        "--trace",
        "d.json",
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr
    events = load_trace(tmp_path / "d.json")
    names = {e["args"]["name"] for e in events if e["name"] == "process_name"}
    assert names == {"opsched scheduler (reference)"}
    assert {e["tid"] for e in events if e["ph"] == "X"} == {1}  # one stream


@pytest.mark.parametrize("command", ["demo", "bench", "stress", "trace"])
def test_every_subcommand_has_help(tmp_path, command):
    proc = opsched_cmd(command, "--help", cwd=tmp_path)
    assert proc.returncode == 0 and "usage: opsched " + command in proc.stdout
    if command != "trace":
        for option in ("--config", "--device", "--trace", "--log-format", "--verbose"):
            assert option in proc.stdout


def test_bench_writes_results_trace_and_chart(tmp_path):
    proc = opsched_cmd(
        "bench",
        "all",
        "--quick",
        "--json",
        "r.json",
        "--trace",
        "t.json",
        "--plot",
        "p.png",
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr
    doc = json.loads((tmp_path / "r.json").read_text())
    assert doc["benchmark"] == "all" and doc["schema"] == 1
    assert {"python", "numpy", "cpus"} <= set(doc["machine"])
    results = doc["results"]
    assert set(results) == {"kernels", "scheduler", "graphs"}
    for row in results["kernels"]:
        assert {"op", "dtype", "elements", "fast_gbps", "copy_gbps", "ratio_to_copy"} <= set(row)
    sched = results["scheduler"]
    assert {"throughput_glu", "throughput_gn", "tracing", "sweeps"} <= set(sched)
    assert [p["clients"] for p in sched["sweeps"]["by_clients"]] == [1, 2, 4, 8, 16, 64, 256]
    assert sched["tracing"]["traced_rps"] > 0
    assert results["graphs"]["graph_chains_per_s"] > 0
    events = load_trace(tmp_path / "t.json")
    assert any(e["ph"] == "X" for e in events)
    assert (tmp_path / "p.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bench_plot_without_matplotlib_says_how_to_get_it(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as if not installed
    proc = opsched_cmd("bench", "kernels", "--quick", "--plot", "p.png", cwd=tmp_path)
    assert proc.returncode == 2
    assert "pip install 'opsched[plot]'" in proc.stderr
    assert not (tmp_path / "p.png").exists()


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["bench", "kernels", "--trace", "t.json"], "runs no scheduler"),
        (["bench", "kernels", "--sizes", "12Q"], "'12Q' is not a size"),
        (["bench", "kernels", "--dtypes", "INT8"], "--dtypes='INT8'; expected a comma list"),
        (["bench", "scheduler", "--parts", "nope"], "unknown scheduler benchmark part"),
        (["bench", "scheduler", "--target-groups", "tiny,huge"], "cost-target group(s) ['huge']"),
        (["demo", "--device", "gpu"], "gpu"),
        (["demo", "--config", "missing.toml"], "missing.toml"),
        (["stress", "--requests", "10", "--cancel", "2"], "--cancel=2.0 is out of range"),
        (["trace", "missing.json"], "missing.json"),
        (["trace", "notes.txt"], "notes.txt: not a trace-event file (not JSON: "),
    ],
)
def test_bad_arguments_are_usage_errors(tmp_path, args, message):
    (tmp_path / "notes.txt").write_text("not json\n")
    proc = opsched_cmd(*args, cwd=tmp_path)
    assert proc.returncode == 2, proc.stdout
    assert message in proc.stderr and "Traceback" not in proc.stderr
    assert proc.stdout == ""  # said before anything runs or prints


def test_bench_runs_the_cost_target_groups_asked_for(tmp_path, monkeypatch):
    from opsched.cli import bench_scheduler

    asked: list[tuple[str, ...]] = []

    def targets(rounds, quick=False, groups=()):
        asked.append(groups)
        return {}

    monkeypatch.setattr(bench_scheduler, "bench_targets", targets)
    proc = opsched_cmd(
        "bench", "scheduler", "--parts", "targets", "--target-groups", "tiny,graphs", cwd=tmp_path
    )
    assert proc.returncode == 0, proc.stderr
    assert asked == [("tiny", "graphs")]


def test_stress_writes_a_trace(tmp_path):
    proc = opsched_cmd(
        "stress",
        "--requests",
        "300",
        "--clients",
        "8",
        "--sync-clients",
        "1",
        "--templates",
        "16",
        "--trace",
        "s.json",
        "--report",
        "r.json",
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads((tmp_path / "r.json").read_text())
    events = load_trace(tmp_path / "s.json")
    assert sum(1 for e in events if e["ph"] == "X") == report["scheduler"]["launches"]


def test_trace_command_summarizes_and_draws(tmp_path):
    assert opsched_cmd("demo", "--trace", "d.json", cwd=tmp_path).returncode == 0
    proc = opsched_cmd("trace", "d.json", "--png", "d.png", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert re.search(r"d.json: \d+ launches serving 5120 requests", proc.stdout)
    assert "stream 0" in proc.stdout and "stream 1" in proc.stdout
    assert (tmp_path / "d.png").read_bytes()[:4] == b"\x89PNG"


def test_verbose_json_logs_every_launch_to_stderr(tmp_path):
    proc = opsched_cmd(
        "stress",
        "--requests",
        "50",
        "--clients",
        "4",
        "--sync-clients",
        "0",
        "--templates",
        "4",
        "-vv",
        "--log-format",
        "json",
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    events = [json.loads(line) for line in proc.stderr.splitlines() if line.startswith("{")]
    assert any(e["event"] == "launch" and e["level"] == "debug" for e in events)


def test_quiet_by_default(tmp_path):
    proc = opsched_cmd(
        "stress",
        "--requests",
        "50",
        "--clients",
        "4",
        "--sync-clients",
        "0",
        "--templates",
        "4",
        cwd=tmp_path,
    )
    assert proc.returncode == 0 and proc.stderr == ""


def test_unknown_command_fails_with_usage(tmp_path):
    proc = opsched_cmd("frobnicate", cwd=tmp_path)
    assert proc.returncode == 2 and "invalid choice" in proc.stderr


def test_ci_runs_the_readme_test_command():
    readme = (ROOT / "README.md").read_text()
    ci = (ROOT / ".ci" / "run").read_text()
    assert "<!-- test-command -->" in readme and "<!-- demo-command -->" in readme
    assert "test-command" in ci
