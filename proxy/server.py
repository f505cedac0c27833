"""Running the proxy under uvicorn: graceful drain on SIGTERM, optional metrics address.

On the first SIGTERM/SIGINT the proxy stops admitting generation requests (503 with a
clear message, health check 503 so load balancers move on) while in-flight streams
finish, for up to --shutdown-grace seconds; then uvicorn's own shutdown runs. A second
signal exits at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

import uvicorn

from .app import ProxyApp

log = logging.getLogger("phasewatch")


class DrainingServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, app: ProxyApp, grace: float) -> None:
        super().__init__(config)
        self.proxy = app
        self.grace = grace
        self._drain_until: float | None = None

    def handle_exit(self, sig, frame) -> None:
        if self._drain_until is None and self.grace > 0 and not self.should_exit:
            self._captured_signals.append(sig)
            self.proxy.relay.draining = True
            self._drain_until = time.monotonic() + self.grace
            log.info("draining: %d request(s) in flight, new ones get 503, up to %gs",
                     self.proxy.relay.busy(), self.grace)
            return
        super().handle_exit(sig, frame)

    async def on_tick(self, counter: int) -> bool:
        if self._drain_until is not None and not self.should_exit:
            if self.proxy.relay.busy() == 0 or time.monotonic() >= self._drain_until:
                self.should_exit = True
        return await super().on_tick(counter)


class _NoSignals(uvicorn.Server):
    """A second server in the same loop: the main server owns the signals."""

    @contextlib.contextmanager
    def capture_signals(self):
        yield


async def serve(app: ProxyApp, config: uvicorn.Config, metrics_config: uvicorn.Config | None,
                sockets=None) -> None:
    """`sockets`: listening sockets bound by a parent (--workers, proxy.workers)."""
    main = DrainingServer(config, app, app.settings.shutdown_grace)
    if metrics_config is None:
        await main.serve(sockets=sockets)
        return
    metrics = _NoSignals(metrics_config)
    metrics_task = asyncio.create_task(metrics.serve())
    try:
        await main.serve(sockets=sockets)
    finally:
        metrics.should_exit = True
        await metrics_task
