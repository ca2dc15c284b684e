"""The workspace pool, the executor cache and SchedulerConfig (no event loop)."""

from __future__ import annotations

import pathlib
import tomllib

import attrs
import numpy as np
import pytest

from opsched import SchedulerConfig, aclnn
from opsched.devices import Event
from opsched.devices.cache import ExecutorCache
from opsched.devices.pool import WorkspacePool, size_class

ROOT = pathlib.Path(__file__).resolve().parents[2]


# ---------------------------------------------------------------------------------- pool


@pytest.mark.parametrize(
    ("n", "cls"),
    [
        (1, 512),
        (512, 512),
        (513, 640),
        (1000, 1024),
        (1025, 1280),
        (5000, 5120),
        (1 << 20, 1 << 20),
        ((1 << 20) + 1, 1310720),
    ],
)
def test_size_classes(n, cls):
    assert size_class(n) == cls >= n
    assert size_class(n) <= max(512, n * 1.25 + 1)  # at most 25% rounding waste


def test_pool_serves_from_a_larger_cached_block_up_to_twice_the_size():
    pool = WorkspacePool(1 << 20)
    big = pool.allocate(2048, 0)
    pool.release(big)
    assert pool.allocate(1024, 0) is big  # 2048 <= 2 x 1024: reused
    pool.release(big)
    assert pool.allocate(512, 0) is not big  # 2048 > 2 x 512: a new block
    assert pool.statistics().misses == 2


def test_pool_reuses_a_block_on_its_stream():
    pool = WorkspacePool(1 << 20)
    a = pool.allocate(1000, stream=0)
    pool.release(a)
    b = pool.allocate(900, stream=0)  # same size class
    assert b is a
    s = pool.statistics()
    assert (s.hits, s.misses, s.current, s.in_use, s.allocated) == (1, 1, 1024, 1024, 1024)


def test_block_moves_to_another_stream_only_after_its_event_completed():
    pool = WorkspacePool(1 << 20)
    a = pool.allocate(1000, stream=0)
    event = Event()
    pool.release(a, event)
    b = pool.allocate(1000, stream=1)
    assert b is not a  # the launch that used a may still be running on stream 0
    pool.release(b)
    event._complete()
    c = pool.allocate(1000, stream=2)
    assert c is a or c is b
    assert c.stream == 2


def test_pool_at_cap_returns_none_then_evicts_cached_blocks():
    pool = WorkspacePool(2048)
    a = pool.allocate(1024, 0)
    b = pool.allocate(1024, 0)
    assert pool.allocate(1024, 0) is None  # at the cap: the caller waits
    assert pool.statistics().current == 2048
    pool.release(a)
    pool.release(b)
    big = pool.allocate(2048, 0)  # needs the cached blocks freed first
    assert big is not None and pool.statistics().current == 2048
    assert pool.statistics().freed == 2048
    assert not pool.fits(4096) and pool.fits(2048)


def test_pool_empty_cache_and_peak():
    pool = WorkspacePool(1 << 20)
    blocks = [pool.allocate(4096, 0) for _ in range(3)]
    for b in blocks:
        pool.release(b)
    assert pool.statistics().peak == 3 * 4096
    pool.empty_cache()
    s = pool.statistics()
    assert (s.current, s.cached_blocks, s.freed) == (0, 0, 3 * 4096)
    pool.reset_peak_stats()
    assert pool.statistics().peak == 0
    keys = set(pool.memory_stats())
    assert {"current", "peak", "allocated", "freed", "hits", "misses"} <= keys


# ------------------------------------------------------------------------ executor cache


def executor():
    x = np.zeros((2, 4), np.float32)
    _, ex = aclnn.glu_backward_get_workspace_size(np.zeros((2, 2), np.float32), x, -1, x.copy())
    ex.set_repeatable()
    return ex


def test_graph_intermediates_come_from_the_pool_only_when_large():
    """Large intermediates reuse pooled memory (fresh pages fault); small ones are plain
    arrays, which malloc reuses more cheaply than the pool's bookkeeping."""
    from opsched.devices import make_device
    from opsched.devices.host import POOLED_INTERMEDIATE_BYTES

    device = make_device("cpu", 1)
    f32 = np.dtype(np.float32)
    try:
        small, token = device.intermediate((2, 4, 8), f32)
        assert token is None and small.shape == (2, 4, 8) and small.dtype == f32
        large, token = device.intermediate((POOLED_INTERMEDIATE_BYTES // 4,), f32)
        assert token is not None and large.shape == (POOLED_INTERMEDIATE_BYTES // 4,)
        assert device.memory_statistics().in_use >= POOLED_INTERMEDIATE_BYTES
        device.release(token)
        assert device.memory_statistics().in_use == 0
    finally:
        device.close()


def test_cache_lru_eviction_destroys():
    cache = ExecutorCache(limit=2)
    e1, e2, e3 = executor(), executor(), executor()
    cache.put("a", e1)
    cache.put("b", e2)
    assert cache.lookup("a") is e1  # a is now the most recent
    cache.put("c", e3)  # evicts b
    assert cache.lookup("b") is None
    assert e2.state.value == "destroyed" and e1.state.value == "ready"
    s = cache.statistics()
    assert (s.hits, s.misses, s.evictions, s.size) == (1, 1, 1, 2)
    assert s.hit_rate == 0.5
    cache.clear()
    assert e1.state.value == "destroyed" and cache.statistics().size == 0


# -------------------------------------------------------------------------------- config


def test_config_defaults_and_overrides():
    cfg = SchedulerConfig()
    assert cfg.max_delay_us == 0 and cfg.max_queued_requests == 65536
    assert cfg.executor_cache_limit == 10000 and cfg.streams >= 1
    assert cfg.evolve({"streams": 3}).streams == 3
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        cfg.streams = 2  # type: ignore[misc]


@pytest.mark.parametrize(
    ("field", "value", "error", "words"),
    [
        ("streams", 0, ValueError, "streams=0 is out of range; expected [1, 256]"),
        ("streams", 2.5, TypeError, "streams must be an integer"),
        ("max_delay_us", -1.0, ValueError, "max_delay_us=-1.0 is out of range"),
        ("max_delay_us", float("nan"), ValueError, "max_delay_us=nan"),
        ("max_queued_requests", True, TypeError, "must be an integer"),
        ("workspace_limit_bytes", 0, ValueError, "expected [1, 281474976710656]"),
        # no knob without an upper bound: none of these may stall or overflow the scheduler
        ("max_delay_us", 1e12, ValueError, "max_delay_us=1000000000000.0 is out of range"),
        ("max_delay_us", float("inf"), ValueError, "max_delay_us=inf is out of range"),
        ("max_queued_requests", 1 << 40, ValueError, "expected [1, 16777216]"),
        ("max_batch_requests", 1 << 40, ValueError, "expected [1, 16777216]"),
        ("executor_cache_limit", 1 << 40, ValueError, "expected [1, 16777216]"),
        ("max_batch_bytes", 1 << 60, ValueError, "expected [1, 281474976710656]"),
        ("fuse_max_bytes", -1, ValueError, "expected [0, 281474976710656]"),
        ("split_min_bytes", 1 << 60, ValueError, "expected [1, 281474976710656]"),
        ("inline_max_bytes", 1 << 60, ValueError, "expected [0, 281474976710656]"),
        ("malloc_keep_bytes", -1, ValueError, "malloc_keep_bytes=-1 is out of range"),
        ("malloc_keep_bytes", 1 << 31, ValueError, "expected [0, 1073741824]"),
    ],
)
def test_config_validation_names_field_value_and_range(field, value, error, words):
    with pytest.raises(error) as info:
        SchedulerConfig(**{field: value})
    assert words in str(info.value)


def test_config_from_toml_rejects_unknown_keys(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text("streams = 2\nmax_dealy_us = 5\n")
    with pytest.raises(ValueError, match=r"unknown scheduler setting\(s\) \['max_dealy_us'\]"):
        SchedulerConfig.from_toml(path)
    path.write_text("streams = 2\nmax_delay_us = 50\n")
    cfg = SchedulerConfig.from_toml(path)
    assert (cfg.streams, cfg.max_delay_us) == (2, 50)


@pytest.mark.parametrize("name", ["default", "throughput", "latency"])
def test_shipped_configs_load_with_the_values_they_write(name):
    path = ROOT / "configs" / f"{name}.toml"
    written = tomllib.loads(path.read_text())
    cfg = SchedulerConfig.from_toml(path)
    assert written  # each profile sets knobs
    for key, value in written.items():
        assert getattr(cfg, key) == value, key
    defaults = SchedulerConfig()
    for field in attrs.fields(SchedulerConfig):
        if field.name not in written:
            assert getattr(cfg, field.name) == getattr(defaults, field.name), field.name


@pytest.mark.parametrize(
    ("text", "error", "words"),
    [
        ("streams = 2\nmax_delay_us = [", ValueError, "not valid TOML"),
        ('streams = "two"\n', TypeError, "SchedulerConfig.streams must be an integer"),
        ("max_delay_us = inf\n", ValueError, "max_delay_us=inf is out of range"),
        ("typo = 1\n", ValueError, "unknown scheduler setting(s) ['typo']"),
    ],
)
def test_a_bad_toml_file_is_named_in_the_error(tmp_path, text, error, words):
    path = tmp_path / "bad.toml"
    path.write_text(text)
    with pytest.raises(error) as info:
        SchedulerConfig.from_toml(path)
    assert str(info.value).startswith(str(path)), info.value
    assert words in str(info.value)


def test_overflow_block_beyond_the_cap_is_never_cached():
    pool = WorkspacePool(1024)
    held = pool.allocate(1024, 0)
    assert pool.allocate(512, 0) is None  # at the cap
    extra = pool.allocate(512, 0, overflow=True)
    assert extra is not None and not extra.pooled
    s = pool.statistics()
    assert (s.overflows, s.in_use, s.current) == (1, 1024 + 512, 1024)
    pool.release(extra)
    pool.release(held)
    s = pool.statistics()
    assert (s.in_use, s.current, s.cached_blocks) == (0, 1024, 1)  # the overflow block is gone
