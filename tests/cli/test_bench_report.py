"""docs/benchmarks.md and the README's summary are generated from a result file, and current."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from opsched.cli.bench_report import (
    SUMMARY_BEGIN,
    SUMMARY_END,
    generate,
    readme_with_summary,
    render_page,
    render_summary,
)
from opsched.cli.main import main

ROOT = Path(__file__).resolve().parents[2]


def _latest() -> Path:
    return sorted((ROOT / "docs" / "benchmarks").glob("*.json"))[-1]


def test_the_page_and_the_readme_summary_are_those_of_the_latest_result_file():
    assert generate(_latest(), ROOT, check=True) == []


def test_a_quick_run_renders_every_section_it_has(tmp_path, capsys):
    assert main(["bench", "all", "--quick", "--json", str(tmp_path / "q.json")]) == 0
    doc = json.loads((tmp_path / "q.json").read_text())
    assert doc["command"].startswith("opsched bench all --quick --json ")
    page = render_page(doc, "q.json")
    for heading in ("## Method", "## Results", "### Throughput", "### Graphs", "### Kernels"):
        assert heading in page
    # no cost-target table without its part, and never a verdict the run did not measure
    assert "### Cost targets" not in page and "| met |" not in page and "reached" not in page
    summary = render_summary(doc, "q.json")
    assert summary.startswith(SUMMARY_BEGIN) and summary.endswith(SUMMARY_END)
    assert "| 256 coroutines, tiny GroupNormalizationGrad | its two-phase call |" in summary


def test_the_cost_targets_render_each_row_beside_its_target():
    targets = {
        "rounds": 5,
        "rows": [
            {
                "path": "GLU, 256 coroutines",
                "target": 1.0,
                "peer": "torch",
                "requests": 9,
                "ratio": 1.1,
                "rounds": [1.0, 1.1, 1.2],
                "us": 7.0,
                "peer_us": 7.7,
            },
            {
                "path": "GLU, floor: bare batcher",
                "target": None,
                "peer": "torch",
                "requests": 9,
                "ratio": 1.4,
                "rounds": [1.3, 1.4],
                "us": 5.0,
                "peer_us": 7.0,
            },
            {
                "path": "GNB, 256 coroutines",
                "target": 0.8,
                "peer": "torch",
                "requests": 9,
                "ratio": 0.5,
                "rounds": [0.4, 0.5],
                "us": 20.0,
                "peer_us": 10.0,
                "family": "GNB",
            },
            {  # a batcher without the features: says nothing of what is blocked
                "path": "GNB, floor: bare batcher",
                "target": None,
                "peer": "torch",
                "requests": 9,
                "ratio": 0.9,
                "rounds": [0.9],
                "us": 11.0,
                "peer_us": 10.0,
                "family": "GNB",
                "keeps_features": False,
            },
            {
                "path": "GNB, floor: featured batcher",
                "target": None,
                "peer": "torch",
                "requests": 9,
                "ratio": 0.6,
                "rounds": [0.6],
                "us": 16.0,
                "peer_us": 10.0,
                "family": "GNB",
                "keeps_features": True,
            },
            {  # the featured floor of its own family reaches this row's target
                "path": "GLU medium, 32 coroutines",
                "target": 0.95,
                "peer": "torch",
                "requests": 9,
                "ratio": 0.9,
                "rounds": [0.88, 0.9],
                "us": 30.0,
                "peer_us": 27.0,
                "family": "GLU medium",
            },
            {  # its median is below the target, but a round reaches it: not blocked
                "path": "GLU medium, floor: featured batcher",
                "target": None,
                "peer": "torch",
                "requests": 9,
                "ratio": 0.93,
                "rounds": [0.9, 0.93, 0.97],
                "us": 26.5,
                "peer_us": 27.0,
                "family": "GLU medium",
                "keeps_features": True,
            },
        ],
    }
    doc = json.loads(_latest().read_text())
    doc["results"]["scheduler"]["targets"] = targets
    page = render_page(doc, "run.json")
    assert "median of 5 interleaved rounds" in page
    assert "| GLU, 256 coroutines | 7.0 | 7.7 | 1.10x | 1.00-1.20x | >= 1.00x | met |" in page
    assert "| GLU, floor: bare batcher | 5.0 | 7.0 | 1.40x | 1.30-1.40x |  | a floor |" in page
    # below its target, and so is the featured floor on its requests: blocked
    assert "| GNB, 256 coroutines | 20.0 | 10.0 | 0.50x | 0.40-0.50x | >= 0.80x | blocked |" in page
    # below its target, which its featured floor reaches in a round: work left
    medium = "| GLU medium, 32 coroutines | 30.0 | 27.0 | 0.90x | 0.88-0.90x | >= 0.95x | below |"
    assert medium in page
    summary = render_summary(doc, "run.json")
    assert (
        "| the cost table's rows (`--parts targets`) | their targets | 1 of 3 met, 1 blocked by "
        "the featured floor |" in summary
    )


def test_a_stale_readme_is_found_and_rewritten(tmp_path):
    (tmp_path / "docs" / "benchmarks").mkdir(parents=True)
    result = tmp_path / "docs" / "benchmarks" / "run.json"
    result.write_text(_latest().read_text())
    (tmp_path / "docs" / "benchmarks.md").write_text("old\n")
    (tmp_path / "README.md").write_text(f"# x\n\n{SUMMARY_BEGIN}\nold\n{SUMMARY_END}\n")
    assert sorted(generate(result, tmp_path, check=True)) == ["README.md", "docs/benchmarks.md"]
    assert sorted(generate(result, tmp_path)) == ["README.md", "docs/benchmarks.md"]
    assert generate(result, tmp_path, check=True) == []
    assert "old" not in (tmp_path / "README.md").read_text()


def test_a_readme_without_markers_is_refused():
    with pytest.raises(ValueError, match="no .*bench-summary"):
        readme_with_summary("# a readme\n", "table")


def test_an_added_latency_within_half_a_microsecond_of_zero_reads_0_never_minus_0():
    machine = {"python": "3.11", "numpy": "2", "platform": "Linux", "cpus": 2}
    latency = {"scheduler_median_us": 30.1, "direct_median_us": 30.4, "added_us": -0.3}
    doc = {"command": "opsched bench all", "machine": machine, "results": {}}
    doc["results"]["scheduler"] = {"latency": latency}
    assert "| an idle request | added latency | 0 us |" in render_summary(doc, "x.json")
    assert "| idle latency added | 0 us (30 against the call's 30) |" in render_page(doc, "x.json")
