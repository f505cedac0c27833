"""ASGI wiring: the proxy's own routes, the relay for everything else, and lifespan.

A plain ASGI callable rather than a framework router: every request that is not one
of the proxy's own few paths goes straight to the relay without a routing table.
"""

from __future__ import annotations

import logging

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from . import __version__
from .access import Access
from .metrics import Metrics
from .power import PowerService
from .precision import PrecisionTable
from .record import Recorder
from .relay import Relay
from .settings import Settings
from .status import StatusPage, wants_page
from .upstreams import Upstream, Upstreams

log = logging.getLogger("phasewatch")

METRICS_PATH = "/metrics"
HEALTH_PATH = "/phasewatch/health"
DEBUG_PATH = "/phasewatch/debug"


class ProxyApp:
    """The phasewatch proxy as one ASGI application."""

    def __init__(self, settings: Settings, metrics: Metrics | None = None,
                 primary: bool = True) -> None:
        self.settings = settings
        #: The one process per host that runs host-wide side services (the GPU power
        #: sampler): False in all but worker 0 under --workers N (proxy.workers).
        self.primary = primary
        self.metrics = metrics or Metrics()
        engines = settings.pairs("engine")
        overrides = settings.pairs("precision")
        self.upstreams = Upstreams([
            # a precision table per upstream: one model name can be served at different
            # precisions by different engines (the side-by-side comparison the tool is for)
            Upstream(name, url, engine=engines.get(name), metrics=self.metrics,
                     precision=PrecisionTable(overrides, model_dir=settings.model_dir),
                     extra_models=settings.models,
                     max_models=settings.max_models,
                     connect_timeout=settings.connect_timeout,
                     read_timeout=settings.read_timeout,
                     max_concurrency=settings.max_concurrency,
                     max_queue=settings.max_queue, queue_timeout=settings.queue_timeout,
                     client=settings.upstream_client,
                     api_key=settings.upstream_keys().get(name))
            for name, url in settings.upstream_specs()
        ])
        self.recorder = Recorder(self.metrics, settings.log_format)
        # GPU power: a side service sampling on its own thread, hooked into the recorder.
        self.power = PowerService(settings, self.metrics, self.upstreams)
        self.recorder.listeners.append(self.power.on_request)
        # The live status page (/phasewatch/, and / for browsers): proxy.status, fed by the
        # recorder with one point per finished request.
        self.status = StatusPage(self)
        self.recorder.listeners.append(self.status.on_request)
        self.relay = Relay(self.upstreams, self.recorder, inject_usage=settings.inject_usage,
                           max_body_bytes=settings.max_body_bytes,
                           access=Access([k.get_secret_value() for k in settings.api_key],
                                         settings.upstream_keys()))
        #: /metrics on the proxy port, unless it has its own address (then the proxy port
        #: relays /metrics to the engine like any other path).
        self.serve_metrics = settings.metrics_port is None and settings.metrics_host is None

    async def startup(self) -> None:
        await self.upstreams.start(self.settings.model_refresh, self.settings.engine_scrape)
        if self.primary:  # once per host, not per worker: energy must not count N times
            self.power.start()  # after the model lists, so GPU labels name the models
        for u in self.upstreams.all:
            log.info("phasewatch %s relaying to %s = %s (engine %s)", __version__, u.name, u.url,
                     u.engine)

    async def shutdown(self) -> None:
        self.power.stop()
        await self.upstreams.stop()

    async def __call__(self, scope, receive, send) -> None:
        kind = scope["type"]
        if kind == "http":
            path = scope["path"]
            if path == METRICS_PATH and self.serve_metrics and scope["method"] in ("GET", "HEAD"):
                await self._metrics(send)
            elif path == DEBUG_PATH:
                await self._debug(send)
            elif path == HEALTH_PATH:
                if self.relay.draining:
                    await _plain(send, 503, b"draining\n")
                else:
                    await _plain(send, 200, b"ok\n")
            elif self.serve_metrics and wants_page(scope):
                await self.status(scope, receive, send)  # status page (proxy.status)
            else:
                await self.relay(scope, receive, send)
        elif kind == "lifespan":
            await self._lifespan(receive, send)

    async def metrics_app(self, scope, receive, send) -> None:
        """The ASGI app of the separate metrics address (--metrics-host/--metrics-port)."""
        if scope["type"] != "http":
            if scope["type"] == "lifespan":
                while (await receive())["type"] != "lifespan.shutdown":
                    await send({"type": "lifespan.startup.complete"})
                await send({"type": "lifespan.shutdown.complete"})
            return
        if scope["path"] == METRICS_PATH:
            await self._metrics(send)
        elif wants_page(scope):
            await self.status(scope, receive, send)  # status page (proxy.status)
        else:
            await _plain(send, 404, b"only /metrics here\n")

    async def _debug(self, send) -> None:
        """Counts that show leaks: tasks alive and requests in flight (no request data)."""
        import asyncio
        import json

        body = json.dumps({"tasks": len(asyncio.all_tasks()), "busy": self.relay.busy(),
                           "draining": self.relay.draining}).encode()
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"application/json"),
                                (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})

    async def _metrics(self, send) -> None:
        body = generate_latest(self.metrics.exposition)  # all workers' under --workers N
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", CONTENT_TYPE_LATEST.encode()),
                                (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})

    async def _lifespan(self, receive, send) -> None:
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


async def _plain(send, status: int, body: bytes) -> None:
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"text/plain; charset=utf-8"),
                            (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})
