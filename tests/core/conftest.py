"""The scheduler suite runs on both event loops anyio supports."""

import pytest


@pytest.fixture(params=["asyncio", "trio"])
def anyio_backend(request):
    return request.param


@pytest.fixture
def runs_at_submit(anyio_backend):
    """For tests of a request run at submit: on asyncio the scheduler tells by the loop's
    ready queue, a gated internal (opsched._compat); past the gate it never does."""
    from opsched._compat import PYTHON_INTERNALS

    if anyio_backend == "asyncio" and not PYTHON_INTERNALS:
        pytest.skip("asyncio's ready queue is past the gate: no request runs at submit")
