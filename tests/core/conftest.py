"""The scheduler suite runs on both event loops anyio supports."""

import pytest


@pytest.fixture(params=["asyncio", "trio"])
def anyio_backend(request):
    return request.param
