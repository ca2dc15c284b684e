"""The vendor documents' worked examples, against values derived independently."""

from __future__ import annotations

import math

import numpy as np

from opsched import aclnn
from opsched.cli.seeds import glu_seed, group_norm_seed
from tests.helpers import assert_same_bits


def test_glu_seed_example():
    grad_out, x, dim = glu_seed()
    out = np.empty_like(x)
    size, ex = aclnn.glu_backward_get_workspace_size(grad_out, x, dim, out)
    aclnn.glu_backward(np.empty(size, np.uint8), size, ex)
    # Written down by hand from the seed's first row: a = (0.2948, 1.6331, 2.3158),
    # b = (-0.6872, 0.3036, 0.1575), grad_out = 1: grad_a = sigmoid(b),
    # grad_b = sigmoid(b) * a * (1 - sigmoid(b)).
    np.testing.assert_allclose(
        out[0, 0], [0.334656, 0.575322, 0.539294, 0.065641, 0.399010, 0.575374], atol=2e-6
    )
    # Every element, with Python's math in double precision.
    for idx in np.ndindex(2, 4):
        a, b = x[idx][:3].tolist(), x[idx][3:].tolist()
        s = [1 / (1 + math.exp(-v)) for v in b]
        want = s + [si * ai * (1 - si) for si, ai in zip(s, a, strict=True)]
        np.testing.assert_allclose(out[idx], want, rtol=1e-4, atol=1e-4)


def test_group_norm_seed_example_is_exact():
    x, dy, gamma, mean, rstd = group_norm_seed()
    dx = np.empty_like(x)
    size, ex = aclnn.group_norm_grad_get_workspace_size(x, dy, gamma, mean, rstd, dx)
    aclnn.group_norm_grad(np.empty(size, np.uint8), size, ex)
    # M = 128, xhat = x = i / 128, s1 = 0.5 * 128 = 64, s2 = 0.5 * sum(i / 128) = 31.75,
    # so dx = (1 / 128) * (64 - 64 - x * 31.75) = -127 * i / 65536: every step is exact
    # in float32, so the result is exactly that.
    i = np.arange(128)
    want = (-127 * i / 65536).astype(np.float32)
    for n, g in np.ndindex(2, 4):
        assert_same_bits(dx[n, g], want)
    assert dx[1, 3, 127] == np.float32(-16129 / 65536)
