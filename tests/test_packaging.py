"""What an installed package offers: its version, its license, its profiles by name."""

from __future__ import annotations

import asyncio
import importlib.metadata
from pathlib import Path

import pytest

import opsched
from opsched import SchedulerConfig
from opsched.cli.main import main

ROOT = Path(__file__).resolve().parent.parent


def test_the_version_comes_from_the_package_metadata(capsys):
    assert opsched.__version__ == importlib.metadata.version("opsched")
    with pytest.raises(SystemExit) as exit_:
        main(["--version"])
    assert exit_.value.code == 0
    assert capsys.readouterr().out == f"opsched {opsched.__version__}\n"


def test_the_license_is_the_declared_one():
    assert (ROOT / "LICENSE").read_text().startswith("MIT License")
    assert importlib.metadata.metadata("opsched")["License-Expression"] == "MIT"


def test_the_shipped_profiles_load_by_name_and_by_path():
    assert SchedulerConfig.profiles() == ["default", "latency", "throughput"]
    for name in SchedulerConfig.profiles():
        by_name = SchedulerConfig.load(name)
        assert by_name == SchedulerConfig.load(ROOT / "configs" / f"{name}.toml")
    assert SchedulerConfig.load("default") == SchedulerConfig()
    assert SchedulerConfig.load("throughput").max_delay_us == 200.0


def test_an_unknown_profile_names_the_known_ones():
    with pytest.raises(FileNotFoundError, match=r"fast: no such file.*default, latency"):
        SchedulerConfig.load("fast")


def test_open_scheduler_and_the_command_take_a_profiles_name(capsys):
    async def main_():
        async with opsched.open_scheduler(config="latency") as sched:
            return sched.config

    assert asyncio.run(main_()) == SchedulerConfig.load("latency")
    assert main(["demo", "--config", "no-such-profile"]) == 2
    assert "no-such-profile: no such file" in capsys.readouterr().err
