"""The library's events reach the standard library's logging when the application set that
up, and nothing is printed when it set up nothing."""

from __future__ import annotations

import logging
import subprocess
import sys

import numpy as np
import pytest
import structlog

import opsched
from opsched import RuntimeLaunchError
from tests.sched_helpers import FailWhen


@pytest.fixture(autouse=True)
def structlog_unconfigured():
    """An application that configured only the standard library (another test of this
    process may have configured structlog: restored afterwards)."""
    configured, config = structlog.is_configured(), structlog.get_config()
    structlog.reset_defaults()
    yield
    if configured:
        structlog.configure(**config)
    else:
        structlog.reset_defaults()


def _fail_one_request() -> None:
    async def main():
        rng = np.random.default_rng(0)
        x = rng.standard_normal((4, 16)).astype(np.float32)
        g = np.ones((4, 8), np.float32)
        async with opsched.open_scheduler(streams=1) as sched:
            sched.device.inject_faults(FailWhen(x))
            with pytest.raises(RuntimeLaunchError):
                await sched.glu_backward(g, x)

    import asyncio

    asyncio.run(main())


def test_a_failed_request_reaches_the_standard_librarys_logging(caplog):
    with caplog.at_level(logging.INFO, logger="opsched"):
        _fail_one_request()
    failed = [r for r in caplog.records if r.getMessage().startswith("request failed")]
    assert len(failed) == 1
    record = failed[0]
    assert record.name == "opsched.scheduler" and record.levelno == logging.INFO
    assert "op='GluBackward'" in record.getMessage() and "InjectedFault" in record.getMessage()
    assert record.opsched_event == "request failed"


def test_events_below_the_applications_level_are_not_built(caplog):
    with caplog.at_level(logging.WARNING, logger="opsched"):
        _fail_one_request()
    assert not [r for r in caplog.records if r.name.startswith("opsched")]


def test_an_application_that_configured_no_logging_sees_nothing():
    code = (
        "import numpy as np, opsched.sync\n"
        "from opsched._log import get_logger\n"
        "get_logger('opsched.scheduler').warning('a warning nobody asked to see')\n"
        "opsched.sync.glu_backward(np.ones((2, 4), np.float32), np.ones((2, 8), np.float32))\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=110, check=False
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == "" and proc.stderr == ""
