"""Pure compute: the reference and fast numpy kernels of every operator.

Installed as ``opsched.kernels`` (see pyproject's package-dir); it imports nothing of
opsched's, only numpy, and knows nothing of scheduling, devices or asyncio.

Importing it compiles nothing: each compiled loop is compiled (or loaded from numba's disk
cache) the first time a launch needs it (:mod:`._jit`).
"""
