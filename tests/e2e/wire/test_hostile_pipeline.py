"""Hostile wire, second pass: pipelined floods and trailer sections.

The real proxy on loopback in front of the byte-level fake engine
(:class:`tests.support.fake_engine.FakeEngine` with a script), spoken to over raw sockets. A request head is limited per head, however many of them
one write holds; a connection may queue a bounded number of requests (and bytes) ahead of
the one being answered; every refusal comes in its request's turn and the connection is
closed and freed; trailer fields are counted against the head limit and never reach the
engine. Memory is read from ``/proc`` (the growth of the proxy's peak RSS), descriptors
from ``/proc/PID/fd``; every loop is bounded.
"""

from __future__ import annotations

import json
import re
import socket

import httpx
import pytest

from ...support.fake_engine import FakeEngine, Request
from ...support.hostile import MODEL, PeakRss, connect, fds
from ...support.servers import sample, start_proxy, wait_for
from .test_hostile_wire import answer, log_lines, metrics

MiB = 1024 * 1024
KEY = {"authorization": "Bearer k1"}


@pytest.fixture
def engine():
    """An engine that answers each chat request with the text it was sent."""

    async def script(req: Request, reader, writer):
        text = json.loads(req.body)["messages"][0]["content"]
        body = json.dumps(
            {
                "id": "c1",
                "object": "chat.completion",
                "model": MODEL,
                "choices": [{"index": 0, "message": {"role": "assistant", "content": text}}],
                "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
            }
        ).encode()
        writer.write(
            b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n"
            % len(body)
            + body
        )
        await writer.drain()

    e = FakeEngine(models=[MODEL], script=script).start()
    yield e
    e.stop()


def chat_request(text: str, extra: bytes = b"") -> bytes:
    body = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": text}]}).encode()
    return (
        b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
        b"content-length: %d\r\n" % len(body) + extra + b"\r\n" + body
    )


def content_of(response: bytes) -> str:
    return json.loads(response.partition(b"\r\n\r\n")[2])["choices"][0]["message"]["content"]


class Answers:
    """The answers on one connection, one at a time (each has a Content-Length: the
    proxy's own and these engines' answers do), however the reads split them."""

    def __init__(self, s: socket.socket) -> None:
        self.s = s
        self.buf = b""

    def _fill(self) -> bool:
        try:
            data = self.s.recv(65536)
        except ConnectionResetError:
            data = b""
        self.buf += data
        return bool(data)

    def next(self) -> bytes:
        """The next answer, or b"" once the proxy has closed the connection."""
        while b"\r\n\r\n" not in self.buf:
            if not self._fill():
                return b""
        head, _, rest = self.buf.partition(b"\r\n\r\n")
        length = int(re.search(rb"(?i)\r\ncontent-length: *(\d+)", head).group(1))
        while len(rest) < length:
            if not self._fill():
                return b""
            head, _, rest = self.buf.partition(b"\r\n\r\n")
        self.buf = rest[length:]
        return head + b"\r\n\r\n" + rest[:length]

    def until_closed(self, most: int) -> list[bytes]:
        out = []
        for _ in range(most):  # bounded
            r = self.next()
            if not r:
                break
            out.append(r)
        return out


def closed_by_peer(s: socket.socket) -> bool:
    try:
        return s.recv(1) == b""
    except ConnectionResetError:
        return True


# --- 1. pipelined requests -------------------------------------------------------------------


def test_pipelined_requests_over_the_head_limit_in_one_write_are_all_answered_in_order(engine):
    """40 complete requests of ~300 bytes in one write (12 KB, three times the head limit,
    more than the pipeline's 16): every one is answered, in order; none is refused."""
    proxy = start_proxy(
        f"e={engine.url}", args=["--engine", "e=openai", "--max-head-bytes", "4096"]
    )
    try:
        n = 40
        pad = b"x-pad: " + b"p" * 130 + b"\r\n"
        requests = [chat_request(f"req-{i:02}", pad) for i in range(n)]
        size, head = len(requests[0]), requests[0].index(b"\r\n\r\n")
        assert 4096 % size < head  # the limit's byte falls inside a head, not a body
        s = connect(proxy.url, timeout=30)
        s.sendall(b"".join(requests))
        answers = Answers(s)
        got = [answers.next() for _ in range(n)]
        assert [r.split(b"\r\n", 1)[0] for r in got] == [b"HTTP/1.1 200 OK"] * n
        assert [content_of(r) for r in got] == [f"req-{i:02}" for i in range(n)]
        # the connection is still good for one more
        s.sendall(chat_request("after"))
        assert content_of(answers.next()) == "after"
        s.close()
        m = metrics(proxy)
        assert sample(m, "phasewatch_rejected_total") == 0
        assert not log_lines(proxy, "refused a request head")
        assert sample(m, "phasewatch_requests_total", outcome="ok") == n + 1
    finally:
        proxy.stop()


def test_an_oversized_head_behind_pipelined_requests_gets_its_431_in_its_turn(engine):
    proxy = start_proxy(
        f"e={engine.url}", args=["--engine", "e=openai", "--max-head-bytes", "4096"]
    )
    try:
        big = chat_request("big", b"x-big: " + b"b" * 8000 + b"\r\n")
        s = connect(proxy.url, timeout=30)
        s.sendall(chat_request("a") + chat_request("b") + chat_request("c") + big)
        got = Answers(s).until_closed(6)
        assert [content_of(r) for r in got[:3]] == ["a", "b", "c"]
        assert got[3:] == [
            answer(431, "request head over 4096 bytes", "request_header_too_large", close=True)
        ]
        assert closed_by_peer(s)
        s.close()
        assert sample(metrics(proxy), "phasewatch_rejected_total", reason="head_too_large") == 1
        assert [r for r in engine.requests if r.method == "POST"].__len__() == 3
    finally:
        proxy.stop()


def test_a_malformed_request_behind_a_pipelined_one_gets_its_400_after_that_answer(engine):
    proxy = start_proxy(f"e={engine.url}", args=["--engine", "e=openai"])
    try:
        s = connect(proxy.url, timeout=30)
        s.sendall(chat_request("first") + b"NOT HTTP\r\n\r\n")
        got = Answers(s).until_closed(4)
        assert len(got) == 2 and content_of(got[0]) == "first"
        assert got[1].startswith(b"HTTP/1.1 400 Bad Request\r\n")
        assert got[1].endswith(b"Invalid HTTP request received.")
        assert closed_by_peer(s)
        s.close()
    finally:
        proxy.stop()


def test_a_pipelined_flood_past_the_bound_is_refused_in_turn_and_closed(engine):
    """1,000 tiny requests (45 KB) in one write, with room for 1 KiB read ahead of a full
    pipeline: those read before the pipeline filled are answered, then one 429, and the
    connection is closed. (A read short enough to fit would be held, not refused: the
    first read of one loopback write is far longer.)"""
    proxy = start_proxy(
        f"e={engine.url}", args=["--engine", "e=openai", "--max-pipelined-bytes", "1024"]
    )
    try:
        tiny = b"GET /phasewatch/health HTTP/1.1\r\nhost: x\r\n\r\n"
        s = connect(proxy.url, timeout=30)
        s.sendall(tiny * 1000)
        got = Answers(s).until_closed(1001)
        statuses = [r.split(b"\r\n", 1)[0] for r in got]
        assert statuses[-1] == b"HTTP/1.1 429 Too Many Requests", statuses[-3:]
        assert set(statuses[:-1]) == {b"HTTP/1.1 200 OK"} and len(statuses) > 17
        assert got[-1] == answer(
            429,
            "more than 16 pipelined requests on one connection",
            "too_many_pipelined_requests",
            close=True,
        )
        assert closed_by_peer(s)
        s.close()
        assert sample(metrics(proxy), "phasewatch_rejected_total", reason="pipeline_full") == 1
        assert len(log_lines(proxy, "refused a connection from")) == 1
    finally:
        proxy.stop()


def _flood(url: str, request: bytes, conns: int, total: int) -> None:
    """`conns` connections each write `total` bytes of pipelined `request`s in one go,
    read their first answer, and leave (a client that gave up)."""
    socks = [connect(url, timeout=30) for _ in range(conns)]
    flood = request * (total // len(request))
    for s in socks:
        s.setblocking(False)
        try:
            s.send(flood)  # what the kernel takes at once; the rest is never sent
        except BlockingIOError:
            pass
        s.setblocking(True)
    for s in socks:
        assert Answers(s).next().startswith(b"HTTP/1.1 ")
    for s in socks:
        s.shutdown(socket.SHUT_WR)
        s.close()


@pytest.mark.parametrize("keyed", [False, True], ids=["open", "api-key"])
def test_pipelined_floods_from_many_connections_leave_memory_and_fds_at_baseline(engine, keyed):
    """120 connections, each up to 256 KB of small pipelined requests in one write (four
    times the head limit), one answer read, then gone: the proxy's RSS stays near idle
    and every descriptor is released."""
    args = ["--engine", "e=openai"] + (["--api-key", "k1"] if keyed else [])
    proxy = start_proxy(f"e={engine.url}", args=args)
    try:
        pid = proxy.proc.pid
        path = b"/v1/models" if keyed else b"/phasewatch/health"  # keyed: 401 each
        request = b"GET %s HTTP/1.1\r\nhost: x\r\nx-pad: %s\r\n\r\n" % (path, b"q" * 40)
        httpx.get(proxy.url + "/phasewatch/health")
        base_fds = fds(pid)
        with PeakRss(pid) as rss:
            _flood(proxy.url, request, 120, 256 * 1024)
        print(
            f"120 pipelined floods: peak RSS grew {rss.growth_mib:.1f} MiB; "
            f"fds {base_fds} -> {fds(pid)} as the clients left"
        )
        assert rss.growth_mib < 48, f"RSS grew {rss.growth_mib:.0f} MiB"
        wait_for(lambda: fds(pid) <= base_fds + 2, what="every flood connection closed")
        assert httpx.get(proxy.url + "/phasewatch/health").status_code == 200
    finally:
        proxy.stop()


# --- 2. trailer sections ---------------------------------------------------------------------


def chunked_chat(text: str, trailers: bytes) -> bytes:
    body = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": text}]}).encode()
    return (
        b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
        b"x-team: mine\r\ntransfer-encoding: chunked\r\n\r\n"
        + b"%x\r\n" % len(body)
        + body
        + b"\r\n0\r\n"
        + trailers
        + b"\r\n"
    )


def test_trailer_fields_never_reach_the_engine_as_headers(engine):
    proxy = start_proxy(f"e={engine.url}", args=["--engine", "e=openai"])
    try:
        s = connect(proxy.url, timeout=30)
        s.sendall(
            chunked_chat("t", b"x-injected: 1\r\nx-team: evil\r\nx-request-id: forged-id\r\n")
            + chat_request("next")
        )
        answers = Answers(s)
        assert content_of(answers.next()) == "t"
        assert content_of(answers.next()) == "next"  # the connection goes on
        s.close()
        posts = [r for r in engine.requests if r.method == "POST"]
        assert len(posts) == 2
        sent = posts[0]
        assert "x-injected" not in sent.header_names()
        assert sent.header("x-team") == "mine"
        assert sent.header("x-request-id") != "forged-id"
        line = proxy.request_lines(at_least=1)[0]
        assert "forged-id" not in json.dumps(line)
    finally:
        proxy.stop()


def _trailer_flood(url: str, head_and_body: bytes, total: int) -> bytes:
    s = connect(url, timeout=30)
    try:
        s.sendall(head_and_body)
        field = b"x-t: " + b"v" * 1000 + b"\r\n"
        piece = field * 64
        sent = 0
        while sent < total:  # bounded: total / len(piece) sends
            try:
                s.sendall(piece)
            except (BrokenPipeError, ConnectionResetError):
                break
            sent += len(piece)
        try:
            s.shutdown(socket.SHUT_WR)
        except OSError:
            pass
        out = b""
        for _ in range(1000):  # bounded
            try:
                data = s.recv(65536)
            except (ConnectionResetError, TimeoutError):
                break
            if not data:
                break
            out += data
        return out
    finally:
        s.close()


@pytest.mark.parametrize(
    ("keyed", "size"), [(False, 16 * MiB), (True, 64 * MiB)], ids=["open-16MiB", "api-key-64MiB"]
)
def test_an_endless_trailer_section_is_refused_with_memory_bounded(engine, keyed, size):
    args = ["--engine", "e=openai"] + (["--api-key", "k1"] if keyed else [])
    proxy = start_proxy(f"e={engine.url}", args=args)
    try:
        pid = proxy.proc.pid
        body = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "x"}]})
        start = (
            b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ntransfer-encoding: chunked\r\n\r\n"
            + b"%x\r\n" % len(body)
            + body.encode()
            + b"\r\n0\r\n"
        )
        with PeakRss(pid) as rss:
            got = _trailer_flood(proxy.url, start, size)
        print(f"{size // MiB} MiB of trailers: peak RSS grew {rss.growth_mib:.1f} MiB")
        assert rss.growth_mib < 24, f"RSS grew {rss.growth_mib:.0f} MiB"
        refusal = answer(
            431, "request trailers over 65536 bytes", "request_header_too_large", close=True
        )
        if got.startswith(b"HTTP/1.1 401 "):
            # answered before its body was read: the connection is closed, with no
            # second answer to the one request
            assert keyed and got.count(b"HTTP/1.1 ") == 1
        else:
            assert got == refusal
        assert not [r for r in engine.requests if r.method == "POST"]
        m = metrics(proxy, KEY)
        assert sample(m, "phasewatch_rejected_total", reason="trailers_too_large") == 1
        assert len(log_lines(proxy, "refused a request trailer section over 65536")) == 1
        assert httpx.get(proxy.url + "/phasewatch/health").status_code == 200
    finally:
        proxy.stop()
