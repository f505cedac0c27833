"""Finding 5 of the fourth hostile pass, the admin holes: what ``--admin-api deny`` left
open.

- Ollama's ``keep_alive: 0`` on ``/api/generate`` and ``/api/chat`` (and the embedding
  paths) unloads the model: an admin action in an ordinary request's body. Refused with
  the same 403 as the admin paths (never silently stripped: a request is never altered);
  any other ``keep_alive`` passes.
- ``GET /cors-proxy`` (llama-server's web UI proxy, which fetches any URL it is given from
  the engine's host) was relayed, only its other methods checked. Refused too.

With ``--admin-api allow`` both reach the engine as before. The proxy on loopback, a fake
engine, the Ollama and httpx clients.
"""

from __future__ import annotations

import httpx
import pytest

from ...support.fake_engine import FakeEngine
from ...support.servers import metric_samples, sample, start_proxy


@pytest.fixture(scope="module", params=["deny", "allow"])
def scene(request):
    engine = FakeEngine(models=["m"]).start()
    proxy = start_proxy(
        f"e={engine.url}",
        args=["--engine", "e=ollama", "--admin-api", request.param, "--engine-scrape", "0"],
    )
    try:
        yield request.param, engine, proxy
    finally:
        proxy.stop()
        engine.stop()


def _reached(engine: FakeEngine, before: int, path: str) -> int:
    return sum(1 for r in engine.requests[before:] if r.target.split("?")[0] == path)


@pytest.mark.parametrize(
    "path, keep_alive, unloads",
    [
        ("/api/generate", 0, True),
        ("/api/chat", 0, True),
        ("/api/generate", "0s", True),
        ("/api/chat", "0", True),
        ("/api/embed", 0.0, True),
        ("/api/generate", "5m", False),
        ("/api/chat", -1, False),
        ("/api/generate", None, False),
    ],
)
def test_keep_alive_zero_is_an_admin_action(scene, path, keep_alive, unloads):
    mode, engine, proxy = scene
    body: dict = {"model": "m", "prompt": "", "messages": [], "stream": False}
    if keep_alive is not None:
        body["keep_alive"] = keep_alive
    before = len(engine.requests)
    refused = sample(metric_samples(proxy.url), "phasewatch_rejected_total", reason="admin_api")
    r = httpx.post(proxy.url + path, json=body, timeout=30)
    reached = _reached(engine, before, path)
    now = sample(metric_samples(proxy.url), "phasewatch_rejected_total", reason="admin_api")
    print(
        f"--admin-api {mode}: {path} keep_alive={keep_alive!r}: {r.status_code}, reached {reached}"
    )
    if unloads and mode == "deny":
        assert r.status_code == 403, r.text
        message = r.json()["error"]
        message = message if isinstance(message, str) else message["message"]
        assert "keep_alive 0" in message and "--admin-api deny" in message, message
        assert reached == 0
        assert now == refused + 1
    else:
        assert r.status_code != 403, r.text
        assert reached == 1
        assert now == refused


def test_get_cors_proxy_is_an_admin_route(scene):
    mode, engine, proxy = scene
    before = len(engine.requests)
    r = httpx.get(proxy.url + "/cors-proxy", params={"url": "http://169.254.169.254/"}, timeout=30)
    reached = _reached(engine, before, "/cors-proxy")
    print(f"--admin-api {mode}: GET /cors-proxy: {r.status_code}, reached {reached}")
    if mode == "deny":
        assert r.status_code == 403 and reached == 0
    else:
        assert reached == 1
