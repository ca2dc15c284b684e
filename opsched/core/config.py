"""``SchedulerConfig``: every scheduler knob, validated, loadable from TOML.

Each field says what it does, its default and when to change it; ``configs/*.toml`` carry the
same knobs with comments. Validation messages name the field, the value and the range.
"""

from __future__ import annotations

import importlib.resources
import os
import pathlib
import tomllib
from typing import Any

import attrs

from opsched.ops.products import product_named

__all__ = ["SchedulerConfig"]


#: Upper bounds: every knob has one, so no value can stall the scheduler (a delay of
#: hours, a queue no memory holds) or overflow the arithmetic built on it.
_MAX_BYTES = 1 << 48  # 256 TiB
_MAX_COUNT = 1 << 24
_MAX_DELAY_US = 1_000_000.0  # one second


def _int_range(lo: int, hi: int) -> Any:
    def check(instance: object, attribute: attrs.Attribute, value: object) -> None:
        if isinstance(value, bool) or not isinstance(value, int):
            msg = f"SchedulerConfig.{attribute.name} must be an integer, got {value!r}"
            raise TypeError(msg)
        if not lo <= value <= hi:
            msg = f"SchedulerConfig.{attribute.name}={value} is out of range; expected [{lo}, {hi}]"
            raise ValueError(msg)

    return check


def _float_range(lo: float, hi: float) -> Any:
    def check(instance: object, attribute: attrs.Attribute, value: object) -> None:
        if isinstance(value, bool) or not isinstance(value, int | float):
            msg = f"SchedulerConfig.{attribute.name} must be a number, got {value!r}"
            raise TypeError(msg)
        if not lo <= value <= hi:  # also rejects NaN and infinities
            msg = f"SchedulerConfig.{attribute.name}={value} is out of range; expected [{lo}, {hi}]"
            raise ValueError(msg)

    return check


def _product(instance: object, attribute: attrs.Attribute, value: object) -> None:
    try:
        product_named(value)
    except (TypeError, ValueError) as exc:
        raise type(exc)(f"SchedulerConfig.{attribute.name}: {exc}") from None


def _default_streams() -> int:
    return max(1, os.cpu_count() or 1)


@attrs.frozen(kw_only=True)
class SchedulerConfig:
    """The scheduler's knobs. Immutable; ``attrs.evolve(config, field=value)`` derives one.

    Attributes:
        streams: worker streams of the device (default: the number of CPU cores). More
            streams run more launches at once; beyond the core count they only add memory.
        max_delay_us: how long a request may wait for company while a stream is idle
            (default 0: launch at once). Raise it to fuse more at light load, at a latency cost.
        max_batch_requests: the most requests one fused launch takes (default 1024).
        max_batch_bytes: the most bytes (inputs + outputs) one fused launch takes
            (default 64 MiB). On a device that runs launches inline, a fused launch of
            small requests (64 KiB each at most) takes at most ``inline_max_bytes``, so
            that it runs inline (see ``opsched.core.batching.SMALL_FUSED_BYTES``).
        fuse_max_bytes: requests larger than this are launched alone, not gathered into a
            fused launch: the gather copy would cost more than it saves (default 1 MiB).
        split_min_bytes: a request at least this large is split across idle streams
            (default 8 MiB).
        inline_max_bytes: launches this small run inline in the event-loop thread when their
            stream is idle: no thread hops, and no contention for the GIL between a stream
            thread gathering many small requests and a loop thread admitting more, which
            costs more than the launch itself (default 4 MiB, about a millisecond of loop
            time; 0 disables). A lone request of at least 1 MiB launched together with
            others runs on its stream's thread unless it is the last of them: one long
            kernel call, computing while the loop thread runs the last.
        max_queued_requests: queue capacity for callers' submissions; when full, ``await``
            waits (FIFO) and ``*_nowait`` raises QueueFullError (default 65536). The nodes a
            running graph submits, and requests put back after a failed workspace
            reservation, are admitted past it, so the queue may briefly exceed it.
        workspace_limit_bytes: cap of the workspace pool; launches wait at the cap, fused
            launches gather in chunks that fit under it, and a request whose solo launch
            needs more fails (default 1 GiB).
        executor_cache_limit: repeatable executors kept, least recently used evicted
            (default 10000, the device runtime's ACLNN_CACHE_LIMIT).
        malloc_keep_bytes: freed memory glibc's malloc keeps for the next launches' outputs
            instead of giving it back to the system (``M_TOP_PAD``; see
            :mod:`opsched.devices.malloc`), on the host devices and ``torch:cpu`` (whose
            tensors torch allocates with the C library's malloc). A setting of the whole
            process, so off unless asked for (default 0: the allocator is left alone). With
            64 MiB (the ``throughput`` profile), results of 64 KiB-1 MiB each reuse memory
            instead of faulting it in afresh, up to twice as fast; a ``MALLOC_*`` variable
            or ``glibc.malloc`` tunable set by the user always wins.
        product: the Ascend product whose support table every request is checked against
            (default ``"generic"``: every operator, every dtype it takes); see
            ``opsched products``. Set it to the product you will run on, to learn before
            you get hardware time that a request would fail there.
    """

    streams: int = attrs.field(factory=_default_streams, validator=_int_range(1, 256))
    max_delay_us: float = attrs.field(default=0.0, validator=_float_range(0.0, _MAX_DELAY_US))
    max_batch_requests: int = attrs.field(default=1024, validator=_int_range(1, _MAX_COUNT))
    max_batch_bytes: int = attrs.field(default=64 << 20, validator=_int_range(1, _MAX_BYTES))
    fuse_max_bytes: int = attrs.field(default=1 << 20, validator=_int_range(0, _MAX_BYTES))
    split_min_bytes: int = attrs.field(default=8 << 20, validator=_int_range(1, _MAX_BYTES))
    inline_max_bytes: int = attrs.field(default=4 << 20, validator=_int_range(0, _MAX_BYTES))
    max_queued_requests: int = attrs.field(default=65536, validator=_int_range(1, _MAX_COUNT))
    workspace_limit_bytes: int = attrs.field(default=1 << 30, validator=_int_range(1, _MAX_BYTES))
    executor_cache_limit: int = attrs.field(default=10000, validator=_int_range(1, _MAX_COUNT))
    malloc_keep_bytes: int = attrs.field(default=0, validator=_int_range(0, 1 << 30))
    product: str = attrs.field(default="generic", validator=_product)

    @classmethod
    def load(cls, source: str | os.PathLike[str]) -> SchedulerConfig:
        """A config from a profile shipped with opsched, by name (``"default"``,
        ``"throughput"``, ``"latency"``: :meth:`profiles`), or from a TOML file's path.

        Raises:
            FileNotFoundError: neither a profile's name nor an existing file (the message
                names the profiles).
            ValueError, TypeError: as :meth:`from_toml`.
        """
        path = pathlib.Path(source)
        if path.exists():
            return cls.from_toml(path)
        if isinstance(source, str) and source in cls.profiles():
            profile = importlib.resources.files("opsched.configs").joinpath(f"{source}.toml")
            with importlib.resources.as_file(profile) as found:
                return cls.from_toml(found)
        msg = (
            f"{source}: no such file, nor a profile of opsched's (profiles: "
            f"{', '.join(cls.profiles())})"
        )
        raise FileNotFoundError(msg)

    @staticmethod
    def profiles() -> list[str]:
        """The names of the profiles shipped with opsched."""
        found = importlib.resources.files("opsched.configs").iterdir()
        return sorted(p.name.removesuffix(".toml") for p in found if p.name.endswith(".toml"))

    @classmethod
    def from_toml(cls, path: str | os.PathLike[str]) -> SchedulerConfig:
        """Load a config from a TOML file of top-level ``key = value`` knobs.

        Raises:
            FileNotFoundError: no such file.
            ValueError: not valid TOML, a key that is not a knob (named with the valid
                ones), or a bad value; the message starts with the file's path.
            TypeError: a value of the wrong kind (the message starts with the path).
        """
        with pathlib.Path(path).open("rb") as f:
            try:
                data = tomllib.load(f)
            except tomllib.TOMLDecodeError as exc:
                msg = f"{path}: not valid TOML: {exc}"
                raise ValueError(msg) from exc
        try:
            return cls.from_mapping(data, source=str(path))
        except (TypeError, ValueError) as exc:
            if str(exc).startswith(str(path)):
                raise
            raise type(exc)(f"{path}: {exc}") from exc

    @classmethod
    def from_mapping(cls, data: dict[str, Any], *, source: str = "overrides") -> SchedulerConfig:
        """Build a config from a mapping, rejecting unknown keys."""
        return cls.defaults().evolve(data, source=source)

    @classmethod
    def defaults(cls) -> SchedulerConfig:
        """The default configuration."""
        return cls()

    def evolve(self, changes: dict[str, Any], *, source: str = "overrides") -> SchedulerConfig:
        """Return a copy with ``changes`` applied, rejecting unknown keys."""
        known = {a.name for a in attrs.fields(SchedulerConfig)}
        unknown = sorted(set(changes) - known)
        if unknown:
            msg = f"{source}: unknown scheduler setting(s) {unknown}; valid: {sorted(known)}"
            raise ValueError(msg)
        return attrs.evolve(self, **changes)
