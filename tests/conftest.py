import faulthandler
import os

import pytest
from hypothesis import HealthCheck, settings

import opsched.devices.host.device

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
    monkeypatch.setattr(opsched.devices.host.device, "SOLO_BATCH_MAX", 1)


#: The real standard error, kept when pytest is configured (its capture is off then; while
#: a test runs, fd 2 is pytest's capture file, which is lost when the process exits).
_STDERR: list[int] = []


def pytest_configure(config):
    _STDERR.append(os.dup(2))
    device = os.environ.get("OPSCHED_TEST_DEVICE")
    if device:  # the torch-device tests run there: it must open, or nothing they say counts
        from opsched.devices import make_device

        try:
            make_device(device, 1).close()
        except Exception as exc:
            pytest.exit(f"OPSCHED_TEST_DEVICE={device!r} cannot be opened: {exc}", returncode=4)


def pytest_collection_modifyitems(config, items):
    """With the public fallbacks forced (``OPSCHED_PUBLIC_ONLY``, tests/test_public_fallback.py),
    or on a Python past the gate (opsched/_compat.py), the tests of what the gated
    internals do are skipped: nothing uses them."""
    from opsched._compat import PYTHON_INTERNALS

    if PYTHON_INTERNALS:
        return
    skip = pytest.mark.skip(reason="the gated internals are not used here (opsched._compat)")
    for item in items:
        if item.get_closest_marker("internals"):
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def hang_ends_the_run(request):
    """A backstop behind pytest-timeout: its signal raises inside whatever code runs, and
    an event loop that is spinning in a callback logs that exception and goes on (the
    test never ends, and CI would stall until its own limit). After twice the test's
    timeout every thread's stack is written to stderr and the process exits, failing
    the run."""
    marker = request.node.get_closest_marker("timeout")
    limit = float(marker.args[0] if marker and marker.args else request.config.getini("timeout"))
    if limit > 0:
        faulthandler.dump_traceback_later(2 * limit, exit=True, file=_STDERR[0])
    yield
    faulthandler.cancel_dump_traceback_later()
