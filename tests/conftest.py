import os

import pytest
from hypothesis import HealthCheck, settings

import opsched.devices.host

# Deterministic property tests: fixed examples in CI, no wall-clock deadline on a noisy box.
settings.register_profile(
    "ci",
    derandomize=True,
    deadline=None,
    max_examples=150,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.register_profile("dev", deadline=None, max_examples=300)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


@pytest.fixture
def fused_batches(monkeypatch):
    """The host devices gather every batch of two requests or more: for tests of the fused
    launch (by default a batch of up to ``SOLO_BATCH_MAX`` runs its requests on their own
    arrays, one after another)."""
    monkeypatch.setattr(opsched.devices.host, "SOLO_BATCH_MAX", 1)
