"""The relay: moves a request to its upstream and the response back, byte for byte.

Every method and path is forwarded. Generation endpoints (as the upstream's engine
names them) are also measured: the engine's tap watches the response on its way
through. A client that hangs up cancels the exchange at once, which closes the upstream
connection so the engine stops generating.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Callable

import httpx

from ..engines import MODEL_FIELDS, Tap, is_admin_path, native_api
from ..engines.framing import MAX_EVENT_BYTES
from ..measure.recorder import Recorder
from ..measure.timeline import Marks
from . import catalog
from .access import Access
from .asgi import Receive, Scope, Send
from .budget import Body, BodyBudget, ClientGone, OverBudget, Stalled, TooLarge
from .clients import Clients
from .coding import Decoded, codings, decodable, decode_whole
from .errors import ErrorShape, UpstreamFailure, describe, send_error
from .exchange import Exchange
from .gate import QueueFull, QueueTimeout
from .headers import (
    IDENTITY,
    Headers,
    request_headers,
    request_id,
    response_headers,
    without,
)
from .limited import LimitedLog
from .pool import PoolDown
from .upstreams import Upstream, Upstreams, failure_reason

log = logging.getLogger(__name__)

#: Largest non-streamed measured response kept for reading its usage.
_MAX_KEPT_BODY = 16 * 1024 * 1024

#: Called once per measured request before it goes upstream (the tracing side service):
#: it may set the exchange's trace id, span handle and trace context headers.
TraceHook = Callable[[Exchange, Headers], None]


def _declared_length(headers: list[tuple[bytes, bytes]]) -> int | None:
    """The request's Content-Length (the server already refused a malformed one)."""
    for k, v in headers:
        if k == b"content-length" and v.isdigit():
            return int(v)
    return None


class Relay:
    """ASGI app forwarding everything to the upstreams (measuring generation)."""

    def __init__(
        self,
        upstreams: Upstreams,
        recorder: Recorder,
        *,
        inject_usage: bool,
        max_body_bytes: int,
        access: Access | None = None,
        clients: Clients | None = None,
        trace_hook: TraceHook | None = None,
        echo_request_id: bool = False,
        max_body_memory: int | None = None,
        max_event_bytes: int = MAX_EVENT_BYTES,
        body_timeout: float = 30.0,
        admin_api: str = "allow",
    ) -> None:
        self.upstreams = upstreams
        self.recorder = recorder
        self.inject_usage = inject_usage
        self.max_body_bytes = max_body_bytes
        self.access = access or Access([], {})
        self.clients = clients or Clients()
        self.trace_hook = trace_hook
        #: Return the request id in an x-request-id response header (measured requests).
        self.echo_request_id = echo_request_id
        #: Request bodies held at once, over every request of this process.
        self.bodies = BodyBudget(max_body_memory or 4 * max_body_bytes)
        self.max_event_bytes = max_event_bytes
        #: Seconds a request body may stall (no byte arriving) before a 408.
        self.body_timeout = body_timeout
        self._refusals = LimitedLog(log)
        #: Set on SIGTERM: new generation requests get 503 while in-flight ones finish.
        self.draining = False
        #: The engines' model-management endpoints: allow, deny, or keyed (a bare proxy
        #: key, one naming no client, may call them).
        self.admin_api = admin_api

    def busy(self) -> int:
        """Generation requests in flight or queued, over all upstreams."""
        return sum(len(u.active) + u.gate.queued for u in self.upstreams.all)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        headers = scope["headers"]
        key_client = self.access.client(headers)
        if key_client is None:
            await send_error(
                send,
                401,
                "missing or invalid phasewatch API key (send "
                "Authorization: Bearer KEY or x-api-key: KEY)",
                "authentication_error",
                [(b"www-authenticate", b'Bearer realm="phasewatch"')],
            )
            return
        held = Body(self.bodies)
        try:
            # the body is passed on, not kept here: once prepared, only one copy lives
            await self._route(
                scope,
                receive,
                send,
                await held.read(
                    receive, self.max_body_bytes, _declared_length(headers), self.body_timeout
                ),
                key_client,
            )
        except ClientGone:
            return
        except TooLarge:
            await self._refuse(
                send, "body_too_large", 413, f"request body over {self.max_body_bytes} bytes"
            )
        except Stalled:
            await self._refuse(
                send,
                "body_timeout",
                408,
                f"no byte of the request body arrived for {self.body_timeout:g}s",
            )
        except OverBudget:
            await self._refuse(
                send,
                "body_memory",
                503,
                f"request bodies in memory are at --max-body-memory ({self.bodies.limit} "
                "bytes); retry later",
                [(b"retry-after", b"1")],
            )
        finally:
            held.release()

    async def _refuse(
        self,
        send: Send,
        reason: str,
        status: int,
        message: str,
        extra: list[tuple[bytes, bytes]] | None = None,
    ) -> None:
        """Refuse a request before it goes upstream: counted, said once in the log."""
        self.recorder.metrics.rejected_total.labels(reason).inc()
        self._refusals.warning(reason, "refused a request (%s): %s", reason, message)
        kind = {413: "request_too_large", 408: "request_timeout"}.get(status, "unavailable")
        await send_error(send, status, message, kind, extra)

    async def _route(
        self, scope: Scope, receive: Receive, send: Send, body: bytes, key_client: str
    ) -> None:
        """Pick the upstream, then relay the request measured or as it is; `key_client` is
        the client a named proxy key names ("" when none does)."""
        headers = scope["headers"]
        t_recv = time.monotonic()
        method = scope["method"]
        path = scope["path"]
        if not self.upstreams.probed:  # only the first requests after start
            await self.upstreams.wait_probed()
        if (
            self.admin_api != "allow"
            and method not in ("GET", "HEAD")
            and is_admin_path(path)
            and (self.admin_api == "deny" or key_client != "")
        ):
            await self._refuse_admin(send, path)
            return

        upstream = self.upstreams.all[0]
        chain: list[Upstream] = []
        if len(self.upstreams.all) > 1:
            if method == "GET" and path in catalog.UNION_PATHS:  # every upstream's models
                await catalog.send_union(send, self.upstreams, path)
                return
            model = _peek_model(body) if method == "POST" else catalog.model_in_path(path)
            api = native_api(path) if method in ("POST", "DELETE") else None
            if api is not None:  # an engine's own API: only that engine's upstreams
                prefix, speaker = api
                native = self.upstreams.route_native(model if method == "POST" else None, prefix)
                if native is None:  # only engines without that API serve it
                    await send_error(
                        send,
                        404,
                        f"model '{model}' not found",
                        "not_found",
                        shape=lambda st, msg, kind: speaker.error_body(st, msg, kind, path),
                    )
                    return
                upstream = native
            else:
                try:
                    upstream, *chain = self.upstreams.choose(model, body)
                except PoolDown as exc:
                    self.recorder.metrics.rejected_total.labels("pool_down").inc()
                    self._refusals.warning("pool_down", "refused a request (pool_down): %s", exc)
                    await send_error(send, 503, str(exc), "unavailable", [(b"retry-after", b"1")])
                    return
        dialect = upstream.dialect
        endpoint = dialect.endpoint(method, path)
        # a dialect may also decline (an Ollama model load is not a generation)
        prepared = dialect.prepare(endpoint, body, self.inject_usage) if endpoint else None
        if prepared is None:
            await self._passthrough(scope, receive, send, upstream, body, chain)
            return
        del body  # only the prepared body is kept from here on
        label = upstream.model_label(prepared.model)
        ex = Exchange(
            request_id(headers),
            upstream,
            prepared,
            Marks(t_recv=t_recv),
            label,
            upstream.precision_of(label).precision,
        )
        ex.client = self.clients.label(headers, key_client)
        if self.trace_hook is not None:
            try:
                self.trace_hook(ex, headers)
            except Exception:  # a side service must never break the request path
                log.exception("trace hook failed (request %s)", ex.request_id)
        await self._measured(scope, receive, send, ex, chain)

    async def _refuse_admin(self, send: Send, path: str) -> None:
        self.recorder.metrics.rejected_total.labels("admin_api").inc()
        self._refusals.warning(
            "admin_api",
            "refused a request (admin_api): a model-management endpoint (--admin-api %s)",
            self.admin_api,
        )
        how = "with a proxy key that names no client" if self.admin_api == "keyed" else ""
        await send_error(
            send,
            403,
            f"{path[:100]} manages the engine's models; phasewatch refuses it "
            f"(--admin-api {self.admin_api}{': allowed only ' + how if how else ''})",
            "permission_denied",
        )

    def _retry_on(self, failed: Upstream, nxt: Upstream, exc: UpstreamFailure) -> None:
        """Say (at most every 10 s) that a request that never reached `failed` goes on."""
        self._refusals.warning(
            "retry",
            "upstream %s: a request could not be sent (%s); sent to %s of its pool instead",
            failed.name,
            exc.kind,
            nxt.name,
        )

    # --- unmeasured paths -----------------------------------------------------------

    async def _passthrough(
        self,
        scope: Scope,
        receive: Receive,
        send: Send,
        upstream: Upstream,
        body: bytes,
        chain: list[Upstream] | None = None,
    ) -> None:
        task = asyncio.current_task()
        assert task is not None
        state = _Watch()
        watcher = asyncio.create_task(_watch_disconnect(receive, task, state))
        resp = None
        fallbacks = list(chain or ())
        try:
            while True:
                try:
                    resp = await self._open(upstream, scope, body)
                except UpstreamFailure as exc:
                    if not exc.unsent or not fallbacks:
                        raise
                    nxt = fallbacks.pop(0)
                    self._retry_on(upstream, nxt, exc)
                    upstream = nxt
                    continue
                break
            await send(
                {
                    "type": "http.response.start",
                    "status": resp.status_code,
                    "headers": response_headers(resp.headers.raw),
                }
            )
            async for chunk in resp.aiter_raw():
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            state.finished = True
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        except UpstreamFailure as exc:
            state.finished = True
            await send_error(
                send, exc.status, exc.message, exc.kind, shape=_shape(upstream, scope["path"])
            )
        except httpx.HTTPError as exc:  # mid-body: end the connection, the client sees it cut
            log.warning(
                "upstream %s failed mid-response on %s: %s",
                upstream.name,
                scope["path"][:200],
                describe(exc),
            )
        except asyncio.CancelledError:
            if not state.disconnected:
                raise
            task.uncancel()
        finally:
            watcher.cancel()
            if resp is not None:
                await resp.aclose()

    # --- measured generation ----------------------------------------------------------

    async def _measured(
        self,
        scope: Scope,
        receive: Receive,
        send: Send,
        ex: Exchange,
        chain: list[Upstream] | None = None,
    ) -> None:
        """Admit, send and relay one measured request. `chain`: the other members of the
        request's pool, tried in order while the request could not be sent (no byte of it
        reached the engine); a request that was sent is never sent again."""
        upstream = ex.upstream
        fallbacks = list(chain or ())
        m = self.recorder.metrics
        base = (upstream.name, ex.model_label, ex.precision)
        task = asyncio.current_task()
        assert task is not None
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
                await send_error(
                    send, 503, "phasewatch is shutting down", "unavailable", self._echo(ex)
                )
                return
            queued.inc()
            try:
                await upstream.gate.acquire()
            except QueueFull:
                state.finished = True
                ex.outcome, ex.status = "rejected", 429
                self._refusals.warning(
                    "queue_full",
                    "upstream %s: %d requests running and %d waiting (--max-concurrency, "
                    "--max-queue); refused with 429",
                    upstream.name,
                    upstream.gate.limit,
                    upstream.gate.max_queue,
                )
                await send_error(
                    send,
                    429,
                    f"upstream {upstream.name} queue is full "
                    f"({upstream.gate.max_queue} waiting); retry later",
                    "rate_limit_exceeded",
                    [(b"retry-after", b"1"), *self._echo(ex)],
                )
                return
            except QueueTimeout:
                state.finished = True
                ex.outcome, ex.status = "rejected", 503
                self._refusals.warning(
                    "queue_timeout",
                    "upstream %s: a request waited %gs in the queue (--queue-timeout); "
                    "refused with 503",
                    upstream.name,
                    upstream.gate.timeout,
                )
                await send_error(
                    send,
                    503,
                    f"waited {upstream.gate.timeout:g}s in the queue for upstream {upstream.name}",
                    "queue_timeout",
                    [(b"retry-after", b"1"), *self._echo(ex)],
                )
                return
            finally:
                queued.dec()
            admitted = True
            upstream.active.add(ex)
            in_flight.inc()
            ex.marks.t_admit = time.monotonic()
            extra = ex.trace_headers
            if ex.prepared.strip_usage:
                # what phasewatch adds must be removable: ask for an answer it can strip
                # (the client's Accept-Encoding is replaced, this one case only)
                extra = [*(extra or ()), IDENTITY]
            while True:
                try:
                    resp = await self._open(upstream, scope, ex.prepared.body, ex.marks, extra)
                except UpstreamFailure as exc:
                    if not exc.unsent or not fallbacks:
                        raise
                    # not sent: the next member takes it, through its own gate
                    upstream.active.discard(ex)
                    upstream.gate.release()
                    in_flight.dec()
                    admitted = False
                    nxt = fallbacks.pop(0)
                    self._retry_on(upstream, nxt, exc)
                    m.pool_retries_total.labels(upstream.model_label(ex.prepared.model)).inc()
                    ex.upstream = upstream = nxt
                    ex.model_label = nxt.model_label(ex.prepared.model)
                    ex.precision = nxt.precision_of(ex.model_label).precision
                    base = (upstream.name, ex.model_label, ex.precision)
                    queued = m.queued_requests.labels(*base)
                    in_flight = m.in_flight_requests.labels(*base)
                    try:
                        await self._admit(upstream, queued)
                    except (QueueFull, QueueTimeout):
                        raise exc from None  # the next member is full too: the first failure
                    admitted = True
                    upstream.active.add(ex)
                    in_flight.inc()
                    continue
                break
            await self._respond(send, resp, ex, state)
        except UpstreamFailure as exc:
            state.finished = True
            ex.fail(exc.kind, exc.message, exc.status)
            await send_error(
                send,
                exc.status,
                exc.message,
                exc.kind,
                self._echo(ex),
                shape=_shape(upstream, scope["path"]),
            )
        except asyncio.CancelledError:
            if not state.disconnected:
                raise
            task.uncancel()
            if ex.tap is not None and ex.tap.done:
                # the client had the whole answer (its terminator included) and left
                # before the upstream closed: that is a complete request, not an abort
                self._settle(ex, None)
            else:
                ex.outcome = "aborted"
                ex.abort_phase = ex.abort_phase_now()
        finally:
            watcher.cancel()
            if resp is not None:
                await resp.aclose()
            if admitted:
                upstream.active.discard(ex)
                upstream.gate.release()
                in_flight.dec()
            ex.marks.t_end = time.monotonic()
            if ex.outcome == "ok" and ex.marks.t_admit is not None:
                upstream.observe(ex.marks.t_end - ex.marks.t_admit)  # least-loaded's rate
            self.recorder.record(ex)

    async def _admit(self, upstream: Upstream, queued) -> None:
        queued.inc()
        try:
            await upstream.gate.acquire()
        finally:
            queued.dec()

    async def _respond(self, send: Send, resp: httpx.Response, ex: Exchange, state: _Watch) -> None:
        """Forward the response head, then its body (tapped when it is a stream)."""
        ex.status = resp.status_code
        ex.marks.t_headers = time.monotonic()
        raw = resp.headers.raw
        applied = codings(raw)
        tap = None
        decoded = None
        if ex.status < 400:
            tap = ex.upstream.dialect.tap(
                resp.headers.get("content-type", ""), ex.marks, ex.prepared, self.max_event_bytes
            )
            if tap is not None and applied:
                decoded = self._decoded(ex, tap, applied)
                if decoded is None:
                    tap = None
        ex.tap = tap
        headers = response_headers(raw)
        if self.echo_request_id:
            headers = [h for h in headers if h[0] != b"x-request-id"] + self._echo(ex)
        if decoded is not None and not decoded.exact:
            # the decoded stream goes out (stripped) instead of the engine's coding
            headers = without(headers, b"content-encoding", b"content-length")
        elif tap is not None and decoded is None:
            # the proxy may change a stream's bytes: it goes out chunked
            headers = without(headers, b"content-length")
        await send({"type": "http.response.start", "status": ex.status, "headers": headers})
        source: Tap | Decoded | None = decoded or tap
        # the engine's coded bytes pass as they are: nothing of the proxy's may follow them
        sealed = decoded is not None and decoded.exact
        try:
            if tap is None or source is None:
                # a body phasewatch cannot decode is not kept: nothing in it is readable
                keep = _MAX_KEPT_BODY if not applied or decodable(applied) else 0
                kept = await self._forward_kept(send, resp, keep)
                tail = b""
            else:
                if decoded is not None and not decoded.exact:
                    tail = await self._stream_decoded(send, resp, decoded)
                else:
                    tail = await self._stream(send, resp, source)
                if not sealed:
                    tail += self._unterminated(ex, tap)
                kept = None
        except httpx.HTTPError as exc:
            # a stream's tap ends it on an event boundary; a stream that had reached its
            # end before the connection broke is a whole answer
            tail = source.end(time.monotonic()) if source is not None else b""
            if tap is None or not (tap.done or tap.error_payload is not None):
                if not isinstance(exc, httpx.TimeoutException):  # the engine went away
                    ex.upstream.eject("midstream", "a response was cut")
                ex.fail(
                    "timeout" if isinstance(exc, httpx.TimeoutException) else "midstream",
                    f"upstream {ex.upstream.name} failed mid-response: {describe(exc)}",
                    502,
                )
                log.warning("%s (request %s)", ex.error_message, ex.request_id)
                if tap is None or sealed:
                    return  # a plain body is left cut short: the client sees the connection end
                assert ex.error_message is not None
                state.finished = True
                tail += ex.upstream.dialect.stream_error(ex.error_message, ex.prepared.endpoint)
                await send({"type": "http.response.body", "body": tail, "more_body": False})
                return
            kept = None
        finally:
            if tap is not None and tap.oversized:
                self._oversized(ex, tap.oversized)
        state.finished = True
        await send({"type": "http.response.body", "body": tail, "more_body": False})
        if decoded is not None and decoded.broken is not None:
            ex.fail("protocol", f"upstream {ex.upstream.name}: {decoded.broken}")
            return
        if kept is not None and applied:
            got = decode_whole(applied, kept, _MAX_KEPT_BODY) if decodable(applied) else None
            if got is None:
                self._undecodable(ex, applied)
                if ex.status < 400:
                    return  # nothing readable: the request is counted, unmeasured
            kept = got
        self._settle(ex, kept)

    def _decoded(self, ex: Exchange, tap: Tap, applied: list[bytes]) -> Decoded | None:
        """A stream in a content coding: measured on a decoded copy where the coding is
        one phasewatch decodes (the tap then strips the decoded stream, when usage was
        injected); else None, and it passes through unmeasured."""
        if decodable(applied):
            return Decoded(tap, applied, exact=not tap.rewrites)
        if tap.rewrites:  # (counted with the body, as undecodable)
            self._refusals.warning(
                "undecodable_injected",
                "upstream %s answered in a coding phasewatch cannot decode although asked "
                "for identity: the usage it was asked for reaches the client (request %s)",
                ex.upstream.name,
                ex.request_id,
            )
        return None

    def _undecodable(self, ex: Exchange, applied: list[bytes]) -> None:
        """A body in a coding phasewatch cannot decode passed through: counted, said once."""
        self.recorder.metrics.errors_total.labels(
            ex.upstream.name, ex.model_label, ex.precision, "undecodable"
        ).inc()
        self._refusals.warning(
            "undecodable",
            "upstream %s answered in content coding %r, which phasewatch does not decode: "
            "passed through unmeasured (request %s)",
            ex.upstream.name,
            b",".join(applied)[:64],
            ex.request_id,
        )

    def _oversized(self, ex: Exchange, events: int) -> None:
        """Events too large to measure passed through: counted, and said once."""
        self.recorder.metrics.errors_total.labels(
            ex.upstream.name, ex.model_label, ex.precision, "oversized"
        ).inc()
        log.warning(
            "%d stream event(s) over --max-event-bytes (%d) passed through unmeasured "
            "(request %s, upstream %s)",
            events,
            self.max_event_bytes,
            ex.request_id,
            ex.upstream.name,
        )

    async def _stream(self, send: Send, resp: httpx.Response, source: Tap | Decoded) -> bytes:
        """The per-event loop, the hottest code in the product: feed each chunk to the tap
        (or to its decoder) and forward what it lets through. Returns what is left to send
        at the end."""
        feed, monotonic = source.feed, time.monotonic
        async for chunk in resp.aiter_raw():
            out = feed(chunk, monotonic())
            if out:
                await send({"type": "http.response.body", "body": out, "more_body": True})
        return source.end(monotonic())

    async def _stream_decoded(self, send: Send, resp: httpx.Response, decoded: Decoded) -> bytes:
        """A coded stream decoded for the client (usage was injected, the engine coded its
        answer anyway): forwarded a bounded piece at a time."""
        async for chunk in resp.aiter_raw():
            for out in decoded.pieces(chunk, time.monotonic()):
                await send({"type": "http.response.body", "body": out, "more_body": True})
        return decoded.end(time.monotonic())

    def _unterminated(self, ex: Exchange, tap: Tap) -> bytes:
        """The engine closed the stream cleanly but never finished it: say so in the
        stream's own framing so clients do not take a cut answer as whole."""
        if tap.done or tap.error_payload is not None:
            return b""
        ex.upstream.eject("midstream", "a stream ended without its terminator")
        return ex.upstream.dialect.stream_error(
            f"upstream {ex.upstream.name} ended the stream without its terminator",
            ex.prepared.endpoint,
        )

    async def _forward_kept(
        self, send: Send, resp: httpx.Response, keep: int = _MAX_KEPT_BODY
    ) -> bytes:
        """Forward a whole (unstreamed) body, keeping up to `keep` bytes of it to read
        its usage at the end."""
        kept: list[bytes] = []
        size = 0
        async for chunk in resp.aiter_raw():
            if size < keep:
                kept.append(chunk)
                size += len(chunk)
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
        return b"".join(kept)

    def _echo(self, ex: Exchange) -> Headers:
        """The x-request-id response header, with --echo-request-id."""
        if not self.echo_request_id:
            return []
        return [(b"x-request-id", ex.request_id.encode("latin-1"))]

    def _settle(self, ex: Exchange, body: bytes | None) -> None:
        """Read what the finished answer said (usage, engine timings, errors)."""
        ex.result = result = ex.upstream.dialect.outcome(ex.tap, body, ex.status)
        if result.error_kind is not None:
            ex.fail(result.error_kind, result.error_message or result.error_kind)

    async def _open(
        self,
        upstream: Upstream,
        scope: Scope,
        body: bytes,
        marks: Marks | None = None,
        extra: Headers | None = None,
    ) -> httpx.Response:
        """Send the request upstream and return the response with its body unread. The
        request goes straight to the upstream's transport: exactly the client's end-to-end
        headers (httpx's client would add its defaults and keep cookies); `extra` headers
        (the trace context, with --otel) replace the client's of the same name."""
        qs = scope.get("query_string", b"")
        target = scope.get("raw_path") or scope["path"].encode()
        headers = self.access.upstream_headers(request_headers(scope["headers"]), upstream.name)
        if extra:
            names = {k for k, _ in extra}
            headers = [h for h in headers if h[0] not in names] + extra
        where = f"upstream {upstream.name} ({upstream.url})"
        try:
            req = httpx.Request(
                scope["method"],
                _upstream_url(upstream.url, target, qs),
                headers=headers,
                content=body,
                extensions=upstream.request_extensions,
            )
        except httpx.InvalidURL as exc:
            raise UpstreamFailure(400, "bad_request", f"bad request target: {exc}") from None
        if marks is not None:
            marks.t_sent = time.monotonic()
        try:
            resp = await upstream.transport.handle_async_request(req)
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
        upstream.answered(resp.status_code)
        return resp


#: Parsed upstream URLs by (base, target, query): parsing one is over half the cost of
#: building a request, and a proxy sees the same few targets again and again.
_URLS: dict[tuple[str, bytes, bytes], httpx.URL] = {}
_MAX_URLS = 1024


def _upstream_url(base: str, target: bytes, qs: bytes) -> httpx.URL:
    key = (base, target, qs)
    url = _URLS.get(key)
    if url is None:
        text = base + target.decode("latin-1") + ("?" + qs.decode("latin-1") if qs else "")
        url = httpx.URL(text)
        if len(_URLS) >= _MAX_URLS:
            _URLS.clear()  # bounded: a client making up targets only loses the cache
        _URLS[key] = url
    return url


class _Watch:
    __slots__ = ("disconnected", "finished")

    def __init__(self) -> None:
        self.disconnected = False
        self.finished = False


async def _watch_disconnect(receive: Receive, task: asyncio.Task[None], state: _Watch) -> None:
    """Cancel the exchange the moment the client goes away (not after it is done)."""
    while True:
        msg = await receive()
        if msg["type"] == "http.disconnect":
            if not state.finished:
                state.disconnected = True
                task.cancel()
            return


def _shape(upstream: Upstream, path: str) -> ErrorShape:
    dialect = upstream.dialect
    return lambda status, message, kind: dialect.error_body(status, message, kind, path)


def _peek_model(body: bytes) -> str | None:
    try:
        obj = json.loads(body)
    except (ValueError, UnicodeDecodeError, RecursionError):
        return None
    if not isinstance(obj, dict):
        return None
    # the first of the engines' model fields present counts (Ollama's older "name")
    model = next((obj[k] for k in MODEL_FIELDS if k in obj), None)
    return model if isinstance(model, str) else None
