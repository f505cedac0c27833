"""The hand-off after an answer's first body write (proxy.runtime.handoff), on the real
guarded protocol over loopback: the CPU is yielded once per answer, right after its head
and first body went out through uvicorn, only while that request is the server's only
one in flight, never for the relay's own writes, and never with ``--no-handoff``."""

from __future__ import annotations

import asyncio
import socket

import pytest

from proxy.core.push import WRITE
from proxy.runtime import handoff
from proxy.settings import Settings

from .test_direct_writer import served


def _get(port: int) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(b"GET / HTTP/1.1\r\nhost: x\r\n\r\n")
        out = b""
        while not out.endswith(b"0\r\n\r\n"):
            got = s.recv(65536)
            if not got:
                break
            out += got
        return out


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
