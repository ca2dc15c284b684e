"""Freed memory kept for the next launches' outputs (glibc's malloc, process-wide)."""

from __future__ import annotations

import platform
import subprocess
import sys
import textwrap

import pytest
import structlog

from opsched.devices import malloc

GLIBC = platform.system() == "Linux" and platform.libc_ver()[0] == "glibc"


@pytest.fixture
def calls(monkeypatch):
    """The ``mallopt`` calls made from now on (none reaches the C library)."""
    made: list[tuple[int, int]] = []

    def mallopt(param, value):
        made.append((param, value))
        return 1

    monkeypatch.setattr(malloc, "_glibc_mallopt", lambda: mallopt)
    monkeypatch.setattr(malloc, "_kept", [0])
    for name in (*malloc._USER_SETTINGS, "GLIBC_TUNABLES"):
        monkeypatch.delenv(name, raising=False)
    return made


def test_keeping_sets_the_top_pad_and_the_mmap_threshold_and_only_ever_raises(calls):
    with structlog.testing.capture_logs() as logs:
        assert malloc.keep_freed_memory(32 << 20)
    assert logs == [
        {
            "event": "malloc keeps freed memory",
            "bytes": 32 << 20,
            "mmap_threshold": malloc.MMAP_THRESHOLD,
            "log_level": "debug",
        }
    ]
    assert calls == [(-3, malloc.MMAP_THRESHOLD), (-2, 32 << 20)]
    assert not malloc.keep_freed_memory(16 << 20)  # less than applied: nothing to do
    assert not malloc.keep_freed_memory(32 << 20)
    assert malloc.keep_freed_memory(64 << 20)
    assert calls[2:] == [(-3, malloc.MMAP_THRESHOLD), (-2, 64 << 20)]


def test_nothing_is_kept_for_zero_or_where_the_user_set_the_allocator(calls, monkeypatch):
    assert not malloc.keep_freed_memory(0)
    monkeypatch.setenv("MALLOC_TRIM_THRESHOLD_", "131072")
    assert not malloc.keep_freed_memory(64 << 20)
    monkeypatch.delenv("MALLOC_TRIM_THRESHOLD_")
    monkeypatch.setenv("GLIBC_TUNABLES", "glibc.malloc.top_pad=0")
    assert not malloc.keep_freed_memory(64 << 20)
    assert calls == []


def test_a_refused_setting_is_not_recorded_as_applied(monkeypatch, calls):
    monkeypatch.setattr(malloc, "_glibc_mallopt", lambda: lambda param, value: 0)
    assert not malloc.keep_freed_memory(64 << 20)
    assert malloc._kept == [0]


FAULTS = textwrap.dedent(
    """
    import resource, sys
    import numpy as np
    from opsched.devices.malloc import keep_freed_memory

    if sys.argv[1] == "keep":
        assert keep_freed_memory(64 << 20)

    def burst():  # a launch's results, allocated, written, then dropped together
        results = [np.ones(16384, np.float32) for _ in range(64)]  # 64 KiB each
        del results

    burst()
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(10):
        burst()
    print((resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / 640)
    """
)


@pytest.mark.skipif(not GLIBC, reason="glibc's malloc only")
def test_kept_memory_serves_the_next_burst_of_results_without_page_faults():
    # In a process of its own: the setting is the whole process's. Without it, glibc gives
    # the freed burst back to the system and each 64 KiB result faults its pages in again.
    def faults(mode):
        proc = subprocess.run(
            [sys.executable, "-c", FAULTS, mode],
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
        assert proc.returncode == 0, proc.stderr
        return float(proc.stdout)

    assert faults("default") >= 8  # per 64 KiB result (16 pages): the memory went back
    assert faults("keep") < 1


def test_the_scheduler_applies_its_config_on_host_devices(calls):
    import opsched.sync

    with opsched.sync.open_scheduler(malloc_keep_bytes=8 << 20):
        pass
    assert calls[-1] == (-2, 8 << 20)
    calls.clear()
    with opsched.sync.open_scheduler(malloc_keep_bytes=0):
        pass
    assert calls == []


def test_torch_cpu_applies_it_too(calls):
    # torch allocates CPU tensors with the C library's malloc: a torch:cpu scheduler's
    # launch outputs are dropped in bursts like a host device's results.
    pytest.importorskip("torch")
    import opsched.sync

    with opsched.sync.open_scheduler(device="torch:cpu", malloc_keep_bytes=8 << 20):
        pass
    assert calls[-1] == (-2, 8 << 20)
    calls.clear()
    with opsched.sync.open_scheduler(device="torch:cpu", malloc_keep_bytes=0):
        pass
    assert calls == []


@pytest.mark.parametrize("device", ["cpu", "reference", "torch:cpu"])
def test_a_scheduler_left_at_its_defaults_changes_no_process_wide_setting(calls, device):
    if device.startswith("torch"):
        pytest.importorskip("torch")
    import opsched.sync

    with opsched.sync.open_scheduler(device=device):
        pass
    assert calls == []  # the application did not ask: glibc's malloc is left alone
