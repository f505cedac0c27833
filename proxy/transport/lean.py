"""A lean HTTP/1.1 transport for httpx, used for the upstream (engine) connections.

Why: profiling the relay with 256 paced streams put over half of the proxy's
CPU in httpx's default transport: httpcore's pool scans every connection on each
release (quadratic with hundreds of streams) and every body chunk passes through anyio,
h11 and several generator layers. This transport keeps httpx's client API (the relay
still sees an ``httpx.Response`` with ``aiter_raw``, ``aclose`` and httpx's exceptions)
and moves bytes with an asyncio protocol and httptools' C parser instead: one callback
and one future wake-up per body chunk, and a per-host LIFO list of idle keep-alive
connections.

Behaviour kept from httpx: per-request connect/read timeouts from the request's
``timeout`` extension (ConnectTimeout, ConnectError, ReadTimeout), RemoteProtocolError
when the engine breaks a response off, keep-alive reuse with a stale-connection retry
only when the engine closed a reused idle connection before answering a byte, and
closing the connection (so the engine stops) when a response is closed before its end.
Backpressure: reading pauses when a slow client leaves more than 256 KiB unread.
"""

from __future__ import annotations

import asyncio
import ssl as _ssl
import time
from collections import deque
from typing import cast

import httptools
import httpx

_HIGH_WATER = 256 * 1024


class _Stale(Exception):
    """A reused keep-alive connection was closed by the engine before any response byte."""


class _Conn(asyncio.Protocol):
    """One upstream connection, one response at a time."""

    transport: asyncio.Transport  # set by connection_made, before anything uses it

    def __init__(self, key: tuple) -> None:
        self.key = key
        self.parser = httptools.HttpResponseParser(self)
        self.loop = asyncio.get_running_loop()
        self.closed = False
        self.idle_since = 0.0
        self._reset()

    def _reset(self) -> None:
        self.status = 0
        self.reason = b""
        self.headers: list[tuple[bytes, bytes]] = []
        self.headers_done = False
        self.chunks: list[bytes] = []
        self.size = 0
        self.complete = False
        self.keep_alive = False
        self.error: Exception | None = None
        self.waiter: asyncio.Future | None = None
        self.got_bytes = False
        self.head = False
        self.paused = False
        self.last = 0.0
        self.timeout: float | None = None
        self.timer: asyncio.TimerHandle | None = None
        self.request: httpx.Request | None = None

    # --- asyncio.Protocol ---------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's is not a subclass

    def data_received(self, data: bytes) -> None:
        self.got_bytes = True
        self.last = self.loop.time()
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self._fail(
                httpx.RemoteProtocolError(
                    f"malformed response from upstream: {exc}", request=self.request
                )
            )
            self.transport.close()
            return
        if self.size > _HIGH_WATER and not self.paused:
            self.paused = True
            self.transport.pause_reading()
        waiter = self.waiter
        if waiter is not None and (self.chunks or self.complete or self.headers_done):
            self.waiter = None
            if not waiter.done():
                waiter.set_result(None)

    def eof_received(self):
        return False  # close our side too

    def connection_lost(self, exc) -> None:
        self.closed = True
        if self.request is None or self.complete:
            return
        if self.headers_done and self._close_delimited():
            self.complete = True  # the body ends with the connection
            self._wake()
        elif not self.got_bytes:
            self._fail(_Stale())
        else:
            why = f": {exc}" if exc else ""
            self._fail(
                httpx.RemoteProtocolError(
                    f"upstream closed the connection before the response ended{why}",
                    request=self.request,
                )
            )

    # --- httptools callbacks ------------------------------------------------------------

    def on_status(self, status: bytes) -> None:
        self.reason += status

    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers.append((name, value))

    def on_headers_complete(self) -> None:
        status = self.parser.get_status_code()
        if status < 200:  # 1xx: another head follows
            self.headers, self.reason = [], b""
            return
        self.status = status
        self.headers_done = True
        if self.head or status in (204, 304):
            self.complete = True  # no body (HEAD is closed after, see _Body.aclose)
            self.keep_alive = False

    def on_body(self, body: bytes) -> None:
        self.chunks.append(body)
        self.size += len(body)

    def on_message_complete(self) -> None:
        if self.status == 0:  # end of a 1xx message
            return
        self.complete = True
        self.keep_alive = self.parser.should_keep_alive() and not self.head

    # --- helpers --------------------------------------------------------------------------

    def _close_delimited(self) -> bool:
        for k, v in self.headers:
            k = k.lower()
            if k == b"content-length" or (k == b"transfer-encoding" and b"chunked" in v.lower()):
                return False
        return True

    def _fail(self, exc: Exception) -> None:
        if self.error is None:
            self.error = exc
        self._wake()

    def _wake(self) -> None:
        waiter = self.waiter
        if waiter is not None:
            self.waiter = None
            if not waiter.done():
                waiter.set_result(None)

    def _on_timer(self) -> None:
        self.timer = None
        if self.complete or self.error is not None or self.timeout is None:
            return
        due = self.last + self.timeout
        now = self.loop.time()
        if self.waiter is not None and now >= due:
            self._fail(
                httpx.ReadTimeout(
                    f"upstream sent nothing for {self.timeout:g}s", request=self.request
                )
            )
        else:  # data came since, or the client is slow to take it: look again later
            self.timer = self.loop.call_at(due if due > now else now + self.timeout, self._on_timer)

    def start(self, request: httpx.Request, read_timeout: float | None) -> None:
        self._reset()
        self.request = request
        self.head = request.method == "HEAD"
        self.timeout = read_timeout
        self.last = self.loop.time()
        if read_timeout is not None:
            self.timer = self.loop.call_at(self.last + read_timeout, self._on_timer)

    async def wait(self) -> None:
        """Until something new arrived (data, the end, an error)."""
        self.waiter = self.loop.create_future()
        await self.waiter

    def take(self) -> bytes:
        chunks = self.chunks
        data = chunks[0] if len(chunks) == 1 else b"".join(chunks)
        chunks.clear()
        self.size = 0
        if self.paused:
            self.paused = False
            self.last = self.loop.time()
            self.transport.resume_reading()
        return data

    def finish(self) -> None:
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        self.request = None


class _Body(httpx.AsyncByteStream):
    __slots__ = ("conn", "pool", "released")

    def __init__(self, conn: _Conn, pool: LeanTransport) -> None:
        self.conn = conn
        self.pool = pool
        self.released = False

    async def __aiter__(self):
        conn = self.conn
        while True:
            if conn.chunks:
                yield conn.take()
            elif conn.complete:
                break
            elif conn.error is not None:
                raise conn.error
            else:
                await conn.wait()
        self._release()

    def _release(self) -> None:
        if self.released:
            return
        self.released = True
        conn = self.conn
        conn.finish()
        if conn.complete and conn.keep_alive and not conn.closed and not conn.chunks:
            self.pool._put(conn)
        else:
            conn.transport.close()

    async def aclose(self) -> None:
        self._release()


class LeanTransport(httpx.AsyncBaseTransport):
    """An ``httpx.AsyncBaseTransport`` for plain HTTP/1.1 (and TLS) upstreams."""

    def __init__(self, max_keepalive: int = 256, keepalive_expiry: float = 60.0) -> None:
        self.max_keepalive = max_keepalive
        self.keepalive_expiry = keepalive_expiry
        self._idle: dict[tuple, deque[_Conn]] = {}
        self._ssl: _ssl.SSLContext | None = None

    def _put(self, conn: _Conn) -> None:
        idle = self._idle.setdefault(conn.key, deque())
        if len(idle) >= self.max_keepalive:
            conn.transport.close()
            return
        conn.idle_since = time.monotonic()
        idle.append(conn)

    def _get(self, key: tuple) -> _Conn | None:
        idle = self._idle.get(key)
        if not idle:
            return None
        now = time.monotonic()
        while idle:
            conn = idle.pop()  # most recently used first: warmest, least likely stale
            if not conn.closed and now - conn.idle_since < self.keepalive_expiry:
                return conn
            conn.transport.close()
        return None

    async def _connect(self, request: httpx.Request, key: tuple, timeout: float | None) -> _Conn:
        scheme, host, port = key
        ssl = None
        if scheme == "https":
            if self._ssl is None:
                self._ssl = _ssl.create_default_context()
            ssl = self._ssl
        loop = asyncio.get_running_loop()
        try:
            _, conn = await asyncio.wait_for(
                loop.create_connection(
                    lambda: _Conn(key), host, port, ssl=ssl, server_hostname=host if ssl else None
                ),
                timeout,
            )
        except TimeoutError:
            raise httpx.ConnectTimeout(
                f"connecting to {host}:{port} timed out", request=request
            ) from None
        except OSError as exc:
            raise httpx.ConnectError(str(exc) or type(exc).__name__, request=request) from None
        return conn

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        url = request.url
        key = (url.scheme, url.host, url.port or (443 if url.scheme == "https" else 80))
        timeouts = request.extensions.get("timeout", {})
        try:
            body = request.content
        except httpx.RequestNotRead:
            stream = request.stream
            assert isinstance(stream, httpx.AsyncByteStream)
            body = b"".join([part async for part in stream])
        head = [request.method.encode(), b" ", url.raw_path, b" HTTP/1.1\r\n"]
        for k, v in request.headers.raw:
            head += [k, b": ", v, b"\r\n"]
        head.append(b"\r\n")
        wire = b"".join(head) + body
        for attempt in range(3):
            idle = self._get(key)
            reused = idle is not None
            conn = idle or await self._connect(request, key, timeouts.get("connect"))
            conn.start(request, timeouts.get("read"))
            conn.transport.write(wire)
            try:
                while not conn.headers_done:
                    if conn.error is not None:
                        raise conn.error
                    await conn.wait()
            except _Stale:
                conn.finish()
                if reused and attempt < 2:
                    continue  # the engine closed an idle connection as we picked it
                raise httpx.RemoteProtocolError(
                    "upstream closed the connection without a response", request=request
                ) from None
            except BaseException:
                conn.finish()
                conn.transport.close()
                raise
            break
        return httpx.Response(
            conn.status,
            headers=conn.headers,
            stream=_Body(conn, self),
            extensions={"http_version": b"HTTP/1.1", "reason_phrase": conn.reason},
        )

    async def aclose(self) -> None:
        for idle in self._idle.values():
            for conn in idle:
                conn.transport.close()
        self._idle.clear()
