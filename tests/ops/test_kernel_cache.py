"""numba's disk cache of the compiled kernels follows every kernel source, not only the
file that defines each entry point (kernels/_cache.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from opsched.kernels import _cache


def _touch(directory: Path, *names: str) -> None:
    for name in names:
        (directory / name).write_bytes(b"compiled")


def test_a_new_fingerprint_removes_the_packages_cached_kernels_and_nothing_else(tmp_path):
    ours = ["glu._glu_float32-302.py311.nbi", "glu._glu_float32-302.py311.1.nbc"]
    ours += ["_jit._exp_loop-339.py313.nbi"]
    others = ["other.f-3.py311.nbi", "glu.cpython-311.pyc", "gluon.f-1.py311.nbi"]
    _touch(tmp_path, *ours, *others)

    removed = _cache.refresh(tmp_path, "one", ["glu", "_jit"])

    assert sorted(removed) == sorted(ours)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([*others, _cache.FINGERPRINT_FILE])
    assert (tmp_path / _cache.FINGERPRINT_FILE).read_text() == "one"


def test_the_same_fingerprint_keeps_the_cache_and_another_clears_it(tmp_path):
    _cache.refresh(tmp_path, "one", ["glu"])
    _touch(tmp_path, "glu._glu_float16-307.py311.nbi")  # compiled from the sources "one"

    assert _cache.refresh(tmp_path, "one", ["glu"]) == []
    assert (tmp_path / "glu._glu_float16-307.py311.nbi").exists()

    assert _cache.refresh(tmp_path, "two", ["glu"]) == ["glu._glu_float16-307.py311.nbi"]
    assert (tmp_path / _cache.FINGERPRINT_FILE).read_text() == "two"


def test_the_fingerprint_follows_every_source_of_the_package(tmp_path):
    (tmp_path / "kernel.py").write_text("def loop(): pass\n")
    (tmp_path / "_shared.py").write_text("def expf(x): return x\n")
    before = _cache.sources_fingerprint(tmp_path)
    (tmp_path / "notes.txt").write_text("not a source")
    assert _cache.sources_fingerprint(tmp_path) == before
    (tmp_path / "_shared.py").write_text("def expf(x): return x + 0\n")  # only the helper
    assert _cache.sources_fingerprint(tmp_path) != before


def test_importing_the_kernels_recorded_their_sources_in_numbas_cache_directory():
    from kernels import _jit

    loops = _jit._ALL[0]  # one entry point compiled or loaded: the cache was refreshed
    loops[next(iter(loops._sources))]
    try:
        directory = _cache.cache_dir(_jit.NUMBA_INTERNALS)
        marker = directory / _cache.FINGERPRINT_FILE
        recorded = marker.read_text()
    except (OSError, RuntimeError):
        pytest.skip("numba has no readable cache directory here")
    mode = "internals" if _jit.NUMBA_INTERNALS else "public"
    assert recorded == f"{_cache.sources_fingerprint()} {mode}"


@pytest.mark.internals
def test_a_numba_whose_cache_cannot_be_located_still_loads_the_kernels(monkeypatch):
    import numba.core.caching

    def moved(func):
        raise AttributeError("FunctionCache has no cache_path in this numba")

    monkeypatch.setattr(numba.core.caching, "FunctionCache", moved)
    # the public guess: beside the modules
    beside = Path(_cache.__file__).resolve().parent / "__pycache__"
    assert _cache.cache_dir(internals=True) == beside
    _cache.refresh_package(internals=True)  # quietly leaves numba's own invalidation in charge
