"""Pure compute: the reference and fast numpy kernels of every operator.

Installed as ``opsched.kernels`` (see pyproject's package-dir); it imports nothing of
opsched's, only numpy, and knows nothing of scheduling, devices or asyncio.

Importing the package first makes numba's disk cache of the compiled kernels match their
sources (:mod:`._cache`), before any module of it compiles or loads one.
"""

from ._cache import refresh_package

refresh_package()
