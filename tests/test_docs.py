"""Every Python code block of README.md and docs/ runs as written.

pytest-examples finds the blocks; each runs here through ``compile`` / ``exec``, its lines
numbered as in its file. (pytest-examples' own runner trips a CPython 3.11 bug in
``traceback.extract_tb`` under pytest 9: a failing block then crashed pytest's report
instead of showing its error.)
"""

from __future__ import annotations

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
