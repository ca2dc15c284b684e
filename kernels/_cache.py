"""Keeping numba's disk cache of the compiled kernels in step with their sources.

numba invalidates a cached function when the file that defines it changes, not when a file
it inlines from changes (a documented limitation of its cache): an entry point of
``glu.py`` cached before an edit of ``_jit.py`` (``sigmoid``, a conversion) would go on
running the old machine code, in an editable install after a ``git pull`` or in a working
tree, and its tests would test the old code. So the package's cache directory holds a
fingerprint of every kernel source (numba checks its own version itself); on the package's
import, before anything is compiled or loaded, a fingerprint that differs removes the
package's cached files first. A cache directory that cannot be found or written is left
alone (numba then caches elsewhere, or not at all).
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterable
from pathlib import Path

__all__ = ["FINGERPRINT_FILE", "refresh", "refresh_package", "sources_fingerprint"]

#: The file in the cache directory that names the sources its compiled kernels came from.
FINGERPRINT_FILE = "opsched-kernels.fingerprint"

_PACKAGE = Path(__file__).resolve().parent


def sources_fingerprint(package: Path = _PACKAGE) -> str:
    """A digest of every ``.py`` file of ``package`` (names and contents): the sources the
    compiled kernels depend on. Not numba's version: its cache checks that itself, and two
    environments on one tree (each with its Python's files) would otherwise clear each
    other's cache on every import."""
    digest = hashlib.sha256()
    for path in sorted(package.glob("*.py")):
        digest.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()


def refresh(cache_dir: Path, fingerprint: str, modules: Iterable[str]) -> list[str]:
    """Make ``cache_dir`` hold kernels compiled from the sources ``fingerprint`` names:
    when its fingerprint file says otherwise (or is missing), remove the cached files of
    ``modules`` (numba names them ``<module>.<function>-<line>.py<version>.nbi`` / ``.nbc``)
    and record ``fingerprint``. Returns the names of the files removed.

    Files of other modules are kept. Several processes may do this at once: numba tolerates
    a cached file that vanishes (it compiles again).
    """
    marker = cache_dir / FINGERPRINT_FILE
    try:
        if marker.read_text() == fingerprint:
            return []
    except OSError:
        pass  # no fingerprint yet: the files there may come from any sources
    stems = tuple(f"{module}." for module in modules)
    removed = []
    for path in cache_dir.iterdir():
        if path.suffix in (".nbi", ".nbc") and path.name.startswith(stems):
            path.unlink(missing_ok=True)
            removed.append(path.name)
    partial = marker.with_name(f"{marker.name}.{os.getpid()}")
    partial.write_text(fingerprint)
    partial.replace(marker)  # atomic: a concurrent reader sees the old text or the new
    return removed


def _located() -> None:
    """A function of this package: numba locates the package's cache directory by it."""


def cache_dir(internals: bool) -> Path:
    """The package's cache directory as numba locates it (beside the modules, under
    ``NUMBA_CACHE_DIR``, or in the user's cache directory), asking numba's cache machinery
    where ``internals`` allows (``_jit.NUMBA_INTERNALS``). Without it: ``__pycache__``
    beside the modules, numba's choice for a writable tree, which is where an edit of a
    source (a working tree, an editable install) meets its stale kernels."""
    if internals:
        try:
            from numba.core.caching import FunctionCache

            return Path(FunctionCache(_located).cache_path)
        except Exception:  # a numba whose cache machinery moved: the public guess
            pass
    return _PACKAGE / "__pycache__"


def refresh_package(internals: bool) -> None:
    """:func:`refresh` for this package's cache directory (:func:`cache_dir`). The
    fingerprint names the sources and whether the kernels were built with numba's
    internals (``internals``): the two builds never load each other's machine code."""
    try:
        modules = [path.stem for path in _PACKAGE.glob("*.py")]
        mode = "internals" if internals else "public"
        refresh(cache_dir(internals), f"{sources_fingerprint()} {mode}", modules)
    except Exception:
        # Never keep the kernels from loading: no writable cache directory (numba does not
        # cache there either); numba's own invalidation alone applies.
        return
