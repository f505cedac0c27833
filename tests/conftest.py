"""Shared fixtures: a simulator and a proxy in front of it, real processes on loopback."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from .support.servers import start_proxy, start_sim

HERE = Path(__file__).resolve().parent

#: The tiers a plain ``pytest`` runs, each with the variable that leaves it out ("0"):
#: deselected, never skipped, so a missing engine or podman is loud unless asked for.
TIERS = {"real": "PHASEWATCH_REAL_ENGINES", "containers": "PHASEWATCH_CONTAINERS"}


def pytest_collection_modifyitems(config, items):
    off = {HERE / folder for folder, variable in TIERS.items() if os.environ.get(variable) == "0"}
    if not off:
        return
    keep, drop = [], []
    for item in items:
        (drop if off & set(Path(str(item.fspath)).resolve().parents) else keep).append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep


@pytest.fixture(scope="session")
def sim():
    """A deterministic simulated vLLM, sped up 4x so tests stay short."""
    server = start_sim("vllm", speed=4.0, deterministic=True)
    yield server
    server.stop()


@pytest.fixture(scope="session")
def proxy(sim):
    server = start_proxy(f"sim={sim.url}")
    yield server
    server.stop()
