"""Shared fixtures: a simulator and a proxy in front of it, real processes on loopback."""

from __future__ import annotations

import pytest

from .servers import start_proxy, start_sim


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
