"""A raw-socket HTTP/1.1 engine on loopback for transport tests: every byte it sends is
the test's choice (resets, short bodies, extra responses, huge heads, 1xx, trailers).

It runs its own event loop in a thread, so tests may drive it from async code (the
transports) or from a subprocess proxy alike. Each request is answered by
``engine.answer(req)``, which returns a :class:`Reply`: the bytes to write and what to do
with the connection after them.
"""

from __future__ import annotations

import asyncio
import json
import socket
import ssl
import struct
import threading
from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass
class Request:
    method: str
    target: str
    headers: list[tuple[str, str]]
    body: bytes
    conn: int  # which connection (1, 2, ...) carried it

    def header_names(self) -> list[str]:
        return [k.lower() for k, _ in self.headers]


@dataclass
class Reply:
    data: bytes = b""
    #: "keep": wait for the next request; "close": FIN; "reset": RST; "hang": never more;
    #: "drop": read the request, close without a byte.
    then: str = "keep"
    #: Bytes written after a pause (an unsolicited response on an idle connection).
    later: bytes = b""
    pause: float = 0.0
    #: Written before `data` and then more bytes forever (a never-ending head).
    forever: bytes = b""


def response(
    status: int = 200,
    body: bytes = b"",
    headers: list[tuple[str, str]] | None = None,
    *,
    chunked: bool = False,
    length: int | None = None,
    close_delimited: bool = False,
    reason: str = "OK",
) -> bytes:
    """An HTTP/1.1 response's bytes; Content-Length unless chunked or close-delimited."""
    lines = [f"HTTP/1.1 {status} {reason}"]
    lines += [f"{k}: {v}" for k, v in headers or []]
    if chunked:
        lines.append("Transfer-Encoding: chunked")
        payload = (f"{len(body):x}\r\n".encode() + body + b"\r\n" if body else b"") + b"0\r\n\r\n"
    elif close_delimited:
        payload = body
    else:
        lines.append(f"Content-Length: {len(body) if length is None else length}")
        payload = body
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + payload


MODELS = response(
    200,
    json.dumps({"object": "list", "data": [{"id": "fake-model", "object": "model"}]}).encode(),
    [("Content-Type", "application/json")],
)


def default_answer(req: Request) -> Reply:
    if req.target.startswith("/v1/models"):
        return Reply(MODELS)
    return Reply(response(404, b"not found"))


@dataclass
class FakeEngine:
    answer: Callable[[Request], Reply] = default_answer
    ssl_context: ssl.SSLContext | None = None
    requests: list[Request] = field(default_factory=list)
    connections: int = 0
    url: str = ""
    #: Accept connections and never read from them (a stalled engine).
    stall: bool = False

    def __post_init__(self) -> None:
        self._ready = threading.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._server: asyncio.Server | None = None
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> FakeEngine:
        self._thread.start()
        if not self._ready.wait(10):
            raise RuntimeError("fake engine did not start")
        return self

    def __exit__(self, *exc) -> None:
        loop = self._loop
        assert loop is not None
        loop.call_soon_threadsafe(loop.stop)
        self._thread.join(10)

    def posts(self) -> list[Request]:
        return [r for r in self.requests if r.method == "POST"]

    def _run(self) -> None:
        loop = self._loop = asyncio.new_event_loop()
        asyncio.set_event_loop(loop)
        self._server = loop.run_until_complete(
            asyncio.start_server(self._handle, "127.0.0.1", 0, ssl=self.ssl_context)
        )
        port = self._server.sockets[0].getsockname()[1]
        scheme = "https" if self.ssl_context else "http"
        host = "localhost" if self.ssl_context else "127.0.0.1"
        self.url = f"{scheme}://{host}:{port}"
        self._ready.set()
        loop.run_forever()
        self._server.close()
        tasks = asyncio.all_tasks(loop)
        for task in tasks:
            task.cancel()
        loop.run_until_complete(asyncio.gather(*tasks, return_exceptions=True))
        loop.close()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        conn = self.connections
        if self.stall:
            await asyncio.Event().wait()
        try:
            while True:
                req = await read_request(reader, conn)
                if req is None:
                    return
                reply = self.answer(req)
                self.requests.append(req)
                if reply.then == "drop":
                    writer.close()
                    return
                if reply.forever:
                    writer.write(reply.forever)
                    while True:
                        writer.write(b"X-Filler: " + b"y" * 8000 + b"\r\n")
                        await writer.drain()
                writer.write(reply.data)
                await writer.drain()
                if reply.later:
                    await asyncio.sleep(reply.pause)
                    writer.write(reply.later)
                    await writer.drain()
                if reply.then == "close":
                    writer.close()
                    return
                if reply.then == "reset":
                    await asyncio.sleep(0.05)  # the bytes are delivered, then the engine dies
                    sock = writer.get_extra_info("socket")
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                    writer.transport.abort()
                    return
                if reply.then == "hang":
                    await asyncio.Event().wait()
        except (ConnectionError, ssl.SSLError, asyncio.IncompleteReadError):
            return
        except asyncio.CancelledError:
            return  # the engine is stopping
        finally:
            if not writer.is_closing():
                writer.close()


async def read_request(reader: asyncio.StreamReader, conn: int) -> Request | None:
    try:
        head = await reader.readuntil(b"\r\n\r\n")
    except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, ConnectionError):
        return None
    lines = head.decode("latin-1").split("\r\n")
    method, target, _ = lines[0].split(" ", 2)
    headers = [tuple(x.split(": ", 1)) for x in lines[1:] if x]
    length = next((int(v) for k, v in headers if k.lower() == "content-length"), 0)
    body = await reader.readexactly(length) if length else b""
    return Request(method, target, headers, body, conn)  # type: ignore[arg-type]
