"""The proxy as one ASGI application: a raw dispatcher in front of the relay.

Every request that is not one of phasewatch's own few paths goes straight to the relay
without a routing table (the per-request and per-event costs stay the relay's own).
``/phasewatch/…`` (and ``/`` for browsers) goes to the own API (:mod:`proxy.api`, a
FastAPI app); ``/metrics`` to prometheus-client's exposition, unless the metrics have an
address of their own (then the proxy port relays ``/metrics`` to the engine). Before any
of that, the path is normalised once (:mod:`proxy.core.paths`): what routes, measures and
reaches the engine is one spelling of it. ``OPTIONS *`` and websocket upgrades are
answered here, never relayed.
"""

from __future__ import annotations

import asyncio
import logging
from urllib.parse import quote

from . import __version__
from .api import PREFIX, build_api, wants_page
from .core import Access, Relay
from .core.access import Throttled, peer_of, throttled
from .core.answer import Reply
from .core.asgi import Receive, Scope, Send
from .core.clients import Clients
from .core.errors import send_error
from .core.limited import LimitedLog
from .core.paths import BadPath, normalise
from .core.refusals import Refusal, Refusals
from .engines import ENDPOINT_KINDS
from .fleet import Upstream, Upstreams
from .fleet.host import Host, start_secret
from .measure.exposition import exposition_app
from .measure.metrics import Metrics
from .measure.recorder import Recorder
from .services import engine_state
from .services.power import PowerService
from .services.stall import StallWatch
from .services.status import StatusPage
from .services.tracing import Tracing
from .settings import Settings

log = logging.getLogger(__name__)

METRICS_PATH = "/metrics"
#: What ``OPTIONS *`` answers: every method is relayed.
ALLOW = b"GET, HEAD, POST, PUT, PATCH, DELETE, OPTIONS"


def _upgrade(headers: list[tuple[bytes, bytes]]) -> bytes | None:
    """The protocol a request asks to upgrade to (``Connection: upgrade``), if any."""
    connection = upgrade = None
    for k, v in headers:
        if k == b"connection":
            connection = v.lower()
        elif k == b"upgrade":
            upgrade = v.strip().lower()
    if connection is None or upgrade is None or b"upgrade" not in connection:
        return None
    return upgrade


class ProxyApp:
    """The phasewatch proxy as one ASGI application."""

    def __init__(
        self, settings: Settings, metrics: Metrics | None = None, host: Host | None = None
    ) -> None:
        self.settings = settings
        #: Under --workers N, this worker's place on the host (proxy.runtime.workers): the
        #: primary (worker 0) alone samples power and probes the engines for all of them.
        self.host = host
        self.primary = host is None or host.primary
        self.metrics = metrics or Metrics()
        options = settings.upstream_options()
        self.upstreams = Upstreams(
            [Upstream(spec, options, self.metrics) for spec in settings.upstreams],
            settings.balance_options(start_secret(host)),
        )
        if settings.affinity == "prefix" and settings.affinity_secret is None and self.primary:
            log.info(
                "--affinity prefix: the prompt hash is keyed with a random key made at "
                "start; replicas of phasewatch in front of one pool need a shared "
                "--affinity-secret (PHASEWATCH_AFFINITY_SECRET) to agree"
            )
        # what each endpoint label is, so queries select generations by kind
        for endpoint, kind in ENDPOINT_KINDS.items():
            self.metrics.endpoint_info.labels(endpoint, kind).set(1)
        # what engines say is bounded: label values from the wire, numbers they report
        self.metrics.labels.max_label_length = settings.max_label_length
        self.metrics.labels.warn = LimitedLog(logging.getLogger("proxy.measure.labels")).warning
        self.recorder = Recorder(
            self.metrics,
            access_lines=settings.log_format != "none",
            warn=LimitedLog(logging.getLogger("proxy.measure.recorder")).warning,
        )
        # GPU power: a side service sampling on its own thread, hooked into the recorder.
        self.power = PowerService(settings.power_options(), self.metrics, self.upstreams, host)
        self.recorder.listeners.append(self.power.on_request)
        self.power.access_lines = self.recorder.access_lines
        # The live status page, fed by the recorder with one point per finished request.
        self.status = StatusPage(self.metrics, self.upstreams)
        self.status.energy = self.power.energy
        self.recorder.listeners.append(self.status.on_request)
        # Streams whose output stopped: scanned in the background, rates learnt per request.
        self.stalls = StallWatch(settings.stall_options(), self.metrics, self.upstreams)
        self.recorder.listeners.append(self.stalls.on_request)
        self.access = Access(
            settings.api_keys,
            settings.upstream_keys,
            settings.key_clients,
            secret=start_secret(host),
            page_cookie_ttl=settings.page_cookie_ttl,
            max_key_failures=settings.max_key_failures,
        )
        # OpenTelemetry (--otel): spans opened before the request goes upstream, ended and
        # exported once it is recorded; nothing of it is loaded without the flag.
        self.tracing = (
            Tracing(
                self.metrics,
                __version__,
                min(settings.otel_shutdown_timeout, settings.shutdown_grace),
            )
            if settings.otel
            else None
        )
        if self.tracing is not None:
            self.recorder.sinks.append(self.tracing.finish)
        self.relay = Relay(
            self.upstreams,
            self.recorder,
            settings.relay_options(),
            access=self.access,
            clients=Clients(settings.client_header, settings.clients),
            trace_hook=self.tracing.begin if self.tracing and self.tracing.traces else None,
        )
        self.api = build_api(
            relay=self.relay,
            upstreams=self.upstreams,
            status=self.status,
            access=self.access,
            energy=self.power.energy,
        )
        # rendered on a worker thread: a big registry must not stall the event loop
        self.exposition = exposition_app(self.metrics.exposition)
        self._refusals = Refusals(self.metrics, LimitedLog(log))
        #: /metrics on the proxy port, unless it has its own address.
        self.serve_metrics = settings.metrics_port is None and settings.metrics_host is None

    async def startup(self) -> None:
        """Start the background work; the proxy serves from the first moment, each engine
        is detected and its models read in the background."""
        s = self.settings
        self.upstreams.start(s.model_refresh, self.host)
        # once per host, not per worker: the primary scrapes, the others read its board
        engine_state.start(self.upstreams, self.metrics, s.engine_scrape, self.host)
        if self.primary:
            self.upstreams.spawn(self.power.check_mapping())
        self.stalls.start()
        self.power.start()  # samples in the primary only: energy must not count N times
        for u in self.upstreams.all:
            log.info(
                "phasewatch %s relaying to %s = %s (engine %s)",
                __version__,
                u.name,
                u.url,
                u.engine if u.spec.engine else "detected in the background",
            )

    async def shutdown(self) -> None:
        self.power.stop()
        await self.upstreams.stop()
        if self.tracing is not None:  # exports what is queued: blocking, so on a thread
            await asyncio.to_thread(self.tracing.shutdown)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        kind = scope["type"]
        if kind == "http":
            if not await self._normalised(scope, send):
                return
            path = scope["path"]
            if path.startswith(PREFIX) and (len(path) == len(PREFIX) or path[len(PREFIX)] == "/"):
                await self.api(scope, receive, send)
            elif path == METRICS_PATH and self.serve_metrics and scope["method"] in ("GET", "HEAD"):
                await self.metrics_endpoint(scope, receive, send)
            elif path == "/" and wants_page(scope):
                await self.api(scope, receive, send)
            else:
                await self.relay(scope, receive, send)
        elif kind == "lifespan":
            await self._lifespan(receive, send)
        # no "websocket" scope: the server protocol (proxy.runtime.http1) never switches
        # protocols, so an upgrade request arrives as an HTTP request, answered above

    async def _normalised(self, scope: Scope, send: Send) -> bool:
        """Normalise the path in `scope` once, before anything routes on it; answer
        what is not relayed (a bad path, ``OPTIONS *``, an upgrade) and return False."""
        try:
            raw, path = normalise(scope.get("raw_path") or quote(scope["path"]).encode())
        except BadPath as exc:
            if scope["path"] == "*" and scope["method"] == "OPTIONS":
                # about the proxy itself, not a resource: answered here, never relayed
                await send(
                    {
                        "type": "http.response.start",
                        "status": 200,
                        "headers": [(b"allow", ALLOW), (b"content-length", b"0")],
                    }
                )
                await send({"type": "http.response.body", "body": b""})
                return False
            await self._refuse(send, "bad_path", 400, f"{exc}; not relayed", "invalid_request")
            return False
        if raw != scope.get("raw_path"):
            scope["raw_path"], scope["path"] = raw, path
        if _upgrade(scope["headers"]) == b"websocket":
            await self._refuse(
                send, "upgrade", 501, "phasewatch does not relay websocket upgrades", "unsupported"
            )
            return False
        return True

    async def _refuse(self, send: Send, reason: str, status: int, message: str, kind: str) -> None:
        await self._refusals.refuse(Reply(send), Refusal(status, message, kind, reason))

    async def metrics_endpoint(self, scope: Scope, receive: Receive, send: Send) -> None:
        """/metrics on the proxy port: with proxy keys set it needs one, unless
        --metrics-public (a separate --metrics-port is for Prometheus alone)."""
        peer = peer_of(scope)
        try:
            allowed = self.settings.metrics_public or self.access.allowed(
                scope["headers"], basic=True, peer=peer
            )
        except Throttled as exc:
            refusal = throttled(exc, peer, self.access.guesses.per_minute)
            await self._refusals.refuse(Reply(send), refusal)
            return
        if not allowed:
            await send_error(
                send,
                401,
                "missing or invalid phasewatch API key (or run with "
                "--metrics-public, or --metrics-port for a port of its own)",
                "authentication_error",
                [(b"www-authenticate", b'Bearer realm="phasewatch"')],
            )
            return
        await self.exposition(scope, receive, send)

    async def metrics_app(self, scope: Scope, receive: Receive, send: Send) -> None:
        """The ASGI app of the separate metrics address (--metrics-host/--metrics-port):
        /metrics, and the own API."""
        if scope["type"] != "http":
            if scope["type"] == "lifespan":
                while (await receive())["type"] != "lifespan.shutdown":
                    await send({"type": "lifespan.startup.complete"})
                await send({"type": "lifespan.shutdown.complete"})
            return
        if not await self._normalised(scope, send):
            return
        path = scope["path"]
        if path == METRICS_PATH:
            await self.exposition(scope, receive, send)
        elif path.startswith(PREFIX) or (path == "/" and wants_page(scope)):
            await self.api(scope, receive, send)
        else:
            body = b"only /metrics and /phasewatch/ here\n"
            await send(
                {
                    "type": "http.response.start",
                    "status": 404,
                    "headers": [
                        (b"content-type", b"text/plain; charset=utf-8"),
                        (b"content-length", str(len(body)).encode()),
                    ],
                }
            )
            await send({"type": "http.response.body", "body": body})

    async def _lifespan(self, receive: Receive, send: Send) -> None:
        while True:
            msg = await receive()
            if msg["type"] == "lifespan.startup":
                try:
                    await self.startup()
                except Exception as exc:  # noqa: BLE001 - reported to the server, once
                    await send({"type": "lifespan.startup.failed", "message": str(exc)})
                    return
                await send({"type": "lifespan.startup.complete"})
            elif msg["type"] == "lifespan.shutdown":
                await self.shutdown()
                await send({"type": "lifespan.shutdown.complete"})
                return
