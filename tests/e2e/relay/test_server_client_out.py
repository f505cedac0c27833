"""The answer the server offers the relay as ``CLIENT_OUT`` (proxy.core.client_out's
contract, offered by proxy.runtime.cycle), on the real protocol over loopback: what it
writes reaches the client in order with what ``send`` sends, framed as the answer is
(a chunk of a chunked answer, raw bytes counted against a content-length, nothing for
HEAD); the client's flow is told as it changes; a hang-up is told once, to the answer
being written even when a later request was read after it, and writes after it are
dropped."""

from __future__ import annotations

import asyncio
import socket

import pytest

from proxy.extensions import CLIENT_OUT

from .test_client_out import exchange, served


def _body(raw: bytes) -> bytes:
    return raw.split(b"\r\n\r\n", 1)[1]


def test_writes_are_framed_as_the_answer_is():
    errors: list[str] = []

    async def app(scope, receive, send):
        out = scope["extensions"][CLIENT_OUT]
        out.write(b"too early ")  # before the head: nothing
        path = scope["path"]
        headers = [(b"content-length", b"10")] if path == "/length" else []
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        out.write(b"")  # nothing, above all not a chunked answer's end
        if path == "/length":
            out.write(b"abcd")
            with pytest.raises(RuntimeError):
                out.write(b"longer than the length")
            errors.append("raised")
            await send({"type": "http.response.body", "body": b"efghij", "more_body": False})
        else:
            out.write(b"pushed ")
            out.write(b"framed ", b"7\r\nframed \r\n")
            await send({"type": "http.response.body", "body": b"sent", "more_body": False})
        out.write(b"too late")  # after the last message: nothing
        assert not out.gone and not out.paused

    async def main() -> tuple[bytes, bytes, bytes]:
        async with served(app) as port:
            get = await asyncio.to_thread(exchange, port, b"GET / HTTP/1.1\r\nhost: x\r\n\r\n")
            head = await asyncio.to_thread(exchange, port, b"HEAD / HTTP/1.1\r\nhost: x\r\n\r\n")
            length = await asyncio.to_thread(_length, port)
        return get, head, length

    get, head, length = asyncio.run(main())
    assert _body(get) == b"7\r\npushed \r\n7\r\nframed \r\n4\r\nsent\r\n0\r\n\r\n", get
    assert _body(head) == b"", head
    assert b"content-length: 10\r\n" in length and _body(length) == b"abcdefghij", length
    assert errors == ["raised"]


def _length(port: int) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(b"GET /length HTTP/1.1\r\nhost: x\r\n\r\n")
        out = b""
        while not out.endswith(b"abcdefghij"):
            got = s.recv(65536)
            if not got:
                break
            out += got
        return out


def test_a_client_that_stops_reading_is_told_as_flow_and_the_bytes_all_arrive():
    """Writes are taken while the client does not read (buffered); `flow(True)` when its
    buffers fill, `flow(False)` once it reads again; every byte arrives in order."""
    flows: list[bool] = []
    piece = b"x" * 65536
    written: list[int] = []

    async def app(scope, receive, send):
        out = scope["extensions"][CLIENT_OUT]
        out.watch(lambda: None, flows.append)
        await send({"type": "http.response.start", "status": 200, "headers": []})
        n = 0
        while not out.paused and n < 4096:  # the client does not read: its buffers fill
            out.write(piece)
            n += 1
            await asyncio.sleep(0)
        out.write(piece)  # taken while paused
        written.append(n + 1)
        await send({"type": "http.response.body", "body": b"", "more_body": False})
        out.watch(None, None)

    async def main() -> int:
        async with served(app) as port:
            s = socket.socket()
            s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            s.connect(("127.0.0.1", port))
            reader, w = await asyncio.open_connection(sock=s)
            try:
                w.write(b"GET / HTTP/1.1\r\nhost: x\r\n\r\n")
                w.transport.pause_reading()  # the client does not read
                for _ in range(3000):  # bounded: the app fills the buffers on this loop
                    if flows:
                        break
                    await asyncio.sleep(0.01)
                assert flows == [True]
                w.transport.resume_reading()
                got = b""
                while not got.endswith(b"0\r\n\r\n"):
                    more = await asyncio.wait_for(reader.read(2**20), 30)
                    assert more, got[-100:]
                    got += more
            finally:
                w.close()
            return len(_body(got))

    size = asyncio.run(main())
    chunk = len(b"10000\r\n") + len(piece) + 2
    assert size == written[0] * chunk + len(b"0\r\n\r\n")
    assert flows == [True, False]


def test_a_hang_up_is_told_once_to_the_answer_being_written():
    """Two requests in one write: the first is answered (its app watches), the second is
    read after it. When the client leaves, the first's `lost` is called once, its
    `receive` gets ``http.disconnect``, `gone` is set, and writes are dropped; watching
    a gone answer calls `lost` at once; a watch taken back is never called."""
    calls: list[str] = []
    seen: dict[str, object] = {}
    done = asyncio.Event()

    async def app(scope, receive, send):
        out = scope["extensions"][CLIENT_OUT]
        path = scope["path"]
        await receive()
        out.watch(lambda: calls.append(path), lambda paused: None)
        if path == "/unwatched":
            out.watch(None, None)
        await send({"type": "http.response.start", "status": 200, "headers": []})
        out.write(b"before")
        seen[path] = (await receive())["type"], out.gone  # returns once the client left
        out.write(b"after")  # dropped, no error
        if path == "/a":
            out.watch(lambda: calls.append("late"))  # gone already: called at once
        done.set()

    async def main() -> None:
        async with served(app) as port:
            for first in (b"/a", b"/unwatched"):
                done.clear()
                reader, w = await asyncio.open_connection("127.0.0.1", port)
                w.write(b"GET " + first + b" HTTP/1.1\r\nhost: x\r\n\r\n")
                w.write(b"GET /b HTTP/1.1\r\nhost: x\r\n\r\n")
                await reader.readuntil(b"before\r\n")
                w.close()
                await asyncio.wait_for(done.wait(), 30)

    asyncio.run(main())
    assert seen == {p: ("http.disconnect", True) for p in ("/a", "/unwatched")}
    assert calls == ["/a", "late"]
