"""Every Python code block of README.md and docs/ runs as written.

pytest-examples finds the blocks; each runs here through ``compile`` / ``exec``, its lines
numbered as in its file. (pytest-examples' own runner trips a CPython 3.11 bug in
``traceback.extract_tb`` under pytest 9: a failing block then crashed pytest's report
instead of showing its error.)
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from pytest_examples import CodeExample, find_examples

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = list(find_examples(ROOT / "README.md", ROOT / "docs"))


def test_the_docs_have_examples():
    assert len(EXAMPLES) >= 7


@pytest.mark.parametrize("example", EXAMPLES, ids=str)
def test_example_runs(example: CodeExample, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # what an example writes (a trace) lands here
    source = "\n" * (example.start_line) + example.source  # its lines, as in its file
    code = compile(source, str(example.path), "exec")
    exec(code, {"__name__": "__main__"})


def _slug(heading: str) -> str:
    """A Markdown heading's anchor, as GitHub makes it."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def test_every_link_between_the_pages_resolves():
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    broken = []
    for page in pages:
        for target, anchor in re.findall(r"\]\(([^)#\s]*)(?:#([^)\s]+))?\)", page.read_text()):
            if target.startswith(("http://", "https://")):
                continue
            path = (page.parent / target) if target else page
            if not path.exists():
                broken.append(f"{page.name}: {target}")
                continue
            if anchor and path.suffix == ".md":
                headings = re.findall(r"^#+ (.+)$", path.read_text(), re.MULTILINE)
                if anchor not in {_slug(h) for h in headings}:
                    broken.append(f"{page.name}: {target}#{anchor}")
    assert broken == []
