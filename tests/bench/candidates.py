"""The library clients measured against phasewatch's own transport, behind the same
``httpx.AsyncBaseTransport`` interface the relay sends through. Not shipped: they run in
tests/bench/relay_bench.py (through tests/bench/pw_candidate.py) and in
tests/e2e/wire/test_transport.py, where what each gets wrong is a strict expected failure.

``httpx``: httpx's own transport (httpcore, h11) with the pool tuned like phasewatch's
(connections per upstream, keep-alive expiry, pool wait) and no retries.

``aiohttp``: aiohttp's client behind httpx's API. This one hands the
request to an ``aiohttp.ClientSession`` (C-accelerated llhttp parser, its own keep-alive
pool) set up to be transparent: no added headers (``skip_auto_headers``), no
decompression, no cookies, no redirects, the target passed as encoded. What aiohttp does
not promise on its own is added here, so that it passes the same tests as the other
clients:

- a close-delimited body ended by a reset (aiohttp takes it as a clean end) is an error;
- a pool limit with a bounded wait (``httpx.PoolTimeout``);
- a total response-head limit (aiohttp bounds each line and the header count);
- aiohttp's exceptions mapped to httpx's, so the relay's error mapping holds.
"""

from __future__ import annotations

import asyncio
import logging
import ssl

import aiohttp
import httpx
from yarl import URL

from proxy.transport import ClientOptions, make_transport

log = logging.getLogger(__name__)

#: aiohttp adds these unless told not to; a transparent proxy sends only the client's.
_SKIP = ("User-Agent", "Accept", "Accept-Encoding", "Content-Type")


def _mapped(exc: BaseException, request: httpx.Request, reading: bool) -> Exception:
    """httpx's exception for one of aiohttp's (the relay maps httpx's to its answers)."""
    text = str(exc) or type(exc).__name__
    if isinstance(exc, aiohttp.ConnectionTimeoutError):
        return httpx.ConnectTimeout(text, request=request)
    if isinstance(exc, aiohttp.ServerTimeoutError | TimeoutError):
        return httpx.ReadTimeout(text, request=request)
    if isinstance(exc, aiohttp.ClientConnectorError):
        return httpx.ConnectError(text, request=request)
    if isinstance(exc, aiohttp.ServerDisconnectedError):
        return httpx.RemoteProtocolError(
            "upstream closed the connection "
            + ("before the response ended" if reading else "without a response"),
            request=request,
        )
    if isinstance(exc, aiohttp.ClientPayloadError | aiohttp.ClientResponseError):
        return httpx.RemoteProtocolError(text, request=request)
    return httpx.ReadError(text, request=request)


class _Body(httpx.AsyncByteStream):
    __slots__ = ("closed", "delimited_by_close", "done", "released", "request", "resp", "transport")

    def __init__(
        self, resp: aiohttp.ClientResponse, request: httpx.Request, transport: AiohttpTransport
    ) -> None:
        self.resp = resp
        self.request = request
        self.transport = transport
        self.done = False
        self.released = False
        conn = resp.connection
        # aiohttp ends a close-delimited body at any close; a reset is not an end
        self.closed = conn.protocol.closed if conn is not None and conn.protocol else None
        headers = resp.headers
        self.delimited_by_close = (
            "Content-Length" not in headers
            and "chunked" not in headers.get("Transfer-Encoding", "").lower()
            and resp.status not in (204, 304)
            and resp.method != "HEAD"
        )

    async def __aiter__(self):
        if self.resp.status == 101:  # what follows is another protocol: not relayed
            self.done = True
            return
        content = self.resp.content
        try:
            while True:
                chunk = await content.readany()
                if not chunk:
                    break
                yield chunk
        except aiohttp.ClientError as exc:
            raise _mapped(exc, self.request, True) from None
        except TimeoutError as exc:
            raise _mapped(exc, self.request, True) from None
        closed = self.closed
        if (
            self.delimited_by_close
            and closed is not None
            and closed.done()
            and not closed.cancelled()
            and closed.exception() is not None
        ):
            raise httpx.RemoteProtocolError(
                f"upstream closed the connection before the response ended: {closed.exception()}",
                request=self.request,
            )
        self.done = True

    async def aclose(self) -> None:
        if self.released:
            return
        self.released = True
        resp = self.resp
        if self.done and resp.status != 101:
            resp.release()
        else:
            resp.close()  # closing the connection stops the engine
        closed = self.closed
        if closed is not None and closed.done() and not closed.cancelled():
            closed.exception()  # retrieved: no "never retrieved" warning
        self.transport._release()


class AiohttpTransport(httpx.AsyncBaseTransport):
    """An ``httpx.AsyncBaseTransport`` over one ``aiohttp.ClientSession``; one per upstream."""

    def __init__(
        self,
        options: ClientOptions | None = None,
        ssl_context: ssl.SSLContext | None = None,
        name: str = "",
    ) -> None:
        self.options = options = options or ClientOptions()
        self.name = name
        self._ssl = ssl_context
        self._session: aiohttp.ClientSession | None = None
        self._slots: asyncio.Semaphore | None = (
            asyncio.Semaphore(options.max_connections) if options.max_connections else None
        )

    def _new_session(self) -> aiohttp.ClientSession:
        o = self.options
        field = min(o.max_head_bytes, 1 << 20)
        connector = aiohttp.TCPConnector(
            limit=0,
            limit_per_host=0,
            keepalive_timeout=o.keepalive_expiry,
            ssl=self._ssl if self._ssl is not None else True,
        )
        return aiohttp.ClientSession(
            connector=connector,
            skip_auto_headers=_SKIP,
            auto_decompress=False,
            cookie_jar=aiohttp.DummyCookieJar(),
            requote_redirect_url=False,
            timeout=aiohttp.ClientTimeout(total=None),
            max_line_size=field,
            max_field_size=field,
        )

    def _release(self) -> None:
        if self._slots is not None:
            self._slots.release()

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        session = self._session
        if session is None:
            session = self._session = self._new_session()
        timeouts = request.extensions.get("timeout", {})
        if self._slots is not None:
            wait = timeouts.get("pool")
            try:
                await asyncio.wait_for(self._slots.acquire(), wait)
            except TimeoutError:
                log.warning(
                    "no free upstream connection in time",
                    extra={
                        "fields": {
                            "upstream": self.name,
                            "max_connections": self.options.max_connections,
                            "wait_s": wait,
                        }
                    },
                )
                raise httpx.PoolTimeout(
                    f"all {self.options.max_connections} connections busy for {wait:g}s "
                    "(--upstream-max-connections)",
                    request=request,
                ) from None
        try:
            try:
                body = request.content
            except httpx.RequestNotRead:
                body = b"".join([part async for part in request.stream])  # type: ignore[union-attr]
            headers = [(k.decode("latin-1"), v.decode("latin-1")) for k, v in request.headers.raw]
            try:
                resp = await session.request(
                    request.method,
                    URL(str(request.url), encoded=True),
                    headers=headers,
                    data=body or None,
                    allow_redirects=False,
                    timeout=aiohttp.ClientTimeout(
                        total=None,
                        sock_connect=timeouts.get("connect"),
                        sock_read=timeouts.get("read"),
                    ),
                )
            except aiohttp.ClientError as exc:
                raise _mapped(exc, request, False) from None
            except TimeoutError as exc:
                raise _mapped(exc, request, False) from None
            limit = self.options.max_head_bytes
            if sum(len(k) + len(v) + 4 for k, v in resp.raw_headers) > limit:
                resp.close()
                log.warning(
                    "upstream response head over the limit; connection closed",
                    extra={"fields": {"limit_bytes": limit, "upstream": self.name}},
                )
                raise httpx.RemoteProtocolError(
                    f"upstream response head over {limit} bytes (--upstream-max-head-bytes)",
                    request=request,
                )
        except BaseException:
            self._release()
            raise
        return httpx.Response(
            resp.status,
            headers=list(resp.raw_headers),
            stream=_Body(resp, request, self),
            extensions={
                "http_version": b"HTTP/1.1",
                "reason_phrase": (resp.reason or "").encode("latin-1", "replace"),
            },
        )

    async def aclose(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None


def httpx_transport(
    options: ClientOptions, ssl_context: ssl.SSLContext | None
) -> httpx.AsyncBaseTransport:
    return httpx.AsyncHTTPTransport(
        verify=ssl_context if ssl_context is not None else True,
        limits=httpx.Limits(
            max_connections=options.max_connections or None,
            max_keepalive_connections=options.max_connections or None,
            keepalive_expiry=options.keepalive_expiry,
        ),
        retries=0,
    )


#: The library candidates by name.
CANDIDATES = ("aiohttp", "httpx")


def candidate_transport(options: ClientOptions, name: str = "") -> httpx.AsyncBaseTransport:
    """A candidate's transport for `options.kind` (a shipped kind: phasewatch's own)."""
    tls = options.tls
    context = tls.context() if (tls.ca or tls.cert or tls.insecure) else None
    if options.kind == "aiohttp":
        return AiohttpTransport(options, context, name)
    if options.kind == "httpx":
        return httpx_transport(options, context)
    return make_transport(options, name)
