"""Running the proxy under uvicorn: graceful drain on SIGTERM, optional metrics address.

On the first SIGTERM/SIGINT the proxy stops admitting generation requests (503 with a
clear message; readiness 503 so load balancers move on) while in-flight streams finish,
for up to --shutdown-grace seconds; then uvicorn's own shutdown runs. A second signal
exits at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import errno
import gc
import logging
import socket
import time
from collections.abc import Callable, Iterator
from types import FrameType
from typing import Any

import uvicorn

from ..app import ProxyApp
from .http1 import guarded_protocol

log = logging.getLogger(__name__)


def uvicorn_config(app: Any, host: str, port: int, log_level: str) -> uvicorn.Config:
    """uvicorn as phasewatch runs it: no access log of its own (the proxy logs each
    request), no Server or Date header added to the engine's, logging left to
    proxy.runtime.logs, and no X-Forwarded-* rewriting of the client's address and
    scheme (nothing in the proxy reads them, and the headers go to the engine as they
    came; the middleware cost every request a pass over its headers)."""
    return uvicorn.Config(
        app,
        host=host,
        port=port,
        log_level=log_level,
        access_log=False,
        server_header=False,
        date_header=False,
        proxy_headers=False,
        lifespan="on",
        timeout_graceful_shutdown=30,
        log_config=None,
        interface="asgi3",
    )


class ListenError(ValueError):
    """A listening address cannot be bound; the message names the flag."""


def bind(host: str, port: int, flag: str = "--port") -> socket.socket:
    """A socket bound to (host, port), before anything else starts: a port in use is one
    line naming `flag` rather than a server error after the start-up log."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except socket.gaierror as exc:
        sock.close()
        raise ListenError(f"--host: cannot listen on {host!r}: {exc.strerror or exc}") from None
    except OSError as exc:
        sock.close()
        if exc.errno == errno.EADDRINUSE:
            raise ListenError(f"{flag}: {port} is in use") from None
        if exc.errno == errno.EACCES:
            raise ListenError(f"{flag}: listening on {port} needs privileges") from None
        why = exc.strerror or exc
        raise ListenError(f"{flag}: cannot listen on {host}:{port}: {why}") from None
    sock.set_inheritable(True)
    return sock


def base_url(sock: socket.socket) -> str:
    host, port = sock.getsockname()[:2]
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def announce(proxy: socket.socket, metrics: socket.socket | None = None) -> None:
    """One start-up line saying where phasewatch's own pages are (everything else on the
    proxy port is the engine's)."""
    url = base_url(proxy)
    murl = base_url(metrics) if metrics is not None else url
    log.info(
        "phasewatch serving on %s: status page %s/phasewatch/, metrics %s/metrics, "
        "API docs %s/phasewatch/docs, readiness %s/phasewatch/ready",
        url,
        url,
        murl,
        url,
        url,
    )


def guard(config: uvicorn.Config, app: ProxyApp) -> uvicorn.Config:
    """Run `config`'s connections under phasewatch's own HTTP/1.1 protocol
    (proxy.runtime.http1): the wire limits hold before any application code runs."""
    limits = app.settings.server_limits()
    rejected = app.metrics.rejected_total
    config.http = guarded_protocol(
        limits.max_head_bytes,
        limits.header_timeout,
        lambda reason: rejected.labels(reason).inc(),
        max_pipelined_requests=limits.max_pipelined_requests,
        max_pipelined_bytes=limits.max_pipelined_bytes,
        max_stalled_streams=limits.max_stalled_streams,
        max_header_fields=limits.max_header_fields,
    )
    return config


def settle_heap() -> None:
    """Move what start-up built (modules, the app, its metrics) out of the garbage
    collector's sight. Why: a full collection walks every tracked object, and the
    imports alone hold a few hundred thousand that live as long as the process; frozen,
    each collection walks only what requests made."""
    gc.collect()
    gc.freeze()


class DrainingServer(uvicorn.Server):
    """uvicorn's server, draining in-flight requests on the first signal."""

    def __init__(self, config: uvicorn.Config, app: ProxyApp, grace: float) -> None:
        super().__init__(config)
        self.proxy = app
        self.grace = grace
        self._drain_until: float | None = None
        #: Called once the server listens (after the app's start-up).
        self.on_started: Callable[[], None] | None = None

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets=sockets)
        settle_heap()
        if not self.should_exit and self.on_started is not None:
            self.on_started()

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


# uvicorn logs every server's start and stop on one logger, "uvicorn.error", whose level is
# process-wide: a second server in the process would print each lifecycle line again,
# which reads as the proxy starting twice. What a secondary server's task (and the tasks
# it starts, which copy its context) logs is marked by this flag.
_in_secondary = contextvars.ContextVar("phasewatch_in_secondary_server", default=False)


class _QuietSecondary(logging.Filter):
    """Drops a secondary server's info lines; its warnings and errors still show."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno >= logging.WARNING or not _in_secondary.get()


_quiet_secondary = _QuietSecondary()


class SecondaryServer(SignalFreeServer):
    """A server beside the main one (the metrics address, the demo's simulator): signals
    and the start and stop lines are the main server's."""

    async def serve(self, sockets: list[socket.socket] | None = None) -> None:
        logging.getLogger("uvicorn.error").addFilter(_quiet_secondary)  # once: a no-op after
        mark = _in_secondary.set(True)
        try:
            await super().serve(sockets=sockets)
        finally:
            _in_secondary.reset(mark)


async def serve(
    app: ProxyApp,
    config: uvicorn.Config,
    metrics_config: uvicorn.Config | None,
    sockets: list[socket.socket],
    metrics_sockets: list[socket.socket] | None = None,
    announce_start: bool = True,
) -> None:
    """Serve on `sockets` (bound by :func:`bind`, here or in a parent under --workers),
    and the metrics address on `metrics_sockets` when it has one of its own."""
    main = DrainingServer(config, app, app.settings.shutdown_grace)
    metrics = SecondaryServer(metrics_config) if metrics_config is not None else None
    metrics_task = (
        asyncio.create_task(metrics.serve(sockets=metrics_sockets)) if metrics is not None else None
    )
    if announce_start:
        msock = metrics_sockets[0] if metrics_sockets else None
        main.on_started = lambda: announce(sockets[0], msock)
    try:
        await main.serve(sockets=sockets)
    finally:
        if metrics is not None and metrics_task is not None:
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


def bind_all(settings: Any) -> tuple[socket.socket, socket.socket | None]:
    """The proxy's socket and the metrics address's (when it has one), bound now."""
    sock = bind(settings.host, settings.port)
    if settings.metrics_port is None and settings.metrics_host is None:
        return sock, None
    try:
        msock = bind(
            settings.metrics_host or settings.host, settings.metrics_port or 0, "--metrics-port"
        )
    except ListenError:
        sock.close()
        raise
    return sock, msock


def run(
    app: ProxyApp,
    sockets: list[socket.socket],
    metrics_sockets: list[socket.socket] | None = None,
    announce_start: bool = True,
) -> None:
    """Serve `app` until it is told to stop (the loop uvicorn would pick: uvloop when
    installed). The metrics address is served when `metrics_sockets` are given."""
    s = app.settings
    config = guard(uvicorn_config(app, s.host, s.port, s.log_level), app)
    config.load()
    mconfig = metrics_config(app) if metrics_sockets else None
    with asyncio.Runner(loop_factory=config.get_loop_factory()) as runner:
        runner.run(serve(app, config, mconfig, sockets, metrics_sockets, announce_start))
