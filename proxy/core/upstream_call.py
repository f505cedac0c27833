"""The upstream call: one request sent to its upstream, and its failures mapped.

The request goes straight to the upstream's transport with exactly the client's
end-to-end headers (httpx's client would add its defaults and keep cookies). A failure
becomes an :class:`~proxy.core.errors.UpstreamFailure` with the status the client gets
(502 unreachable or broken, 503 no free connection, 504 no answer in time), and ejects
the upstream where it says the engine went away. One that left no byte of the request
at the engine (``unsent``) lets the request go to the next member of its pool instead.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable

import httpx

from ..fleet.upstream import Upstream, failure_reason
from ..measure.timeline import Marks
from .access import Access, strip_key_param
from .asgi import Scope
from .errors import UpstreamFailure, describe
from .headers import Headers, request_headers
from .limited import LimitedLog
from .routing import Route

#: Called before a request that could not be sent goes to the next member of its pool
#: (the measured path moves its admission there); it may raise the failure again.
Moving = Callable[[Upstream, UpstreamFailure], Awaitable[None]]


class UpstreamCall:
    """Sends requests upstream (see the module's docstring)."""

    def __init__(
        self, access: Access, limited_log: LimitedLog, via: tuple[bytes, bytes] | None = None
    ) -> None:
        self.access = access
        self.limited_log = limited_log
        #: This proxy's ``Via`` field, added to every request sent (proxy.core.headers.via).
        self.via = via

    async def open_route(
        self,
        route: Route,
        scope: Scope,
        body: bytes | memoryview,
        marks: Marks | None = None,
        extra: Headers | None = None,
        moving: Moving | None = None,
        tail: bytes = b"",
    ) -> httpx.Response:
        """Send the request to the route's upstream, then to the next member of its pool
        while it could not be sent; a request that was sent is never sent again. The
        route's upstream is, when this returns or raises, the last one tried. The body
        sent is `body` then `tail` (see ``Prepared``)."""
        while True:
            try:
                return await self.open(route.upstream, scope, body, marks, extra, tail)
            except UpstreamFailure as exc:
                if not exc.unsent or not route.chain:
                    raise
                failed, nxt = route.upstream, route.chain.pop(0)
                self.limited_log.warning(
                    "retry",
                    "upstream %s: a request could not be sent (%s); sent to %s of its pool instead",
                    failed.name,
                    exc.kind,
                    nxt.name,
                )
                route.upstream = nxt
                if moving is not None:
                    await moving(nxt, exc)

    async def open(
        self,
        upstream: Upstream,
        scope: Scope,
        body: bytes | memoryview,
        marks: Marks | None = None,
        extra: Headers | None = None,
        tail: bytes = b"",
    ) -> httpx.Response:
        """Send the request upstream and return the response with its body unread;
        `extra` headers (the trace context, with --otel) replace the client's of the
        same name."""
        qs = scope.get("query_string", b"")
        if qs and self.access.required:
            qs = strip_key_param(qs)  # the page login's key is never the engine's
        target = scope.get("raw_path") or scope["path"].encode()
        headers = self.access.upstream_headers(request_headers(scope["headers"]), upstream.name)
        if extra:
            names = {k for k, _ in extra}
            headers = [h for h in headers if h[0] not in names] + extra
        if self.via is not None:
            headers.append(self.via)
        where = f"upstream {upstream.name} ({upstream.url})"
        method = scope["method"].upper()  # as httpx's Request has it
        try:
            url = upstream_url(upstream.url, target, qs)
        except httpx.InvalidURL as exc:
            raise UpstreamFailure(400, "bad_request", f"bad request target: {exc}") from None
        fields = upstream_fields(method, url, headers, len(body) + len(tail))
        if marks is not None:
            marks.t_sent = time.monotonic()
        try:
            resp = await upstream.transport.send(
                method, url, fields, body, upstream.timeouts, tail=tail
            )
        except httpx.ConnectTimeout as exc:
            upstream.eject("timeout", failure_reason(exc, ""))
            raise UpstreamFailure(
                504,
                "timeout",
                f"{where} did not accept a connection in time: {describe(exc)}",
                unsent=True,
            ) from None
        except httpx.ConnectError as exc:
            upstream.eject("connect", failure_reason(exc, ""))
            raise UpstreamFailure(
                502, "connect", f"{where} is unreachable: {describe(exc)}", unsent=True
            ) from None
        except httpx.PoolTimeout as exc:
            raise UpstreamFailure(
                503, "pool", f"no free connection to {where}: {describe(exc)}", unsent=True
            ) from None
        except httpx.RemoteProtocolError as exc:  # sent, and the engine closed: no retry
            upstream.eject("protocol", "closed the connection without an answer")
            raise UpstreamFailure(502, "protocol", f"{where} failed: {describe(exc)}") from None
        except httpx.TimeoutException as exc:
            upstream.failed("timeout", "no answer in time")
            raise UpstreamFailure(
                504, "timeout", f"{where} did not answer in time: {describe(exc)}"
            ) from None
        except httpx.HTTPError as exc:
            raise UpstreamFailure(502, "protocol", f"{where} failed: {describe(exc)}") from None
        if resp.status_code == 101:  # the connection now speaks another protocol
            await resp.aclose()
            raise UpstreamFailure(
                502, "protocol", f"{where} switched protocols (101), which is not relayed"
            )
        status = resp.status_code
        upstream.answered(status, resp.headers.get("retry-after") if status == 429 else None)
        return resp


_BODY_METHODS = ("POST", "PUT", "PATCH")


def upstream_fields(method: str, url: httpx.URL, headers: Headers, size: int) -> Headers:
    """The header fields httpx would send for ``httpx.Request(method, url,
    headers=headers, content=body)`` with a body of `size` bytes: `headers` in order,
    Host and Content-Length added as httpx adds them. Why not build that request: the
    lean transport takes the parts, and httpx normalises the headers twice and looks each
    added one up by name, work the request path does not need. Tests hold them (and the
    bytes sent) to httpx's."""
    names = {k.lower() for k, _ in headers}
    raw = list(headers)
    if size and b"content-length" not in names:
        raw.append((b"Content-Length", str(size).encode()))
        names.add(b"content-length")
    auto: Headers = []
    if b"host" not in names and url.host:
        auto.append((b"Host", url.netloc))
    if (
        b"content-length" not in names
        and b"transfer-encoding" not in names
        and method.upper() in _BODY_METHODS
    ):
        auto.append((b"Content-Length", b"0"))
    return auto + raw


#: Parsed upstream URLs by (base, target, query): parsing one is over half the cost of
#: building a request, and a proxy sees the same few targets again and again.
_URLS: dict[tuple[str, bytes, bytes], httpx.URL] = {}
_MAX_URLS = 1024


def upstream_url(base: str, target: bytes, qs: bytes) -> httpx.URL:
    key = (base, target, qs)
    url = _URLS.get(key)
    if url is None:
        text = base + target.decode("latin-1") + ("?" + qs.decode("latin-1") if qs else "")
        url = httpx.URL(text)
        if len(_URLS) >= _MAX_URLS:
            _URLS.clear()  # bounded: a client making up targets only loses the cache
        _URLS[key] = url
    return url
