import os

from hypothesis import HealthCheck, settings

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
