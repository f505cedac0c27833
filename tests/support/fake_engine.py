"""The one fake engine: a raw-socket HTTP/1.1 upstream on loopback whose every byte is the
test's choice, configured per test rather than written again in each file.

It is written on asyncio streams, not on an HTTP framework, so nothing normalises what it
sends; it runs its own event loop in a thread, so tests may drive it from async code (the
transports) or put a subprocess proxy in front of it alike. Each request is recorded
(:attr:`FakeEngine.requests`, parsed and as its bytes, before it is answered) and answered in one of three ways:

- ``answer(req)`` returns a :class:`Reply`: the bytes to write and what then happens to the
  connection (kept, closed, reset, hung, dropped without a byte, an unsolicited response
  after a pause, a head that never ends); ``None`` leaves the request to the script or the
  standard answers below.
- ``script(req, reader, writer)`` is a coroutine that writes on the stream itself, for
  byte-level timing (framing cut anywhere, a reset in the middle of an event, a stall
  between bytes); by default (``script_takes``) the standard answers still take the model
  list and the probes.
- the standard answers: ``GET .../v1/models`` lists :attr:`~FakeEngine.models` (counted in
  ``lists``), other GETs outside ``/v1/`` (probes, scrapes) get 404, a POST gets a
  one-token chat completion reporting ``prompt_tokens``, anything else ``{"ok":true}``;
  with ``fail`` set, the model list and POSTs get 500.

``stall`` accepts connections and never reads them, ``refuse`` closes each at once,
``port`` listens on a given port, ``ssl_context`` serves TLS; ``connections`` counts them
and ``ended`` says when each ended.
"""

from __future__ import annotations

import asyncio
import json
import socket
import ssl
import struct
import threading
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from http import HTTPStatus
from typing import Any

#: The model the standard answers list unless a test names its own.
MODEL = "fake-model"


@dataclass
class Request:
    method: str
    target: str
    #: As they arrived: names in their case and order, values without surrounding spaces.
    headers: list[tuple[str, str]]
    #: At most the engine's ``keep_bodies_up_to`` bytes of it (the rest is read and dropped).
    body: bytes
    conn: int  # which connection (1, 2, ...) carried it
    #: The request's bytes as they arrived: its head, then the body as kept.
    raw: bytes = b""

    def header_names(self) -> list[str]:
        return [k.lower() for k, _ in self.headers]

    def header(self, name: str) -> str | None:
        """The first value of the named header, or None."""
        name = name.lower()
        return next((v for k, v in self.headers if k.lower() == name), None)

    def json(self) -> Any:
        """The body as JSON, or None where it is not."""
        try:
            return json.loads(self.body)
        except ValueError:
            return None


@dataclass
class Reply:
    data: bytes = b""
    #: "keep": wait for the next request; "close": FIN; "reset": RST; "hang": never a byte
    #: more (what arrives is read and dropped until the peer closes); "drop": read the
    #: request, close without a byte.
    then: str = "keep"
    #: Bytes written after a pause (an unsolicited response on an idle connection).
    later: bytes = b""
    pause: float = 0.0
    #: Written before `data` and then more bytes forever (a never-ending head).
    forever: bytes = b""


Answer = Callable[[Request], Reply | None]
Script = Callable[[Request, asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


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


def json_bytes(status: int, body: bytes) -> bytes:
    """A JSON response's bytes (`body` as it is), with its status's own reason phrase."""
    headers = [("content-type", "application/json")]
    return response(status, body, headers, reason=HTTPStatus(status).phrase)


def json_response(status: int, obj: object) -> bytes:
    return json_bytes(status, json.dumps(obj).encode())


def chunk(data: bytes) -> bytes:
    """One HTTP/1.1 chunk."""
    return b"%x\r\n" % len(data) + data + b"\r\n"


SSE_HEAD = (
    b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream; charset=utf-8\r\n"
    b"transfer-encoding: chunked\r\n\r\n"
)


def wants_usage(req: Request) -> bool:
    try:
        obj = json.loads(req.body)
    except ValueError:
        return False
    opts = obj.get("stream_options") if isinstance(obj, dict) else None
    return isinstance(opts, dict) and opts.get("include_usage") is True


def completion(model: object, prompt_tokens: int = 1) -> dict:
    """A one-token chat completion ("ok") reporting `prompt_tokens`."""
    return {
        "id": "x",
        "object": "chat.completion",
        "model": model,
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": "ok"},
                "finish_reason": "stop",
            }
        ],
        "usage": {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": 1,
            "total_tokens": prompt_tokens + 1,
        },
    }


def generation(req: Request) -> bool:
    """A request the engine's script takes by default: all but the model list and the
    probes (GETs outside ``/v1/``: engine detection, metrics scrapes)."""
    path = req.target.split("?", 1)[0]
    return not (req.method == "GET" and (path.endswith("/v1/models") or "/v1/" not in path))


@dataclass
class FakeEngine:
    answer: Answer | None = None
    script: Script | None = None
    #: Which requests go to the script (the rest get the standard answers).
    script_takes: Callable[[Request], bool] = generation
    models: list[str] = field(default_factory=lambda: [MODEL])
    prompt_tokens: int = 1
    #: The model list and POSTs answer 500 while set.
    fail: bool = False
    #: Accept connections and never read from them (a stalled engine).
    stall: bool = False
    #: Accept each connection and close it at once (an engine that is down).
    refuse: bool = False
    #: The port to listen on (0: any free one); a test may bring an engine back on the
    #: port of one that went down.
    port: int = 0
    ssl_context: ssl.SSLContext | None = None
    #: Bodies are read in pieces and kept up to this size (the engine holds no large body).
    keep_bodies_up_to: int = 1 << 20
    requests: list[Request] = field(default_factory=list)
    connections: int = 0
    #: Model-list reads the standard answers served.
    lists: int = 0
    #: When each connection ended (monotonic seconds), in order.
    ended: list[float] = field(default_factory=list)
    #: Set by scripts (from the engine's loop) and waited on by tests.
    events: dict[str, threading.Event] = field(default_factory=dict)
    url: str = ""

    def __post_init__(self) -> None:
        self._ready = threading.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._server: asyncio.Server | None = None
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> FakeEngine:
        self._thread.start()
        if not self._ready.wait(10):
            raise RuntimeError("fake engine did not start")
        return self

    def stop(self) -> None:
        loop = self._loop
        assert loop is not None
        loop.call_soon_threadsafe(loop.stop)
        self._thread.join(10)

    def __enter__(self) -> FakeEngine:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def event(self, name: str) -> threading.Event:
        return self.events.setdefault(name, threading.Event())

    def posts(self) -> list[Request]:
        return [r for r in self.requests if r.method == "POST"]

    def standard(self, req: Request) -> Reply:
        """The answers of an OpenAI-compatible engine that lists :attr:`models`."""
        path = req.target.split("?", 1)[0]
        if req.method == "GET" and path.endswith("/v1/models"):
            self.lists += 1
            if self.fail:
                return Reply(json_response(500, {"error": "broken"}))
            data = [{"id": m, "object": "model"} for m in self.models]
            return Reply(json_response(200, {"object": "list", "data": data}))
        if req.method == "GET" and "/v1/" not in path:
            return Reply(json_response(404, {"detail": "Not Found"}))
        if req.method == "POST":
            if self.fail:
                return Reply(json_response(500, {"error": "broken"}))
            obj = req.json()
            model = obj.get("model") if isinstance(obj, dict) else None
            return Reply(json_response(200, completion(model, self.prompt_tokens)))
        return Reply(json_response(200, {"ok": True}))

    def _run(self) -> None:
        loop = self._loop = asyncio.new_event_loop()
        asyncio.set_event_loop(loop)
        self._server = loop.run_until_complete(
            asyncio.start_server(
                self._handle, "127.0.0.1", self.port, ssl=self.ssl_context, limit=1 << 20
            )
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
        try:
            if self.refuse:
                return
            if self.stall:
                await asyncio.Event().wait()
            while True:
                req = await read_request(reader, conn, self.keep_bodies_up_to)
                if req is None:
                    return
                self.requests.append(req)
                reply = self.answer(req) if self.answer is not None else None
                if reply is None and self.script is not None and self.script_takes(req):
                    await self.script(req, reader, writer)
                    if writer.is_closing():
                        return
                    continue
                if not await _write(reader, writer, reply or self.standard(req)):
                    return
        except (ConnectionError, ssl.SSLError, asyncio.IncompleteReadError):
            return
        except asyncio.CancelledError:
            return  # the engine is stopping
        finally:
            if not writer.is_closing():
                writer.close()
            self.ended.append(time.monotonic())


async def _write(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, reply: Reply) -> bool:
    """Write `reply`; whether the connection goes on to the next request."""
    if reply.then == "drop":
        writer.close()
        return False
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
        return False
    if reply.then == "reset":
        await asyncio.sleep(0.05)  # the bytes are delivered, then the engine dies
        sock = writer.get_extra_info("socket")
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        writer.transport.abort()
        return False
    if reply.then == "hang":
        while await reader.read(65536):
            pass
        return False
    return True


async def read_request(reader: asyncio.StreamReader, conn: int, keep: int) -> Request | None:
    try:
        head = await reader.readuntil(b"\r\n\r\n")
    except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, ConnectionError):
        return None
    lines = head.decode("latin-1").split("\r\n")
    method, target, _ = lines[0].split(" ", 2)
    headers = []
    for line in lines[1:]:
        if ":" in line:
            k, v = line.split(":", 1)
            headers.append((k, v.strip(" \t")))
    length = next((int(v) for k, v in headers if k.lower() == "content-length"), 0)
    parts = []
    kept = 0
    while length:
        piece = await reader.read(min(length, 1 << 20))
        if not piece:
            return None
        length -= len(piece)
        if kept < keep:
            parts.append(piece)
            kept += len(piece)
    body = b"".join(parts)
    return Request(method, target, headers, body, conn, head + body)
