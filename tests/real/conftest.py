"""Fixtures of the `real_engine` tier: real llama-server and vLLM processes, each with a
phasewatch proxy in front, on loopback.

Selection: a plain ``pytest`` runs them, as CI does after ``.ci/install-engines.sh``; a
developer without the engines can leave them out with PHASEWATCH_REAL_ENGINES=0 (or
``-m "not real_engine"``). They never skip: a missing engine is a test error with the
reason and the fix.
"""

from __future__ import annotations

import pytest

from ..support.servers import start_proxy
from . import engines as E
from .tries import AGREEMENT, Tries


@pytest.fixture
def tries(request):
    """A :class:`Tries` for this test; its rate is printed when the test ends."""
    seen = Tries(request.node)
    yield seen
    if seen.seen:
        print(f"\n{request.node.name}: {seen.rate}")


def pytest_terminal_summary(terminalreporter):
    """Every best-of-N test's agreement rate, after the run, -s or not."""
    rows = {
        report.nodeid: value
        for reports in terminalreporter.stats.values()
        for report in reports
        if getattr(report, "when", None) == "call"
        for key, value in getattr(report, "user_properties", ())
        if key == AGREEMENT
    }
    if rows:
        terminalreporter.write_sep("-", "real engines: best-of-N agreement")
        for nodeid, rate in sorted(rows.items()):
            terminalreporter.write_line(f"{nodeid}: {rate}")


@pytest.fixture(scope="session")
def engines_manifest():
    try:
        return E.load_manifest()
    except E.EnginesMissing as exc:
        pytest.fail(f"real engines not installed: {exc}", pytrace=False)


@pytest.fixture(scope="session")
def llama(engines_manifest):
    try:
        server = E.start_llama_server(engines_manifest)
    except E.EnginesMissing as exc:
        pytest.fail(str(exc), pytrace=False)
    print(f"\nllama-server healthy {server.started_s:.1f}s after launch ({server.url})")
    yield server
    server.stop()


@pytest.fixture(scope="session")
def llama_proxy(llama):
    proxy = start_proxy(f"llama={llama.url}")
    yield proxy
    proxy.stop()


@pytest.fixture(scope="session")
def vllm(engines_manifest):
    try:
        server = E.start_vllm(engines_manifest)
    except E.EnginesMissing as exc:
        pytest.fail(str(exc), pytrace=False)
    print(f"\nvLLM healthy {server.started_s:.1f}s after launch ({server.url})")
    yield server
    server.stop()


@pytest.fixture(scope="session")
def vllm_proxy(vllm):
    proxy = start_proxy(f"vllm={vllm.url}")
    yield proxy
    proxy.stop()


@pytest.fixture(scope="session")
def llama_proxy_no_inject(llama):
    """A proxy that does not ask the engine for usage (PHASEWATCH_INJECT_USAGE=false)."""
    proxy = start_proxy(f"llama={llama.url}", env={"PHASEWATCH_INJECT_USAGE": "false"})
    yield proxy
    proxy.stop()
