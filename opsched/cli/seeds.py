"""The worked examples of the vendor's operator documents, as arrays.

Used by the demo and the tests: GluBackward on the 2x4x6 ``self`` printed in the document with
``grad_out`` all ones and ``dim=-1``; GroupNormalizationGrad on 2x4x128 with
``x[..., i] = (i % 128) / 128``, ``dy = 0.5``, ``gamma = 1``, ``mean = 0``, ``rstd = 1``.
"""

from __future__ import annotations

import numpy as np

__all__ = ["glu_seed", "group_norm_seed"]

_GLU_SELF = [
    0.2948,
    1.6331,
    2.3158,
    -0.6872,
    0.3036,
    0.1575,
    0.2992,
    1.0893,
    -0.1126,
    0.1910,
    -1.3675,
    0.5587,
    0.4928,
    1.4385,
    0.6834,
    -0.6529,
    1.0361,
    -0.6160,
    1.2554,
    -2.0038,
    0.5361,
    -1.4009,
    -0.7497,
    -0.8814,
    0.4113,
    0.7549,
    -1.2869,
    -1.4354,
    0.6939,
    0.2192,
    0.3932,
    1.8506,
    -0.7737,
    3.6379,
    -0.9404,
    -1.1261,
    -1.6927,
    0.8456,
    0.6500,
    0.2738,
    0.5115,
    0.3356,
    0.5763,
    0.2667,
    -0.6570,
    -0.4159,
    1.5258,
    0.0843,
]


def glu_seed() -> tuple[np.ndarray, np.ndarray, int]:
    """Return ``(grad_out, self, dim)`` of the GluBackward seed example (FLOAT)."""
    x = np.array(_GLU_SELF, dtype=np.float32).reshape(2, 4, 6)
    return np.ones((2, 4, 3), np.float32), x, -1


def group_norm_seed() -> tuple[np.ndarray, ...]:
    """Return ``(x, dy, gamma, mean, rstd)`` of the GroupNormalizationGrad seed (FLOAT)."""
    shape = (2, 4, 128)
    x = np.broadcast_to(np.arange(128, dtype=np.float32) / 128, shape).copy()
    dy = np.full(shape, 0.5, np.float32)
    gamma = np.ones(shape, np.float32)
    return x, dy, gamma, np.zeros((2, 4), np.float32), np.ones((2, 4), np.float32)
