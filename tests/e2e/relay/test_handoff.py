"""The hand-offs (proxy.runtime.handoff), on the real guarded protocol over loopback: the
CPU is yielded once per answer, right after its head and first body went out through
uvicorn, and once per request written upstream (through the real relay and lean
transport), only while that request is the server's only one in flight, never for the
relay's own writes, and never with ``--no-handoff``."""

from __future__ import annotations

import asyncio
import socket
import threading

import pytest

from proxy.core.push import WRITE
from proxy.runtime import handoff
from proxy.settings import Settings

from .test_direct_writer import exchange, served
from .test_push_path import relay_to


def _get(port: int) -> bytes:
    return exchange(port, b"GET / HTTP/1.1\r\nhost: x\r\n\r\n")


class Yields:
    """Each yield, as the point of the answer the app had reached (`where`)."""

    def __init__(self) -> None:
        self.at: list[str] = []
        self.where = "?"

    def __call__(self) -> None:
        self.at.append(self.where)


@pytest.fixture
def yields(monkeypatch) -> Yields:
    seen = Yields()
    monkeypatch.setattr(handoff, "_yield", seen)
    return seen


def test_one_answer_alone_yields_once_right_after_its_first_body(yields):
    async def app(scope, receive, send):
        yields.where = "head"
        await send({"type": "http.response.start", "status": 200, "headers": []})
        for i in range(3):
            yields.where = f"body {i}"
            await send({"type": "http.response.body", "body": b"x", "more_body": True})
        yields.where = "end"
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    async def main() -> list[bytes]:
        async with served(app) as port:
            return [await asyncio.to_thread(_get, port) for _ in range(2)]

    answers = asyncio.run(main())
    assert all(a.endswith(b"1\r\nx\r\n" * 3 + b"0\r\n\r\n") for a in answers), answers
    assert yields.at == ["body 0", "body 0"]  # once per answer, keep-alive included


def test_no_yield_while_another_request_is_in_flight(yields):
    both = asyncio.Barrier(2)

    async def app(scope, receive, send):
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await both.wait()  # both requests in flight at their first body
        await send({"type": "http.response.body", "body": b"x", "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    async def main() -> list[bytes]:
        async with served(app) as port:
            return await asyncio.gather(*(asyncio.to_thread(_get, port) for _ in range(2)))

    answers = asyncio.run(main())
    assert all(a.endswith(b"1\r\nx\r\n0\r\n\r\n") for a in answers), answers
    assert yields.at == []


def test_the_relays_own_writes_never_go_through_the_hand_off(yields):
    async def app(scope, receive, send):
        writer = scope["extensions"][WRITE]
        await send({"type": "http.response.start", "status": 200, "headers": []})
        yields.where = "pushed"
        assert writer.ready()
        writer.put(b"p")
        writer.put(b"f", b"1\r\nf\r\n")
        if writer.write is not None:
            writer.write(b"1\r\no\r\n")
        yields.where = "sent"
        await send({"type": "http.response.body", "body": b"s", "more_body": False})

    async def main() -> bytes:
        async with served(app) as port:
            return await asyncio.to_thread(_get, port)

    answer = asyncio.run(main())
    assert answer.endswith(b"1\r\np\r\n1\r\nf\r\n1\r\no\r\n1\r\ns\r\n0\r\n\r\n"), answer
    assert yields.at == ["sent"]


def test_no_handoff_never_yields(yields):
    async def app(scope, receive, send):
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"x", "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    async def main() -> bytes:
        # as `phasewatch serve --no-handoff` builds its server
        async with served(app, handoff=Settings(handoff=False).server_limits().handoff) as port:
            return await asyncio.to_thread(_get, port)

    assert asyncio.run(main()).endswith(b"1\r\nx\r\n0\r\n\r\n")
    assert yields.at == []
    assert Settings().server_limits().handoff is True  # on unless turned off


# --- the hand-off after a request is written upstream ------------------------------------

SSE = b'data: {"choices":[{"index":0,"delta":{"content":"hi"},"finish_reason":"stop"}]}\n\n'


class Engine(threading.Thread):
    """A blocking engine on its own thread: it reads one request, then answers (with
    `wait`, only once the proxy has yielded, or after 10 s, so that a failing test ends)."""

    def __init__(self, yielded: threading.Event, wait: bool) -> None:
        super().__init__(daemon=True)
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.yielded = yielded
        self.wait = wait
        self.got = threading.Event()  # the whole request is here
        self.answered = threading.Event()

    def run(self) -> None:
        conn, _ = self.sock.accept()
        with conn:
            data = b""
            while b"\r\n\r\n" not in data:
                data += conn.recv(65536)
            head, _, body = data.partition(b"\r\n\r\n")
            length = next(
                int(line.split(b":")[1])
                for line in head.split(b"\r\n")
                if line.lower().startswith(b"content-length:")
            )
            while len(body) < length:
                body += conn.recv(65536)
            self.got.set()
            if self.wait:
                self.yielded.wait(10)
            self.answered.set()
            conn.sendall(
                b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                b"transfer-encoding: chunked\r\n\r\n"
                + b"%x\r\n%b\r\n" % (len(SSE), SSE)
                + b"e\r\ndata: [DONE]\n\n\r\n0\r\n\r\n"
            )


def _chat(port: int) -> bytes:
    body = b'{"model":"m","stream":true,"messages":[{"role":"user","content":"x"}]}'
    return exchange(
        port,
        b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
        b"content-length: %d\r\n\r\n%b" % (len(body), body),
    )


def _through_the_relay(monkeypatch, handoff_on: bool) -> tuple[bytes, list[tuple[bool, bool]]]:
    """One streamed chat through the real relay and lean transport on the guarded
    protocol; each yield as (the request was at the engine, the engine had answered)."""
    yielded = threading.Event()
    engine = Engine(yielded, wait=handoff_on)
    seen: list[tuple[bool, bool]] = []

    def recorded() -> None:
        # blocking on the engine's thread: a yield before the request's write never sees it
        seen.append((engine.got.wait(10), engine.answered.is_set()))
        yielded.set()

    monkeypatch.setattr(handoff, "_yield", recorded)
    engine.start()

    async def main() -> bytes:
        async with served(relay_to(engine.port), handoff=handoff_on) as port:
            return await asyncio.to_thread(_chat, port)

    answer = asyncio.run(main())
    yielded.set()
    engine.join(10)
    return answer, seen


def test_a_request_alone_hands_off_once_written_upstream_and_once_answered(monkeypatch):
    answer, seen = _through_the_relay(monkeypatch, handoff_on=True)
    assert SSE in answer and answer.endswith(b"0\r\n\r\n"), answer
    # the first yield: the request at the engine, not yet answered; the second: the answer's
    assert seen == [(True, False), (True, True)]


def test_no_handoff_means_no_hand_off_upstream_either(monkeypatch):
    answer, seen = _through_the_relay(monkeypatch, handoff_on=False)
    assert SSE in answer and answer.endswith(b"0\r\n\r\n"), answer
    assert seen == []


def test_the_upstream_hand_off_yields_only_for_the_only_request_in_flight(yields):
    yields.where = "alone"
    handoff.after_request({"one"})()
    yields.where = "two in flight"
    handoff.after_request({"one", "two"})()
    assert yields.at == ["alone"]
