"""Running the proxy under uvicorn: graceful drain on SIGTERM, optional metrics address.

On the first SIGTERM/SIGINT the proxy stops admitting generation requests (503 with a
clear message; readiness 503 so load balancers move on) while in-flight streams finish,
for up to --shutdown-grace seconds; then uvicorn's own shutdown runs. A second signal
exits at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import time
from collections.abc import Iterator
from types import FrameType
from typing import Any

import uvicorn

from ..app import ProxyApp
from .protocol import guarded_protocol

log = logging.getLogger(__name__)


def uvicorn_config(app: Any, host: str, port: int, log_level: str) -> uvicorn.Config:
    """uvicorn as phasewatch runs it: no access log of its own (the proxy logs each
    request), no Server or Date header added to the engine's, logging left to
    proxy.runtime.logs."""
    return uvicorn.Config(
        app,
        host=host,
        port=port,
        log_level=log_level,
        access_log=False,
        server_header=False,
        date_header=False,
        lifespan="on",
        timeout_graceful_shutdown=30,
        log_config=None,
        interface="asgi3",
    )


def guard(config: uvicorn.Config, app: ProxyApp) -> uvicorn.Config:
    """Run `config`'s connections under the guarded protocol (proxy.runtime.protocol):
    the head limit and header deadline hold before any application code runs."""
    s = app.settings
    rejected = app.metrics.rejected_total
    config.http = guarded_protocol(
        s.max_head_bytes, s.header_timeout, lambda reason: rejected.labels(reason).inc()
    )
    return config


class DrainingServer(uvicorn.Server):
    """uvicorn's server, draining in-flight requests on the first signal."""

    def __init__(self, config: uvicorn.Config, app: ProxyApp, grace: float) -> None:
        super().__init__(config)
        self.proxy = app
        self.grace = grace
        self._drain_until: float | None = None

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self._drain_until is None and self.grace > 0 and not self.should_exit:
            self.proxy.relay.draining = True
            self._drain_until = time.monotonic() + self.grace
            log.info(
                "draining: %d request(s) in flight, new ones get 503, up to %gs",
                self.proxy.relay.busy(),
                self.grace,
            )
            return
        super().handle_exit(sig, frame)

    async def on_tick(self, counter: int) -> bool:
        until = self._drain_until
        done = until is not None and (self.proxy.relay.busy() == 0 or time.monotonic() >= until)
        if done and not self.should_exit:
            self.should_exit = True
        return await super().on_tick(counter)


class SignalFreeServer(uvicorn.Server):
    """A server that leaves the signals to someone else (a second server in the same
    loop, the demo's own handlers)."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


async def serve(
    app: ProxyApp,
    config: uvicorn.Config,
    metrics_config: uvicorn.Config | None,
    sockets: list[socket.socket] | None = None,
) -> None:
    """`sockets`: listening sockets bound by a parent (--workers, proxy.runtime.workers)."""
    main = DrainingServer(config, app, app.settings.shutdown_grace)
    if metrics_config is None:
        await main.serve(sockets=sockets)
        return
    metrics = SignalFreeServer(metrics_config)
    metrics_task = asyncio.create_task(metrics.serve())
    try:
        await main.serve(sockets=sockets)
    finally:
        metrics.should_exit = True
        await metrics_task


def metrics_config(app: ProxyApp) -> uvicorn.Config | None:
    """The separate metrics address's server config, when one is set."""
    s = app.settings
    if s.metrics_port is None and s.metrics_host is None:
        return None
    config = uvicorn_config(
        app.metrics_app, s.metrics_host or s.host, s.metrics_port or 0, s.log_level
    )
    config.lifespan = "off"
    return guard(config, app)


def run(
    app: ProxyApp, sockets: list[socket.socket] | None = None, with_metrics: bool = True
) -> None:
    """Serve `app` until it is told to stop (the loop uvicorn would pick: uvloop when
    installed)."""
    s = app.settings
    config = guard(uvicorn_config(app, s.host, s.port, s.log_level), app)
    config.load()
    with asyncio.Runner(loop_factory=config.get_loop_factory()) as runner:
        runner.run(
            serve(app, config, metrics_config(app) if with_metrics else None, sockets=sockets)
        )
