"""Request bodies through the relay, from a client on loopback to an engine on loopback
(the proxy in process): a body no parser expects reaches the engine as the client sent
it, and the body limit is a 413 whether the length is declared or only found while
reading, with nothing sent upstream."""

from __future__ import annotations

import httpx
import pytest

from ...support.fake_engine import FakeEngine, Reply, Request, json_response
from ...support.servers import wait_for
from .test_relay_unit import count, relay_to


def ok(req: Request) -> Reply | None:
    """Every POST answered 200 without reading its body (the standard answer parses it)."""
    return Reply(json_response(200, {"ok": True})) if req.method == "POST" else None


def post(url: str, body, headers: dict[str, str]) -> httpx.Response:
    """POST /v1/chat/completions; `body` bytes (declared length) or an iterator of pieces
    (chunked, no length)."""
    return httpx.post(url + "/v1/chat/completions", content=body, headers=headers, timeout=30)


@pytest.mark.parametrize(
    "body",
    [
        b"not json at all",
        b"[" * 100000 + b"]" * 100000,  # deeper than any JSON parser recurses
        b'{"model": 5, "stream": "yes", "stream_options": [1], "messages": {}}',
        b'{"model": null, "stream": true, "stream_options": "x"}',
        b'{"model": "m", "stream": 1}',
        b'{"model": "m", "stream": true, "stream_options": null}',
        '{"model": "m\u0000\ud83d\ude00", "stream": false}'.encode("utf-8", "surrogatepass"),
        b"\xff\xfe\x00garbage",
    ],
)
def test_odd_bodies_reach_the_engine_unaltered(body):
    with FakeEngine(ok, models=["m"]) as engine, relay_to(engine, "openai") as proxy:
        resp = post(proxy.url, body, {"content-type": "application/json"})
        assert resp.status_code == 200
        (request,) = engine.posts()
        assert request.body == body


def test_body_limit_is_a_413():
    with (
        FakeEngine(ok, models=["m"]) as engine,
        relay_to(engine, "openai", max_body_bytes=1000) as p,
    ):
        resp = post(p.url, b"x" * 1001, {})
        assert resp.status_code == 413
        assert "1000 bytes" in resp.json()["error"]["message"]
        # no content-length: the limit still holds while reading
        resp = post(p.url, iter([b"y" * 100] * 20), {})
        assert resp.request.headers["transfer-encoding"] == "chunked"
        assert resp.status_code == 413
        assert engine.posts() == []  # nothing reached the engine
        wait_for(
            lambda: count(p.metrics, "phasewatch_rejected_total", reason="body_too_large") == 2,
            what="both refusals counted",
        )
