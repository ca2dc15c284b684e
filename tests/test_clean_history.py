"""The repository speaks of the product as it is: its development history lives in git.

No issue numbers, work-session names or dated lab notes in the README, docs, changelog,
code or tests; no before/after timings or "measured" notes in the library's comments (the
figures belong to the benchmark that regenerates them); the contract is cited from
docs/operators.md, a document in the repository.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
HERE = Path(__file__).resolve()

_ORDINALS = (
    "first|second|third|fourth|fifth|sixth|seventh|eighth|ninth|tenth|eleventh|twelfth|"
    "thirteenth|fourteenth|fifteenth|sixteenth|seventeenth|eighteenth|nineteenth|twentieth|"
    "twenty|thirty"
)
#: What no file of the repository says, with why.
HISTORY = {
    "an issue number": re.compile(r"\b[Ii]ssues? \d+|\(issues? \d|[Tt]he issue'?s?\b|#\d{2,}\b"),
    "a work session": re.compile(
        rf"\b(?:{_ORDINALS})[\w-]* sessions?\b|\b(?:this|that|earlier|previous|last|next) "
        r"sessions?\b",
        re.I,
    ),
    "a dated note": re.compile(r"\b20\d\d-\d\d-\d\d\b"),
    "a document outside the repository": re.compile(r"\bSPEC\b|\bDESIGN\b|seed documents?"),
}
#: What the library's code does not say: figures of a day belong to the benchmarks.
TIMINGS = {
    "a before/after timing": re.compile(
        r"\d(?:\.\d+)?\s*(?:us|ms|ns|s|x|%)?\s*->\s*[\d.]+\s*(?:us|ms|ns|s|x|%)"
    ),
    "a measured note": re.compile(r"\b[Mm]easured[:,)]|\([Mm]easured|[Mm]easured (?:on|here)\b"),
}


def _files() -> list[Path]:
    found = [ROOT / "README.md", ROOT / "CHANGELOG.md", *sorted((ROOT / "docs").rglob("*.md"))]
    for folder in ("opsched", "kernels", "tests", "scripts", "configs"):
        found += sorted(p for p in (ROOT / folder).rglob("*") if p.suffix in (".py", ".toml"))
    unique = {p.resolve(): p for p in found}  # opsched/kernels and configs are links
    return [p for resolved, p in unique.items() if resolved != HERE]


def _library() -> list[Path]:
    """The library's modules (the benchmarks of the CLI measure, and say so) and the pages
    that describe it (figures there come from docs/benchmarks.md, which is generated)."""
    found = [p for folder in ("opsched", "kernels") for p in (ROOT / folder).rglob("*.py")]
    unique = {p.resolve(): p for p in found if "cli" not in p.relative_to(ROOT).parts}
    pages = [p for p in (ROOT / "docs").glob("*.md") if p.name != "benchmarks.md"]
    return [*sorted(unique.values()), ROOT / "README.md", *sorted(pages)]


def _hits(paths: list[Path], patterns: dict[str, re.Pattern[str]], skip_dates: bool) -> list:
    hits = []
    for path in paths:
        for number, line in enumerate(path.read_text().splitlines(), 1):
            for what, pattern in patterns.items():
                if skip_dates and what == "a dated note" and line.startswith("## ["):
                    continue  # a release's heading: "## [0.2.0] - 2026-12-06"
                if pattern.search(line):
                    hits.append(f"{path.relative_to(ROOT)}:{number}: {what}: {line.strip()}")
    return hits


def test_no_development_history_in_the_repository():
    assert _hits(_files(), HISTORY, skip_dates=True) == []


def test_no_timings_of_a_day_in_the_librarys_comments():
    assert _hits(_library(), TIMINGS, skip_dates=False) == []


@pytest.mark.parametrize("line", ["fixed in issue 14", "the twenty-third session", "2026-12-04"])
def test_the_patterns_catch_history(line):
    assert any(p.search(line) for p in HISTORY.values())
