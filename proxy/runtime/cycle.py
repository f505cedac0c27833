"""One request and its answer on an HTTP/1.1 connection (:mod:`proxy.runtime.http1`): the
ASGI ``receive`` and ``send`` of the request's application task, and what the server
offers the relay beside ASGI, as a scope extension (its name:
:mod:`proxy.extensions`):

``CLIENT_OUT``, the answer's :class:`Answer`, a :class:`~proxy.core.client_out.ClientOut`
(the body written synchronously from any callback, the client's flow and hang-up told
by callbacks).

``send`` keeps the ASGI server's usual rules: the server's default headers first; a
``content-length`` is held to (a body longer or shorter is an error); with no length
the answer is chunked (not for HEAD, 204 or 304); a HEAD answer's body is dropped;
``connection: close`` from the application, or a request that cannot be kept alive,
closes the connection after the answer; ``send`` waits while the client does not
read. ``receive`` answers ``Expect: 100-continue`` when the body is first asked for,
and gives ``http.disconnect`` once the client has gone or the answer is complete. An
application that raises before its answer's head gets a 500; one that returns with
its answer incomplete gets its connection closed.

Every answer's state is on its :class:`Answer`, which holds nothing of the request:
the scope holds the answer, never the cycle,
so a finished request's objects are freed as soon as the next one begins, with no
reference cycle for the garbage collector.
"""

from __future__ import annotations

import asyncio
import http
import logging
import re
from collections.abc import Callable
from typing import Any, Protocol

from ..core.client_out import ClientOut
from ..extensions import CLIENT_OUT

#: Where the application's failures are told: the server's own logger, as under
#: uvicorn's protocols.
logger = logging.getLogger("uvicorn.error")

#: A request body buffered past this, not yet taken by the application: reading pauses.
HIGH_WATER = 64 * 1024

_HEADER_NAME = re.compile(b'[\x00-\x1f\x7f()<>@,;:\\[\\]={} \t\\\\"]')
_HEADER_VALUE = re.compile(b"[\x00-\x08\x0a-\x1f\x7f]")


def _status_line(code: int) -> bytes:
    try:
        phrase = http.HTTPStatus(code).phrase.encode()
    except ValueError:
        phrase = b""
    return b"HTTP/1.1 %d %s\r\n" % (code, phrase)


STATUS_LINE = {code: _status_line(code) for code in range(100, 600)}

_500 = [
    (b"content-type", b"text/plain; charset=utf-8"),
    (b"content-length", b"21"),
    (b"connection", b"close"),
]


class Connection(Protocol):
    """What a cycle needs of its connection (:class:`proxy.runtime.http1.Http1Protocol`)."""

    real: asyncio.Transport
    write_paused: bool

    @property
    def default_headers(self) -> list[tuple[bytes, bytes]]: ...

    def closing(self) -> bool: ...
    def close_connection(self) -> None: ...
    def resume_reads(self) -> None: ...
    async def drain(self) -> None: ...
    def on_response_complete(self) -> None: ...


class Answer:
    """One answer's body as the relay writes it (a
    :class:`~proxy.core.client_out.ClientOut`), and the answer's framing state, which
    ``send`` shares: `open` (a body may be written: the head is out, the answer not
    complete, not HEAD, the client there, the connection not ending), `chunked`, and
    `left` (bytes a content-length answer still owes)."""

    __slots__ = (
        "chunked",
        "conn",
        "flow",
        "gone",
        "left",
        "lost",
        "open",
        "paused",
        "put",
        "started",
    )

    def __init__(self, conn: Connection, paused: bool) -> None:
        self.conn = conn
        self.put = conn.real.write
        self.gone = False
        self.paused = paused
        self.open = False
        self.started = False  # the head went out
        self.chunked: bool | None = None
        self.left = 0
        self.lost: Callable[[], None] | None = None
        self.flow: Callable[[bool], None] | None = None

    def write(self, body: bytes, framed: bytes | None = None) -> None:
        """See :meth:`proxy.core.client_out.ClientOut.write`."""
        if not self.open or not body:
            if not self.started and not self.gone:
                raise RuntimeError("ClientOut.write before the answer's head")
            return
        if self.chunked:
            self.put(framed if framed is not None else b"%x\r\n%b\r\n" % (len(body), body))
            return
        size = len(body)
        if size > self.left:
            raise RuntimeError("Response content longer than Content-Length")
        self.left -= size
        self.put(body)

    def watch(
        self,
        lost: Callable[[], None] | None,
        flow: Callable[[bool], None] | None = None,
    ) -> None:
        """See :meth:`proxy.core.client_out.ClientOut.watch`. Watching resumes a paused
        read, as ``receive`` does, so that a hang-up is seen."""
        self.lost, self.flow = lost, flow
        if lost is None:
            return
        if self.gone:
            self.tell_lost()
            return
        self.conn.resume_reads()

    def tell_lost(self) -> None:
        """The client is gone: its watcher, if any, is told (once)."""
        lost = self.lost
        if lost is not None:
            self.lost = None
            lost()

    def tell_flow(self, paused: bool) -> None:
        if self.paused is paused:
            return
        self.paused = paused
        flow = self.flow
        if flow is not None:
            flow(paused)


class Cycle:
    """One request's ASGI cycle (see the module). The connection reads and sets
    `disconnected`, `keep_alive`, `more_body`, `response_started` and
    `response_complete`; it feeds `body` and sets `message_event`."""

    __slots__ = (
        "__weakref__",
        "answer",
        "body",
        "conn",
        "disconnected",
        "head",
        "keep_alive",
        "message_event",
        "more_body",
        "on_response",
        "response_complete",
        "response_started",
        "scope",
        "waiting_for_100_continue",
    )

    def __init__(
        self,
        conn: Connection,
        scope: dict[str, Any],
        keep_alive: bool,
        expect_100_continue: bool,
    ) -> None:
        self.conn = conn
        self.scope = scope
        self.head = scope["method"] == "HEAD"
        self.disconnected = False
        self.keep_alive = keep_alive
        self.waiting_for_100_continue = expect_100_continue
        self.body = bytearray()
        self.more_body = True
        self.message_event = asyncio.Event()
        self.response_started = False
        self.response_complete = False
        self.on_response: Callable[[], None] | None = conn.on_response_complete
        answer = self.answer = Answer(conn, conn.write_paused)
        out: ClientOut = answer  # (checked by mypy: the contract the relay relies on)
        scope["extensions"] = {CLIENT_OUT: out}

    def hang_up(self) -> None:
        """The client is gone (or its request refused): nothing more is written, and a
        ``receive`` waiting returns ``http.disconnect``. Its watcher is told apart
        (:meth:`Answer.tell_lost`), once every cycle is marked."""
        self.disconnected = True
        answer = self.answer
        answer.gone = True
        answer.open = False
        self.message_event.set()

    async def run_asgi(self, app: Any) -> None:
        try:
            result = await app(self.scope, self.receive, self.send)
        except BaseException as exc:
            logger.error("Exception in ASGI application\n", exc_info=exc)
            if not self.response_started:
                await self.send_500_response()
            else:
                self.conn.close_connection()
        else:
            if result is not None:
                logger.error("ASGI callable should return None, but returned '%s'.", result)
                self.conn.close_connection()
            elif not self.response_started and not self.disconnected:
                logger.error("ASGI callable returned without starting response.")
                await self.send_500_response()
            elif not self.response_complete and not self.disconnected:
                logger.error("ASGI callable returned without completing response.")
                self.conn.close_connection()
        finally:
            self.on_response = None

    async def send_500_response(self) -> None:
        await self.send({"type": "http.response.start", "status": 500, "headers": _500})
        await self.send(
            {"type": "http.response.body", "body": b"Internal Server Error", "more_body": False}
        )

    async def send(self, message: Any) -> None:
        conn = self.conn
        if conn.write_paused and not self.disconnected:
            await conn.drain()
        if self.disconnected:
            return
        answer = self.answer
        if not self.response_started:
            if message["type"] != "http.response.start":
                raise RuntimeError(
                    f"Expected ASGI message 'http.response.start', but got '{message['type']}'."
                )
            self.response_started = True
            self.waiting_for_100_continue = False
            status = message["status"]
            content = [STATUS_LINE[status]]
            chunked: bool | None = None
            closes = False
            for name, value in (*conn.default_headers, *message.get("headers", ())):
                if _HEADER_NAME.search(name):
                    raise RuntimeError("Invalid HTTP header name.")
                if _HEADER_VALUE.search(value):
                    raise RuntimeError("Invalid HTTP header value.")
                name = name.lower()
                if name == b"content-length" and chunked is None:
                    answer.left = int(value.decode())
                    chunked = False
                elif name == b"transfer-encoding" and value.lower() == b"chunked":
                    answer.left = 0
                    chunked = True
                elif name == b"connection" and b"close" in [
                    token.lower().strip() for token in value.split(b",")
                ]:
                    self.keep_alive = False
                    closes = True
                content.extend((name, b": ", value, b"\r\n"))
            if not self.keep_alive and not closes:
                content.append(b"connection: close\r\n")
            if chunked is None and not self.head and status not in (204, 304):
                chunked = True
                content.append(b"transfer-encoding: chunked\r\n")
            content.append(b"\r\n")
            answer.chunked = chunked
            answer.started = True
            conn.real.write(b"".join(content))
            answer.open = not (self.head or conn.closing())
            return
        if self.response_complete:
            raise RuntimeError(
                f"Unexpected ASGI message '{message['type']}' sent, "
                "after response already completed."
            )
        if message["type"] != "http.response.body":
            raise RuntimeError(
                f"Expected ASGI message 'http.response.body', but got '{message['type']}'."
            )
        body = message.get("body", b"")
        more_body = message.get("more_body", False)
        if self.head:
            answer.left = 0
        elif answer.chunked:
            if more_body:
                if body:
                    conn.real.write(b"%x\r\n%b\r\n" % (len(body), body))
            elif body:
                conn.real.write(b"%x\r\n%b\r\n0\r\n\r\n" % (len(body), body))
            else:
                conn.real.write(b"0\r\n\r\n")
        else:
            size = len(body)
            if size > answer.left:
                raise RuntimeError("Response content longer than Content-Length")
            answer.left -= size
            conn.real.write(body)
        if more_body:
            return
        if answer.left != 0 and not conn.closing():
            # (a connection closing already took no body bytes: nothing was short)
            raise RuntimeError("Response content shorter than Content-Length")
        self.response_complete = True
        answer.open = False
        self.message_event.set()
        if not self.keep_alive:
            conn.close_connection()
        on_response = self.on_response
        if on_response is not None:
            on_response()

    async def receive(self) -> dict[str, Any]:
        conn = self.conn
        if self.waiting_for_100_continue and self.more_body and not conn.closing():
            # (only when a body is still to come: one that announced none is answered)
            conn.real.write(b"HTTP/1.1 100 Continue\r\n\r\n")
            self.waiting_for_100_continue = False
        if not self.disconnected and not self.response_complete:
            conn.resume_reads()
            await self.message_event.wait()
            self.message_event.clear()
        if self.disconnected or self.response_complete:
            return {"type": "http.disconnect"}
        message = {"type": "http.request", "body": bytes(self.body), "more_body": self.more_body}
        self.body = bytearray()
        return message
