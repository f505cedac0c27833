"""Findings 3 and 5 of the fourth hostile pass, on the wire: what a client's bytes must not
do.

- ``Upgrade: h2c`` on a POST: the body reached the engine as ``Content-Length: 0``; now
  the upgrade is declined and the request served as HTTP/1.1, its body whole.
- 10,000 small header fields (50 kB, within the head limit) reached the engine whole; now
  a head of more than ``--max-header-fields`` fields gets a 431 before any work.
- An HTTP/0.9 request line (``GET /v1/models``, no version) was relayed as an HTTP/1.1 GET;
  now it gets a 400 and nothing is relayed.
- ``Expect: 100-continue`` with no body (none announced) waited for a body for
  ``--body-timeout``, then got a 408; now it is answered at once.

The proxy on loopback, a byte-level fake engine, raw sockets.
"""

from __future__ import annotations

import json
import time

import pytest

from ...support.fake_engine import FakeEngine
from ...support.hostile import connect, read_all, read_response
from ...support.servers import metric_samples, sample, start_proxy

BODY = b'{"model":"fake-model","messages":[{"role":"user","content":"x"}]}'


@pytest.fixture(scope="module")
def scene():
    engine = FakeEngine().start()
    proxy = start_proxy(f"e={engine.url}", args=["--engine", "e=openai", "--body-timeout", "30"])
    try:
        yield engine, proxy
    finally:
        proxy.stop()
        engine.stop()


def _chat_posts(engine: FakeEngine) -> list:
    return [r for r in engine.posts() if "chat/completions" in r.target]


def test_an_h2c_upgrade_on_a_post_keeps_its_body(scene):
    engine, proxy = scene
    before = len(_chat_posts(engine))
    s = connect(proxy.url)
    s.sendall(
        b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\nconnection: Upgrade, HTTP2-Settings\r\n"
        b"upgrade: h2c\r\nhttp2-settings: AAMAAABkAAQCAAAAAAIAAAAA\r\n"
        b"content-type: application/json\r\ncontent-length: %d\r\n\r\n" % len(BODY) + BODY
    )
    got = read_response(s)
    s.close()
    posts = _chat_posts(engine)[before:]
    sent = [(p.header("content-length"), p.body) for p in posts]
    print(f"h2c POST with a {len(BODY)}-byte body: the engine got {sent}")
    assert got.startswith(b"HTTP/1.1 200 "), got[:200]
    assert b" 101 " not in got.split(b"\r\n", 1)[0]
    assert sent == [(str(len(BODY)), BODY)]
    # not switched, nor passed on: the upgrade is the connection's, not the engine's
    assert posts[0].header("upgrade") is None and posts[0].header("http2-settings") is None


def test_an_h2c_upgrade_with_a_chunked_body_keeps_it_too(scene):
    engine, proxy = scene
    before = len(_chat_posts(engine))
    s = connect(proxy.url)
    s.sendall(
        b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\nconnection: Upgrade\r\n"
        b"upgrade: h2c\r\ncontent-type: application/json\r\ntransfer-encoding: chunked\r\n\r\n"
        + b"%x\r\n" % len(BODY)
        + BODY
        + b"\r\n0\r\n\r\n"
    )
    got = read_response(s)
    s.close()
    assert got.startswith(b"HTTP/1.1 200 "), got[:200]
    assert [p.body for p in _chat_posts(engine)[before:]] == [BODY]


def test_ten_thousand_small_header_fields_get_a_431(scene):
    engine, proxy = scene
    before = len(engine.requests)
    fields = b"x:v\r\n" * 10_000  # 50 kB: within the head limit
    s = connect(proxy.url)
    s.sendall(
        b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
        + fields
        + b"content-length: %d\r\n\r\n" % len(BODY)
        + BODY
    )
    got = read_all(s)
    s.close()
    reached = [len(r.headers) for r in engine.requests[before:]]
    print(f"{len(fields)} bytes in 10,000 fields: answer {got[:40]!r}, engine got {reached}")
    assert got.startswith(b"HTTP/1.1 431 "), got[:200]
    assert b"header fields" in got and b"--max-header-fields" in got
    assert not reached
    assert sample(metric_samples(proxy.url), "phasewatch_rejected_total", reason="too_many_headers")
    # a head within the count still passes, its fields whole
    s = connect(proxy.url)
    some = b"".join(b"x-f%d: v\r\n" % i for i in range(90))
    s.sendall(b"GET /v1/models HTTP/1.1\r\nhost: x\r\n" + some + b"\r\n")
    assert read_response(s).startswith(b"HTTP/1.1 200 ")
    s.close()


@pytest.mark.parametrize("line", [b"GET /v1/zz-nine\r\n\r\n", b"GET /v1/zz-nine HTTP/0.9\r\n\r\n"])
def test_an_http_0_9_request_is_refused_not_relayed(scene, line):
    engine, proxy = scene
    s = connect(proxy.url)
    s.sendall(line)
    got = read_all(s)
    s.close()
    reached = [(r.method, r.target) for r in engine.requests if "zz-nine" in r.target]
    print(f"HTTP/0.9 {line!r}: answer {got[:40]!r}, engine got {reached}")
    assert got.startswith(b"HTTP/1.1 505 "), got[:200]
    assert not reached
    assert sample(metric_samples(proxy.url), "phasewatch_rejected_total", reason="bad_version")


def test_expect_100_continue_without_a_body_is_answered_at_once(scene):
    engine, proxy = scene
    before = len(engine.requests)
    s = connect(proxy.url)
    start = time.monotonic()
    s.sendall(b"GET /v1/models HTTP/1.1\r\nhost: x\r\nexpect: 100-continue\r\n\r\n")
    got = read_response(s)
    took = time.monotonic() - start
    s.close()
    print(f"Expect: 100-continue, no body: {got[:40]!r} after {took:.3f} s")
    # no interim answer for a body that is not coming: the answer itself
    assert got.startswith(b"HTTP/1.1 200 "), got[:200]
    assert json.loads(got.partition(b"\r\n\r\n")[2])["data"]
    assert [r.target for r in engine.requests[before:]].count("/v1/models") >= 1


def test_expect_100_continue_with_a_body_to_come_gets_its_100_first(scene):
    engine, proxy = scene
    before = len(_chat_posts(engine))
    s = connect(proxy.url)
    s.sendall(
        b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\nexpect: 100-continue\r\n"
        b"content-type: application/json\r\ncontent-length: %d\r\n\r\n" % len(BODY)
    )
    interim = b""
    while b"\r\n\r\n" not in interim:
        piece = s.recv(4096)
        assert piece, interim
        interim += piece
    assert interim == b"HTTP/1.1 100 Continue\r\n\r\n", interim
    s.sendall(BODY)
    got = read_response(s)
    s.close()
    assert got.startswith(b"HTTP/1.1 200 "), got[:200]
    assert [p.body for p in _chat_posts(engine)[before:]] == [BODY]


def test_the_header_field_limit_is_set_by_its_variable_and_said_once():
    engine = FakeEngine().start()
    proxy = start_proxy(
        f"e={engine.url}",
        args=["--engine", "e=openai"],
        env={"PHASEWATCH_MAX_HEADER_FIELDS": "20"},
    )
    try:
        codes = []
        for n in (15, 25, 25):
            s = connect(proxy.url)
            s.sendall(b"GET /v1/models HTTP/1.1\r\nhost: x\r\n" + b"x-f: v\r\n" * n + b"\r\n")
            codes.append(read_response(s).split(b" ", 2)[1])
            s.close()
        assert codes == [b"200", b"431", b"431"]
        refused = sample(metric_samples(proxy.url), "phasewatch_rejected_total")
        assert refused == 2
        lines = [line for line in proxy.log().splitlines() if "header fields" in line]
        assert len(lines) == 1 and "--max-header-fields" in lines[0], lines
    finally:
        proxy.stop()
        engine.stop()
