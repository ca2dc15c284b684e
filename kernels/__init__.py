"""Pure compute: the reference and fast numpy kernels of every operator.

Installed as ``opsched.kernels`` (see pyproject's package-dir); it imports nothing of
opsched's, only numpy, and knows nothing of scheduling, devices or asyncio.

Importing it compiles nothing: each compiled loop is compiled (or loaded from numba's disk
cache) the first time a launch needs it (:mod:`._jit`).
"""

__all__ = ["warm"]


def warm() -> int:
    """Compile (or load from numba's disk cache) every kernel entry point now, instead of
    at the first launch that needs each; returns how many there are."""
    from . import _jit

    return _jit.warm()
