"""A lean HTTP/1.1 transport for httpx, used for the upstream (engine) connections.

Why: httpx's default transport does per-chunk and per-release work the relay does not
need (httpcore's pool scanning every connection on each release, anyio and h11 per
chunk), and under many paced streams that work dominated the proxy's CPU. This transport
keeps httpx's API (the relay sees an ``httpx.Response`` with ``aiter_raw``, ``aclose``
and httpx's exceptions) and moves bytes with an asyncio protocol and httptools' C parser
(:mod:`.connection`), and a LIFO list of idle keep-alive connections. The relay takes a
body in the connection's own callback, read by read, with its own backpressure (the
``phasewatch.relay`` response extension, :meth:`.Connection.relay`: no task wake-up per
read); ``aiter_raw`` (one future wake-up per read) serves every other reader.

What it promises, like the library clients it is tested beside:

- a response is whole or an error: a reset or EOF before the end of a body
  (Content-Length, chunked, or a close-delimited body ended by a reset) raises
  ``httpx.RemoteProtocolError``, never a short body taken as complete;
- a request is sent once: only idempotent methods are re-sent, once, and only when a
  reused idle connection turned out closed before any response byte; idle connections
  expire (``upstream_keepalive``) before the engine's own keep-alive, so that race is rare;
- a connection that carried anything unexpected (bytes after a complete response, a
  second response, a protocol switch) is closed, never reused;
- limits: response head size, connections per upstream with a pool wait, and
  connect/read/write timeouts, each raising httpx's matching exception;
- ``1xx`` heads are skipped, ``HEAD``/``204``/``304`` have no body, trailers are dropped,
  a ``101`` comes back as a bodiless response on a connection that is then closed.

Backpressure: an ``aiter_raw`` reader that leaves more than 256 KiB unread pauses reading;
the relay pauses and resumes it itself.
"""

from __future__ import annotations

import asyncio
import logging
import ssl as _ssl
import time
from collections import deque
from collections.abc import Iterable

import httpx

from ..extensions import RELAY
from .connection import Connection, Stale, named
from .options import IDEMPOTENT, ClientOptions
from .wire import request_wire

log = logging.getLogger(__name__)


class _Body(httpx.AsyncByteStream):
    __slots__ = ("conn", "pool", "released")

    def __init__(self, conn: Connection, pool: LeanTransport) -> None:
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
        reusable = conn.reusable()
        conn.finish()
        if reusable:
            self.pool._put(conn)
        else:
            conn.transport.close()

    async def aclose(self) -> None:
        self._release()


class LeanTransport(httpx.AsyncBaseTransport):
    """An ``httpx.AsyncBaseTransport`` for HTTP/1.1 (and TLS) upstreams; one per upstream."""

    def __init__(
        self,
        options: ClientOptions | None = None,
        ssl_context: _ssl.SSLContext | None = None,
        name: str = "",
    ) -> None:
        options = options or ClientOptions()
        self.name = name
        self.upstream_max_connections = options.upstream_max_connections
        self.upstream_keepalive = options.upstream_keepalive
        self.upstream_max_head_bytes = options.upstream_max_head_bytes
        self._ssl = ssl_context
        self._idle: dict[tuple, deque[Connection]] = {}
        self._open = 0  # connections open (busy and idle), counted against upstream_max_connections
        self._waiters: deque[asyncio.Future] = deque()

    # --- the pool -------------------------------------------------------------------------

    def _put(self, conn: Connection) -> None:
        conn.idle_since = time.monotonic()
        self._idle.setdefault(conn.key, deque()).append(conn)
        self._wake_one()

    def on_closed(self) -> None:
        """One of the pool's connections closed: one fewer open, a waiter woken."""
        self._open -= 1
        self._wake_one()

    def _wake_one(self) -> None:
        while self._waiters:
            fut = self._waiters.popleft()
            if not fut.done():
                fut.set_result(None)
                return

    def _get(self, key: tuple) -> Connection | None:
        idle = self._idle.get(key)
        if not idle:
            return None
        deadline = time.monotonic() - self.upstream_keepalive
        while idle:
            conn = idle.pop()  # most recently used first: warmest, least likely stale
            if not conn.closed and conn.idle_since > deadline:
                return conn
            conn.transport.close()
        return None

    async def _acquire(
        self,
        method: str,
        url: httpx.URL,
        request: httpx.Request | None,
        key: tuple,
        timeouts: dict,
    ) -> Connection:
        while True:
            conn = self._get(key)
            if conn is not None:
                return conn
            if not self.upstream_max_connections or self._open < self.upstream_max_connections:
                return await self._connect(method, url, request, key, timeouts.get("connect"))
            fut = asyncio.get_running_loop().create_future()
            self._waiters.append(fut)
            wait = timeouts.get("pool")
            try:
                await asyncio.wait_for(fut, wait)
            except TimeoutError:
                log.warning(
                    "no free upstream connection in time",
                    extra={
                        "fields": {
                            "upstream": self.name,
                            "max_connections": self.upstream_max_connections,
                            "wait_s": wait,
                        }
                    },
                )
                raise httpx.PoolTimeout(
                    f"all {self.upstream_max_connections} connections busy for {wait:g}s "
                    "(--upstream-max-connections)",
                    request=named(method, url, request),
                ) from None

    async def _connect(
        self,
        method: str,
        url: httpx.URL,
        request: httpx.Request | None,
        key: tuple,
        timeout: float | None,
    ) -> Connection:
        scheme, host, port = key
        ssl = None
        if scheme == "https":
            if self._ssl is None:
                self._ssl = _ssl.create_default_context()
            ssl = self._ssl
        loop = asyncio.get_running_loop()
        self._open += 1
        try:
            _, conn = await asyncio.wait_for(
                loop.create_connection(
                    lambda: Connection(self, key),
                    host,
                    port,
                    ssl=ssl,
                    server_hostname=host if ssl else None,
                ),
                timeout,
            )
        except TimeoutError:
            self._open -= 1
            self._wake_one()
            raise httpx.ConnectTimeout(
                f"connecting to {host}:{port} timed out", request=named(method, url, request)
            ) from None
        except (OSError, _ssl.SSLError) as exc:
            self._open -= 1
            self._wake_one()
            raise httpx.ConnectError(
                str(exc) or type(exc).__name__, request=named(method, url, request)
            ) from None
        except BaseException:
            self._open -= 1
            self._wake_one()
            raise
        return conn

    # --- a request ------------------------------------------------------------------------

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        try:
            body = request.content
        except httpx.RequestNotRead:
            stream = request.stream
            assert isinstance(stream, httpx.AsyncByteStream)
            body = b"".join([part async for part in stream])
        return await self.send(
            request.method,
            request.url,
            request.headers.raw,
            body,
            request.extensions.get("timeout", {}),
            request,
        )

    async def send(
        self,
        method: str,
        url: httpx.URL,
        fields: Iterable[tuple[bytes, bytes]],
        body: bytes | memoryview,
        timeouts: dict,
        request: httpx.Request | None = None,
        tail: bytes = b"",
    ) -> httpx.Response:
        """Send a request given as its parts (`fields` go on the wire as given: Host and
        the framing included) and return its response, body unread. Why: the relay's
        upstream request is whole already; built as an ``httpx.Request`` first, its
        headers would be normalised only to be written back out (some 40 us of the path
        before the upstream write, measured at concurrency 1). ``handle_async_request``
        is this, for an ``httpx.Request``; errors name `request` (or one made for them)."""
        key = (url.scheme, url.host, url.port or (443 if url.scheme == "https" else 80))
        # a large body is written after its head, not copied behind it (the event loop's
        # transport keeps a reference to what the socket does not take at once); `tail`
        # follows it
        large = len(body) > LARGE_BODY
        wire = request_wire(method, url.raw_path, fields, () if large else (body, tail))
        resend = method in IDEMPOTENT
        while True:
            conn = self._get(key)
            reused = conn is not None
            if conn is None:
                conn = await self._acquire(method, url, request, key, timeouts)
            conn.start(method, url, request, timeouts.get("read"))
            try:
                conn.transport.write(wire)
                if large:
                    conn.transport.write(body)
                    if tail:
                        conn.transport.write(tail)
                await conn.drain(timeouts.get("write"))
                while not conn.headers_done:
                    if conn.error is not None:
                        raise conn.error
                    await conn.wait()
            except Stale:
                conn.finish()
                if reused and resend:
                    resend = False
                    continue  # the engine closed an idle connection as we picked it
                raise httpx.RemoteProtocolError(
                    "upstream closed the connection without a response",
                    request=named(method, url, request),
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
            extensions={
                "http_version": b"HTTP/1.1",
                "reason_phrase": conn.reason,
                RELAY: conn.relay,
            },
        )

    async def aclose(self) -> None:
        for idle in self._idle.values():
            for conn in idle:
                conn.transport.close()
        self._idle.clear()


#: A request body at least this large is written on its own, after the head.
LARGE_BODY = 1024 * 1024
