"""The relay: moves a request to its upstream and the response back, byte for byte.

Every method and path is forwarded. Generation endpoints (as the upstream's engine
names them) are also measured: the engine's tap watches the response on its way
through. A client that hangs up cancels the exchange at once, which closes the upstream
connection so the engine stops generating.

A request's life, one step per module: its body read within the budget (``budget``),
its route (``routing``), a refusal where it cannot go on (``refusals``), a measured
request's place at its upstream's gate (``admission``), the upstream call with its
failures mapped and its retries to the pool's other members (``upstream_call``), the
response relayed, the final send and the client watched (``answer``), and
its record (:mod:`proxy.measure.recorder`, which counts every error kind).
"""

from __future__ import annotations

import logging
import secrets
import time
from collections.abc import Callable

import httpx

from ..engines import Prepared
from ..extensions import CLIENT_OUT
from ..fleet.gate import QueueFull, QueueTimeout
from ..fleet.upstream import Upstream
from ..fleet.upstreams import Upstreams
from ..measure.recorder import Recorder
from ..measure.timeline import Marks
from . import catalog
from .access import CLIENT_SCOPE, Access, Throttled, peer_of, throttled
from .admission import Admitted, queue_refusal
from .answer import Reply, Responder, relay
from .asgi import Receive, Scope, Send
from .budget import Body, BodyBudget, ClientGone, OverBudget, Stalled, TooLarge
from .clients import Clients
from .errors import ErrorShape, UpstreamFailure, describe
from .exchange import Exchange
from .headers import (
    IDENTITY,
    Headers,
    content_length,
    looped,
    request_id,
    response_headers,
    via,
)
from .limited import LimitedLog
from .peek import reduced
from .pipe import Pipe
from .refusals import RETRY_AFTER, Refusal, Refusals, Refused
from .relay_options import RelayOptions
from .routing import Route, Router
from .upstream_call import UpstreamCall

log = logging.getLogger(__name__)

#: Called once per measured request before it goes upstream (the tracing side service):
#: it may set the exchange's trace id, span handle and trace context headers.
TraceHook = Callable[[Exchange, Headers], None]

UNAUTHENTICATED = Refusal(
    401,
    "missing or invalid phasewatch API key (send Authorization: Bearer KEY or x-api-key: KEY)",
    "authentication_error",
    headers=((b"www-authenticate", b'Bearer realm="phasewatch"'),),
    counted=False,
    quiet=True,
)
#: A request that came back to the proxy that sent it (its Via names this proxy).
LOOP = Refusal(
    508,
    "loop detected: this request was sent by this phasewatch and came back to it (its Via "
    "header names this proxy): an upstream leads back to the proxy; check --upstream",
    "loop_detected",
    reason="loop",
)
#: After SIGTERM: in-flight requests finish, new measured ones are refused.
DRAINING = Refusal(503, "phasewatch is shutting down", "unavailable", quiet=True)


class Relay:
    """ASGI app forwarding everything to the upstreams (measuring generation)."""

    def __init__(
        self,
        upstreams: Upstreams,
        recorder: Recorder,
        options: RelayOptions | None = None,
        *,
        access: Access | None = None,
        clients: Clients | None = None,
        trace_hook: TraceHook | None = None,
    ) -> None:
        self.upstreams = upstreams
        self.recorder = recorder
        self.options = options = options or RelayOptions()
        self.access = access or Access([], {})
        self.clients = clients or Clients()
        self.trace_hook = trace_hook
        #: Request bodies held at once, over every request of this process.
        self.bodies = BodyBudget(options.max_body_memory or 4 * options.max_body_bytes)
        #: Set on SIGTERM: new generation requests get 503 while in-flight ones finish.
        self.draining = False
        # the steps of a request's life; their lines all come from this module's logger
        limited_log = LimitedLog(log)
        self.router = Router(upstreams, options.admin_api)
        self.refusals = Refusals(recorder.metrics, limited_log)
        #: The Via field this process adds upstream, and checks on arrival: a loop is
        #: cut at once (a random name per process: a loop through the workers of one
        #: proxy ends after at most one pass through each).
        self.via = via(secrets.token_hex(6))
        self.call = UpstreamCall(self.access, limited_log, self.via)
        self.responder = Responder(log, limited_log, options)

    def busy(self) -> int:
        """Generation requests in flight or queued, over all upstreams."""
        return sum(len(u.active) + u.gate.queued for u in self.upstreams.all)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        headers = scope["headers"]
        if looped(headers, self.via[1]):
            await self.refusals.refuse(Reply(send), LOOP)
            return
        try:
            key_client = self.access.client(headers, peer=peer_of(scope))
        except Throttled as exc:
            refusal = throttled(exc, peer_of(scope), self.access.guesses.per_minute)
            await self.refusals.refuse(Reply(send), refusal)
            return
        if key_client is None:
            await self.refusals.refuse(Reply(send), UNAUTHENTICATED)
            return
        if key_client:
            scope[CLIENT_SCOPE] = key_client  # who holds it, for the server's fair limits
        held = Body(self.bodies)
        try:
            # the body is passed on, not kept here: once prepared, only one copy lives
            await self._route(
                scope,
                receive,
                send,
                await held.read(
                    receive,
                    self.options.max_body_bytes,
                    content_length(headers),
                    self.options.body_timeout,
                ),
                key_client,
            )
        except ClientGone:
            return
        except (TooLarge, Stalled, OverBudget) as exc:
            await self.refusals.refuse(Reply(send), self._body_refusal(exc))
        finally:
            held.release()

    def _body_refusal(self, exc: TooLarge | Stalled | OverBudget) -> Refusal:
        if isinstance(exc, TooLarge):
            return Refusal(
                413,
                f"request body over {self.options.max_body_bytes} bytes",
                "request_too_large",
                "body_too_large",
            )
        if isinstance(exc, Stalled):
            return Refusal(
                408,
                f"no byte of the request body arrived for {self.options.body_timeout:g}s",
                "request_timeout",
                "body_timeout",
            )
        return Refusal(
            503,
            f"request bodies in memory are at --max-body-memory ({self.bodies.limit} "
            "bytes); retry later",
            "unavailable",
            "body_memory",
            headers=RETRY_AFTER,
        )

    async def _route(
        self, scope: Scope, receive: Receive, send: Send, body: bytes, key_client: str
    ) -> None:
        """Route the request, then relay it measured or as it is; `key_client` is the
        client a named proxy key names ("" when none does)."""
        t_recv = time.monotonic()
        method = scope["method"]
        path = scope["path"]
        # what routing and prepare parse: a large body's bounded reduction (core.peek)
        view = await reduced(body) if method == "POST" else body
        try:
            route = await self.router.route(method, path, view, key_client)
        except Refused as exc:
            await self.refusals.refuse(Reply(send), exc.refusal)
            return
        if route is None:  # a model list: every upstream's, merged
            await catalog.send_union(send, self.upstreams, path)
            return
        dialect = route.upstream.dialect
        endpoint = dialect.endpoint(method, path)
        # a dialect may also decline (an Ollama model load is not a generation)
        prepared = (
            dialect.prepare(
                endpoint, body, self.options.inject_usage, None if view is body else view
            )
            if endpoint
            else None
        )
        if prepared is None:
            await self._passthrough(scope, send, route, body)
            return
        del body, view  # only the prepared body is kept from here on
        ex = self._exchange_of(scope["headers"], route.upstream, prepared, t_recv, key_client)
        ex.owner = "key:" + key_client if key_client else "address:" + (peer_of(scope) or "")
        await self._measured(scope, send, ex, route)

    def _exchange_of(
        self,
        headers: Headers,
        upstream: Upstream,
        prepared: Prepared,
        t_recv: float,
        key_client: str,
    ) -> Exchange:
        """A measured request's exchange, labelled, its trace begun (with --otel)."""
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
        return ex

    # --- unmeasured paths -----------------------------------------------------------

    async def _passthrough(self, scope: Scope, send: Send, route: Route, body: bytes) -> None:
        """Relay an unmeasured request as it is."""
        reply = Reply(send, out=(scope.get("extensions") or {}).get(CLIENT_OUT))
        resp = None
        async with reply.watching():
            try:
                resp = await self.call.open_route(route, scope, body)
                await send(
                    {
                        "type": "http.response.start",
                        "status": resp.status_code,
                        "headers": response_headers(resp.headers.raw),
                    }
                )
                assert reply.out is not None  # (watched)
                pipe = Pipe(resp, reply.out)
                await relay(reply, pipe, pipe.kept(0))
                await reply.end()
                if resp.status_code < 400:
                    route.upstream.succeeded()
            except UpstreamFailure as exc:
                shape = _shape(route.upstream, scope["path"])
                await reply.error(exc.status, exc.message, exc.kind, shape=shape)
            except httpx.HTTPError as exc:  # mid-body: end the connection, the client sees it cut
                log.warning(
                    "upstream %s failed mid-response on %s: %s",
                    route.upstream.name,
                    scope["path"][:200],
                    describe(exc),
                )
            finally:
                reply.unwatch()
                if resp is not None:
                    await resp.aclose()

    # --- measured generation ----------------------------------------------------------

    async def _measured(self, scope: Scope, send: Send, ex: Exchange, route: Route) -> None:
        """Admit, send and relay one measured request, then record it."""
        reply = Reply(send, self._echo(ex), (scope.get("extensions") or {}).get(CLIENT_OUT))
        admitted = Admitted(self.recorder.metrics, ex)
        try:
            async with reply.watching():
                if self.draining:
                    await self.refusals.refuse(reply, DRAINING, ex)
                    return
                try:
                    async with admitted:
                        await self._exchange(scope, reply, ex, route, admitted)
                except (QueueFull, QueueTimeout) as exc:
                    await self.refusals.refuse(reply, queue_refusal(ex.upstream, exc), ex)
            if reply.disconnected:
                self._left(ex)
        finally:
            ex.marks.t_end = time.monotonic()
            if ex.outcome == "ok" and ex.marks.t_admit is not None:
                ex.upstream.observe(ex.marks.t_end - ex.marks.t_admit)  # least-loaded's rate
                if ex.status < 400:
                    ex.upstream.succeeded()  # real traffic, whole: the member is well
            self.recorder.record(ex)

    async def _exchange(
        self, scope: Scope, reply: Reply, ex: Exchange, route: Route, admitted: Admitted
    ) -> None:
        """Send the admitted request and relay the answer. The route's other members are
        tried in order while the request could not be sent (no byte of it reached the
        engine), its admission moving with it; a request that was sent is never sent
        again."""
        extra = ex.trace_headers
        if ex.prepared.strip_usage:
            # what phasewatch adds must be removable: ask for an answer it can strip
            # (the client's Accept-Encoding is replaced, this one case only)
            extra = [*(extra or ()), IDENTITY]
        resp = None
        try:
            resp = await self.call.open_route(
                route, scope, ex.prepared.body, ex.marks, extra, admitted.move, ex.prepared.tail
            )
            await self.responder.respond(reply, resp, ex)
        except UpstreamFailure as exc:
            ex.fail(exc.kind, exc.message, exc.status)
            shape = _shape(ex.upstream, scope["path"])
            await reply.error(exc.status, exc.message, exc.kind, shape=shape)
        finally:
            reply.unwatch()  # closing the upstream's answer is not cancelled by the client
            if resp is not None:
                await resp.aclose()

    def _left(self, ex: Exchange) -> None:
        """The client hung up before its answer was finished."""
        if ex.tap is not None and ex.tap.done:
            # the client had the whole answer (its terminator included) and left
            # before the upstream closed: that is a complete request, not an abort
            self.responder.settle(ex, None)
        else:
            ex.outcome = "aborted"
            ex.abort_phase = ex.abort_phase_now()

    def _echo(self, ex: Exchange) -> Headers:
        """The x-request-id response header, with --echo-request-id."""
        if not self.options.echo_request_id:
            return []
        return [(b"x-request-id", ex.request_id.encode("latin-1"))]


def _shape(upstream: Upstream, path: str) -> ErrorShape:
    """The upstream's engine's own error shape for `path`."""
    dialect = upstream.dialect
    return lambda status, message, kind: dialect.error_body(status, message, kind, path)
