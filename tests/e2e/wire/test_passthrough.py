"""Byte-exact passthrough against real vLLM captures, with and without injected usage.

A replay upstream answers every request with the bytes the real vLLM 0.32 sent for it.
Each case sends the same request once directly and once through phasewatch and asserts
equal status, end-to-end headers and body bytes. Where the client did not ask for usage,
phasewatch asks the engine for it (the replay then serves the include_usage capture) and
must strip it back to exactly the plain capture, system_fingerprint placement included.
"""

from __future__ import annotations

import httpx
import pytest

from ...support.replay import VLLM_REAL, ReplayApp, ThreadServer
from ...support.servers import free_port, metric_samples, sample, start_proxy

FOLDERS = ("raw-words", "raw")


@pytest.fixture(scope="module", params=FOLDERS)
def replay(request):
    app = ReplayApp(VLLM_REAL / request.param)
    server = ThreadServer(app, free_port()).start()
    proxy = start_proxy(f"vllm={server.url}", args=["--engine-scrape", "0"])
    yield app, server, proxy
    proxy.stop()
    server.stop()


def _request_of(app: ReplayApp, name: str):
    for cap in app.captures.values():
        if cap.name == name:
            return cap
    raise AssertionError(f"capture {name} missing")


def _headers(resp: httpx.Response) -> list[tuple[str, str]]:
    return [(k, v) for k, v in resp.headers.multi_items() if k not in ("date", "server")]


CASES = [
    # (the client's request, the capture the engine must have served for the proxied one)
    ("chat_stream", "chat_stream_usage"),  # proxy injects usage and strips it again
    ("chat_stream_usage", "chat_stream_usage"),  # client asked: nothing stripped
    ("chat_stream_opts_empty", "chat_stream_opts_empty"),  # vLLM reads {} as include_usage
    ("chat_stream_usage_false", "chat_stream_usage"),  # explicit false: inject, strip
    ("chat_stream_usage_continuous", "chat_stream_usage_continuous"),  # never touched
    ("chat_nonstream", "chat_nonstream"),
    ("completions_stream", "completions_stream_usage"),
    ("completions_stream_usage", "completions_stream_usage"),
    ("completions_nonstream", "completions_nonstream"),
    ("err_unknown_model_stream", "err_unknown_model_stream"),
    ("err_stream_options_without_stream", "err_stream_options_without_stream"),
    ("err_invalid_json", "err_invalid_json"),
    ("err_404_path", "err_404_path"),
]


@pytest.mark.parametrize("source,served", CASES, ids=[c[0] for c in CASES])
def test_bytes_equal_direct(replay, source, served):
    app, server, proxy = replay
    cap = _request_of(app, source)
    headers = {"content-type": "application/json"} if cap.request_body else {}
    direct = httpx.request(
        cap.method, server.url + cap.path, content=cap.request_body, headers=headers
    )
    served_before = len(app.served)
    via = httpx.request(cap.method, proxy.url + cap.path, content=cap.request_body, headers=headers)
    # (phasewatch's own readiness probes of the engine's /health may interleave)
    assert [name for name in app.served[served_before:] if name != "health"] == [served]
    assert via.status_code == direct.status_code
    assert _headers(via) == _headers(direct)
    assert via.content == direct.content == cap_body(app, source)


def cap_body(app: ReplayApp, name: str) -> bytes:
    return _request_of(app, name).body


def test_usage_is_read_even_though_stripped(replay):
    """The stripped usage still feeds the token counters (the reason to inject it)."""
    app, server, proxy = replay
    cap = _request_of(app, "chat_stream")
    before = sample(metric_samples(proxy.url), "phasewatch_tokens_total", phase="decode")
    resp = httpx.post(
        proxy.url + cap.path, content=cap.request_body, headers={"content-type": "application/json"}
    )
    assert b'"usage"' not in resp.content
    after = sample(metric_samples(proxy.url), "phasewatch_tokens_total", phase="decode")
    assert after - before == 8  # the usage event said completion_tokens 8


def test_hop_by_hop_headers_not_forwarded(replay):
    app, server, proxy = replay
    cap = _request_of(app, "chat_nonstream")
    resp = httpx.post(
        proxy.url + cap.path,
        content=cap.request_body,
        headers={
            "content-type": "application/json",
            "connection": "keep-alive, x-hop",
            "x-hop": "secret-hop",
            "te": "trailers",
        },
    )
    assert resp.status_code == 200
    assert resp.content == cap.body
