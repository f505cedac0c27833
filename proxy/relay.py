"""The relay: moves a request to its upstream and the response back, byte for byte.

Every method and path is forwarded. Generation endpoints (as the upstream's dialect
names them) are also measured: a dialect tap watches the response on its way through
(SPEC §1, §6). A client that hangs up cancels the exchange at once, which closes the
upstream connection so the engine stops generating.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from dataclasses import dataclass, field

import httpx

from .access import Access
from .dialects import Prepared, Tap
from . import catalog
from .dialects.base import Outcome
from .record import Recorder
from .timeline import Marks
from .upstreams import QueueFull, QueueTimeout, Upstream, Upstreams

log = logging.getLogger("phasewatch")

#: RFC 9110 §7.6.1 connection-specific fields, plus the proxy's own credentials and the
#: framing and host the proxy sets itself on each side.
HOP_BY_HOP = frozenset({
    b"connection", b"keep-alive", b"proxy-connection", b"te", b"trailer",
    b"transfer-encoding", b"upgrade", b"proxy-authorization", b"proxy-authenticate",
})
_REQUEST_DROP = HOP_BY_HOP | {b"host", b"content-length"}

#: Largest non-streamed measured response kept for reading its usage.
_MAX_KEPT_BODY = 16 * 1024 * 1024


@dataclass(slots=True, eq=False)
class Exchange:
    """Everything known about one measured request; handed to the recorder at the end."""

    request_id: str
    upstream: Upstream
    prepared: Prepared
    marks: Marks
    model_label: str
    status: int = 0
    outcome: str = "ok"  # ok | error | aborted | rejected
    error_kind: str | None = None
    error_message: str | None = None
    abort_phase: str | None = None
    tap: Tap | None = None
    result: Outcome = field(default_factory=Outcome)


def _connection_tokens(headers) -> set[bytes]:
    tokens: set[bytes] = set()
    for k, v in headers:
        if k.lower() == b"connection":
            tokens.update(t.strip().lower() for t in v.split(b","))
    return tokens


def request_headers(scope_headers) -> list[tuple[bytes, bytes]]:
    """The client's end-to-end headers. A client's x-request-id passes through; the proxy
    adds none of its own, because engines adopt it (vLLM builds its response ids from it)
    and the client must see what a direct request would have given."""
    drop = _REQUEST_DROP | _connection_tokens(scope_headers)
    return [(k, v) for k, v in scope_headers if k not in drop]


def response_headers(raw) -> list[tuple[bytes, bytes]]:
    drop = HOP_BY_HOP | _connection_tokens(raw)
    return [(k.lower(), v) for k, v in raw if k.lower() not in drop]


def _request_id(scope_headers) -> str:
    """The client's x-request-id (logged), or a fresh one for the log line alone."""
    for k, v in scope_headers:
        if k == b"x-request-id":
            text = v.decode("latin-1")
            if 0 < len(text) <= 128 and text.isprintable():
                return text
    return uuid.uuid4().hex


def json_error(status: int, message: str, kind: str) -> bytes:
    """An OpenAI-style error body, as every OpenAI SDK parses it."""
    return json.dumps({"error": {"message": message, "type": kind, "param": None,
                                 "code": status}}).encode()


async def send_error(send, status: int, message: str, kind: str,
                     extra_headers: list[tuple[bytes, bytes]] | None = None,
                     shape=None) -> None:
    """`shape(status, message, kind)` -> (content type, body): the engine's own error
    shape for the path (Ollama's native API: ``{"error":"..."}``); OpenAI's by default."""
    ctype, body = shape(status, message, kind) if shape else (b"application/json",
                                                               json_error(status, message, kind))
    headers = [(b"content-type", ctype),
               (b"content-length", str(len(body)).encode())] + (extra_headers or [])
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body, "more_body": False})


class ClientGone(Exception):
    """The client disconnected while its request body was being read."""


async def read_body(receive, limit: int) -> bytes | None:
    """The whole request body, or None when it exceeds `limit`."""
    chunks = []
    size = 0
    while True:
        msg = await receive()
        if msg["type"] == "http.disconnect":
            raise ClientGone()
        chunk = msg.get("body", b"")
        size += len(chunk)
        if size > limit:
            return None
        chunks.append(chunk)
        if not msg.get("more_body", False):
            return b"".join(chunks)


class Relay:
    """ASGI app forwarding everything to the upstreams (measuring generation)."""

    def __init__(self, upstreams: Upstreams, recorder: Recorder, *, inject_usage: bool,
                 max_body_bytes: int, access: Access | None = None) -> None:
        self.upstreams = upstreams
        self.recorder = recorder
        self.inject_usage = inject_usage
        self.max_body_bytes = max_body_bytes
        self.access = access or Access([], {})
        #: Set on SIGTERM: new generation requests get 503 while in-flight ones finish.
        self.draining = False

    def busy(self) -> int:
        """Generation requests in flight or queued, over all upstreams."""
        return sum(len(u.active) + u.gate.queued for u in self.upstreams.all)

    async def __call__(self, scope, receive, send) -> None:
        headers = scope["headers"]
        if not self.access.allowed(headers):
            await send_error(send, 401, "missing or invalid phasewatch API key (send "
                             "Authorization: Bearer KEY or x-api-key: KEY)", "authentication_error",
                             [(b"www-authenticate", b'Bearer realm="phasewatch"')])
            return
        for k, v in headers:
            if k == b"content-length" and v.isdigit() and int(v) > self.max_body_bytes:
                await send_error(send, 413, f"request body over {self.max_body_bytes} bytes",
                                 "request_too_large")
                return
        try:
            body = await read_body(receive, self.max_body_bytes)
        except ClientGone:
            return
        if body is None:
            await send_error(send, 413, f"request body over {self.max_body_bytes} bytes",
                             "request_too_large")
            return
        t_recv = time.monotonic()
        method = scope["method"]
        path = scope["path"]

        upstream = self.upstreams.all[0]
        model = None
        if len(self.upstreams.all) > 1:
            if method == "GET" and path in catalog.UNION_PATHS:  # every upstream's models
                await catalog.send_union(send, self.upstreams, path)
                return
            model = _peek_model(body) if method == "POST" else catalog.model_in_path(path)
            upstream = self.upstreams.route(model)
        dialect = upstream.dialect
        endpoint = dialect.endpoint(method, path)
        request_id = _request_id(headers)
        prepared = None
        if endpoint is not None:  # a dialect may also decline (an Ollama model load)
            prepared = dialect.prepare(endpoint, body, self.inject_usage)
        if prepared is None:
            await self._passthrough(scope, receive, send, upstream, body)
            return
        label = upstream.model_label(prepared.model)
        ex = Exchange(request_id, upstream, prepared, Marks(t_recv=t_recv), label)
        await self._measured(scope, receive, send, ex)

    # --- unmeasured paths -----------------------------------------------------------

    async def _passthrough(self, scope, receive, send, upstream: Upstream, body: bytes) -> None:
        task = asyncio.current_task()
        state = _Watch()
        watcher = asyncio.create_task(_watch_disconnect(receive, task, state))
        resp = None
        try:
            resp = await self._open(upstream, scope, body)
            await send({"type": "http.response.start", "status": resp.status_code,
                        "headers": response_headers(resp.headers.raw)})
            async for chunk in resp.aiter_raw():
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            state.finished = True
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        except _UpstreamFailure as exc:
            state.finished = True
            await send_error(send, exc.status, exc.message, exc.kind,
                             shape=_shape(upstream, scope["path"]))
        except httpx.HTTPError as exc:  # mid-body: end the connection, the client sees it cut
            log.warning("upstream %s failed mid-response on %s: %s", upstream.name,
                        scope["path"], _describe(exc))
        except asyncio.CancelledError:
            if not state.disconnected:
                raise
            task.uncancel()
        finally:
            watcher.cancel()
            if resp is not None:
                await resp.aclose()

    # --- measured generation ----------------------------------------------------------

    async def _measured(self, scope, receive, send, ex: Exchange) -> None:
        upstream = ex.upstream
        m = self.recorder.metrics
        precision = upstream.precision_of(ex.model_label).precision
        base = (upstream.name, ex.model_label, precision)
        task = asyncio.current_task()
        state = _Watch()
        watcher = asyncio.create_task(_watch_disconnect(receive, task, state))
        resp = None
        admitted = False
        queued = m.queued_requests.labels(*base)
        in_flight = m.in_flight_requests.labels(*base)
        try:
            if self.draining:
                state.finished = True
                ex.outcome, ex.status = "rejected", 503
                await send_error(send, 503, "phasewatch is shutting down", "unavailable")
                return
            queued.inc()
            try:
                await upstream.gate.acquire()
            except QueueFull:
                state.finished = True
                ex.outcome, ex.status = "rejected", 429
                await send_error(send, 429, f"upstream {upstream.name} queue is full "
                                 f"({upstream.gate.max_queue} waiting); retry later",
                                 "rate_limit_exceeded", [(b"retry-after", b"1")])
                return
            except QueueTimeout:
                state.finished = True
                ex.outcome, ex.status = "rejected", 503
                await send_error(send, 503, f"waited {upstream.gate.timeout:g}s in the queue "
                                 f"for upstream {upstream.name}", "queue_timeout",
                                 [(b"retry-after", b"1")])
                return
            finally:
                queued.dec()
            admitted = True
            upstream.active.add(ex)
            in_flight.inc()
            ex.marks.t_admit = time.monotonic()
            resp = await self._open(upstream, scope, ex.prepared.body,
                                    ex.marks)
            await self._stream_back(send, resp, ex, state)
        except _UpstreamFailure as exc:
            state.finished = True
            ex.outcome, ex.status = "error", exc.status
            ex.error_kind, ex.error_message = exc.kind, exc.message
            await send_error(send, exc.status, exc.message, exc.kind,
                             shape=_shape(upstream, scope["path"]))
        except asyncio.CancelledError:
            if not state.disconnected:
                raise
            task.uncancel()
            if ex.tap is not None and ex.tap.done:
                # the client had the whole answer (its terminator included) and left
                # before the upstream closed: that is a complete request, not an abort
                ex.result = result = ex.upstream.dialect.outcome(ex.tap, None, ex.status)
                if result.error_kind is not None:
                    ex.outcome = "error"
                    ex.error_kind, ex.error_message = result.error_kind, result.error_message
            else:
                ex.outcome = "aborted"
                ex.abort_phase = _abort_phase(ex)
        finally:
            watcher.cancel()
            if resp is not None:
                await resp.aclose()
            if admitted:
                upstream.active.discard(ex)
                upstream.gate.release()
                in_flight.dec()
            ex.marks.t_end = time.monotonic()
            self.recorder.record(ex, precision)

    async def _stream_back(self, send, resp: httpx.Response, ex: Exchange, state: "_Watch") -> None:
        """Forward the response; the per-chunk loop is the hottest code in the product."""
        ex.status = status = resp.status_code
        ex.marks.t_headers = time.monotonic()
        raw = resp.headers.raw
        dialect = ex.upstream.dialect
        tap = None
        if status < 400 and not _encoded(raw):
            ctype = resp.headers.get("content-type", "")
            tap = dialect.tap(ctype, ex.marks, ex.prepared)
        ex.tap = tap
        await send({"type": "http.response.start", "status": status,
                    "headers": response_headers(raw)})
        kept: list[bytes] | None = None if tap is not None else []
        kept_size = 0
        monotonic = time.monotonic
        try:
            if tap is not None:
                feed = tap.feed
                async for chunk in resp.aiter_raw():
                    out = feed(chunk, monotonic())
                    if out:
                        await send({"type": "http.response.body", "body": out, "more_body": True})
                tail = tap.flush()
                if not tap.done and tap.error_payload is None:
                    # the engine closed the stream cleanly but never finished it: say so in
                    # the stream's own framing so clients do not take a cut answer as whole
                    tail += dialect.stream_error(f"upstream {ex.upstream.name} ended the stream "
                                                 "without its terminator", ex.prepared.endpoint)
            else:
                async for chunk in resp.aiter_raw():
                    if kept_size < _MAX_KEPT_BODY:
                        kept.append(chunk)
                        kept_size += len(chunk)
                    await send({"type": "http.response.body", "body": chunk, "more_body": True})
                tail = b""
        except httpx.HTTPError as exc:
            ex.outcome, ex.status = "error", 502
            ex.error_kind = "timeout" if isinstance(exc, httpx.TimeoutException) else "midstream"
            ex.error_message = f"upstream {ex.upstream.name} failed mid-response: {_describe(exc)}"
            log.warning("%s (request %s)", ex.error_message, ex.request_id)
            if tap is not None:
                tail = tap.flush() + dialect.stream_error(ex.error_message, ex.prepared.endpoint)
                state.finished = True
                await send({"type": "http.response.body", "body": tail, "more_body": False})
            return  # a plain body is left cut short: the client sees the connection end
        state.finished = True
        await send({"type": "http.response.body", "body": tail, "more_body": False})
        body = b"".join(kept) if kept else None
        ex.result = result = dialect.outcome(tap, body, status)
        if result.error_kind is not None:
            ex.outcome = "error"
            ex.error_kind, ex.error_message = result.error_kind, result.error_message

    async def _open(self, upstream: Upstream, scope, body: bytes,
                    marks: Marks | None = None) -> httpx.Response:
        """Send the request upstream and return the response with its body unread."""
        qs = scope.get("query_string", b"")
        target = scope.get("raw_path") or scope["path"].encode()
        url = upstream.url + target.decode("latin-1") + ("?" + qs.decode("latin-1") if qs else "")
        headers = self.access.upstream_headers(
            request_headers(scope["headers"]), upstream.name)
        req = upstream.client.build_request(scope["method"], url, headers=headers, content=body)
        if marks is not None:
            marks.t_sent = time.monotonic()
        try:
            return await upstream.client.send(req, stream=True)
        except httpx.ConnectTimeout as exc:
            raise _UpstreamFailure(504, "timeout", f"upstream {upstream.name} ({upstream.url}) "
                                   f"did not accept a connection in time: {_describe(exc)}") from None
        except httpx.ConnectError as exc:
            raise _UpstreamFailure(502, "connect", f"upstream {upstream.name} ({upstream.url}) "
                                   f"is unreachable: {_describe(exc)}") from None
        except httpx.TimeoutException as exc:
            raise _UpstreamFailure(504, "timeout", f"upstream {upstream.name} ({upstream.url}) "
                                   f"did not answer in time: {_describe(exc)}") from None
        except httpx.HTTPError as exc:
            raise _UpstreamFailure(502, "protocol", f"upstream {upstream.name} ({upstream.url}) "
                                   f"failed: {_describe(exc)}") from None


class _UpstreamFailure(Exception):
    def __init__(self, status: int, kind: str, message: str) -> None:
        super().__init__(message)
        self.status, self.kind, self.message = status, kind, message


class _Watch:
    __slots__ = ("disconnected", "finished")

    def __init__(self) -> None:
        self.disconnected = False
        self.finished = False


async def _watch_disconnect(receive, task: asyncio.Task, state: _Watch) -> None:
    """Cancel the exchange the moment the client goes away (not after it is done)."""
    while True:
        msg = await receive()
        if msg["type"] == "http.disconnect":
            if not state.finished:
                state.disconnected = True
                task.cancel()
            return


def _abort_phase(ex: Exchange) -> str:
    m = ex.marks
    if m.t_admit is None:
        return "queue"
    if m.t_first is None:
        return "prefill"
    if ex.tap is not None and ex.tap.finish_seen:
        return "usage"
    return "decode"


def _encoded(raw_headers) -> bool:
    for k, v in raw_headers:
        if k.lower() == b"content-encoding" and v.strip().lower() not in (b"", b"identity"):
            return True
    return False


def _describe(exc: BaseException) -> str:
    text = str(exc) or type(exc).__name__
    return text[:200]


def _shape(upstream: Upstream, path: str):
    dialect = upstream.dialect
    return lambda status, message, kind: dialect.error_body(status, message, kind, path)


def _peek_model(body: bytes) -> str | None:
    try:
        obj = json.loads(body)
    except (ValueError, UnicodeDecodeError, RecursionError):
        return None
    model = obj.get("model", obj.get("name")) if isinstance(obj, dict) else None  # name: Ollama's alias
    return model if isinstance(model, str) else None
