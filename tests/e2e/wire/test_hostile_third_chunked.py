"""Finding 8 of the third hostile-wire pass: a malformed chunked request body.

A body the parser rejects (a bad size line, a chunk longer than its size, a NUL in a
chunk extension, a ``content-length`` field in the trailer section) is answered with a
400 as soon as it is read, and the connection is closed: before, the request being
answered was never told and waited in ``receive()`` for ``--body-timeout`` (a 408), the
connection held all that time. The proxy on loopback, raw sockets, an engine that would
answer any request it got (it must get none of these)."""

from __future__ import annotations

import json
import socket

import pytest

from ...support.fake_engine import FakeEngine
from ...support.hostile import MODEL, connect, fds
from ...support.servers import start_proxy, wait_for
from .test_hostile_wire import log_lines, metrics

BODY = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}).encode()
HEAD = (
    b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
    b"transfer-encoding: chunked\r\n\r\n"
)
GOOD = b"%x\r\n" % len(BODY) + BODY + b"\r\n"

#: What follows a first well-formed chunk (the request is running, reading its body).
MALFORMED = {
    "bad size line": b"zz\r\nhello\r\n0\r\n\r\n",
    "chunk longer than its size": b"2\r\nhello\r\n0\r\n\r\n",
    "NUL in an extension": b"5;ext=a\x00b\r\nhello\r\n0\r\n\r\n",
    "content-length trailer": b"0\r\ncontent-length: 5\r\n\r\nhello",
}
#: Far beyond the test's own waits: an answer that took it would be the old 408.
BODY_TIMEOUT = "600"


@pytest.fixture(scope="module")
def proxy():
    engine = FakeEngine(models=[MODEL]).start()
    p = start_proxy(
        f"e={engine.url}", args=["--engine", "e=openai", "--body-timeout", BODY_TIMEOUT]
    )
    yield p, engine
    p.stop()
    engine.stop()


def _answer_and_close(s: socket.socket) -> tuple[bytes, bool]:
    """The proxy's answer, and whether it then closed the connection."""
    data = b""
    try:
        while True:
            piece = s.recv(65536)
            if not piece:
                return data, True
            data += piece
    except ConnectionResetError:
        return data, True
    except TimeoutError:
        return data, False


@pytest.mark.parametrize("case", list(MALFORMED))
def test_a_malformed_chunked_body_gets_a_400_at_once_and_the_close(proxy, case):
    p, engine = proxy
    posts = len([r for r in engine.requests if r.method == "POST"])
    s = connect(p.url, timeout=20)  # the proxy's --body-timeout is 600 s
    try:
        s.sendall(HEAD + GOOD)
        s.sendall(MALFORMED[case])
        data, closed = _answer_and_close(s)
    finally:
        s.close()
    assert data.startswith(b"HTTP/1.1 400 "), data[:200]
    assert closed, "the connection stayed open after the 400"
    assert b"malformed request body" in data
    assert len([r for r in engine.requests if r.method == "POST"]) == posts  # nothing sent


def test_malformed_chunked_bodies_from_100_connections_hold_no_fds(proxy):
    p, engine = proxy
    pid = p.proc.pid
    base = fds(pid)
    before = metrics(p).get(("phasewatch_rejected_total", (("reason", "bad_chunked"),)), 0.0)
    conns = []
    try:
        for i in range(100):
            s = connect(p.url, timeout=20)
            s.sendall(HEAD + GOOD + list(MALFORMED.values())[i % len(MALFORMED)])
            conns.append(s)
        for s in conns:
            data, closed = _answer_and_close(s)
            assert data.startswith(b"HTTP/1.1 400 ") and closed
    finally:
        for s in conns:
            s.close()
    # well before the 600 s body timeout: every connection released
    wait_for(lambda: fds(pid) <= base, timeout=20, what="the connections' fds released")
    after = metrics(p)[("phasewatch_rejected_total", (("reason", "bad_chunked"),))]
    assert after - before == 100
    assert log_lines(p, "malformed chunked request body")
