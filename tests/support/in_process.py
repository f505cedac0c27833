"""The proxy in this process, served on loopback exactly as ``phasewatch serve`` serves it.

:class:`InProcessProxy` builds a :class:`~proxy.app.ProxyApp` from :class:`Settings` and
runs it under uvicorn with phasewatch's guarded protocol (``proxy.runtime.server``'s
``uvicorn_config`` and ``guard``) on a port of its own, in a thread with its own event
loop. Clients reach it through a real socket, its upstreams are real servers on loopback
(usually a :class:`~tests.support.fake_engine.FakeEngine`), and the test still holds the
app: its metrics registry, its upstreams and their gates, read or changed on the
server's loop with :meth:`InProcessProxy.call`. Use it where a test needs to look inside;
``servers.start_proxy`` runs the real command line in a subprocess.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Awaitable, Callable
from concurrent.futures import Future
from typing import Any, TypeVar

import httpx

from proxy.app import ProxyApp
from proxy.measure.metrics import Metrics
from proxy.runtime.server import SignalFreeServer, base_url, bind, guard, uvicorn_config
from proxy.settings import Settings

from .servers import wait_for

T = TypeVar("T")

#: Settings that keep the background work from racing a test's requests: no health
#: probes and no engine scrapes (the model list is read once at start).
QUIET = {"health_interval": 0, "engine_scrape": 0, "model_refresh": 3600}


class InProcessProxy:
    """The proxy served on 127.0.0.1, a free port, until :meth:`stop` (a context manager)."""

    def __init__(self, settings: Settings) -> None:
        self.app = ProxyApp(settings)
        self._sock = bind("127.0.0.1", 0)
        self.url = base_url(self._sock)
        config = guard(uvicorn_config(self.app, "127.0.0.1", 0, "warning"), self.app)
        config.load()
        self._server = SignalFreeServer(config)
        self._factory = config.get_loop_factory()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._failed: BaseException | None = None

    @classmethod
    def serving(cls, *upstreams: str, **settings: Any) -> InProcessProxy:
        """A proxy in front of `upstreams` ("name=url"; ``engine=["name=kind"]`` and any
        other setting by its field name), with :data:`QUIET` unless overridden."""
        return cls(Settings(upstream=list(upstreams), **{**QUIET, **settings}))

    @property
    def metrics(self) -> Metrics:
        return self.app.metrics

    def _run(self) -> None:
        try:
            with asyncio.Runner(loop_factory=self._factory) as runner:
                self._loop = runner.get_loop()
                runner.run(self._server.serve(sockets=[self._sock]))
        except BaseException as exc:  # reported to the test by start()
            self._failed = exc

    def start(self) -> InProcessProxy:
        """Serve, and return once every upstream was probed (up or not)."""
        self._thread.start()
        wait_for(
            lambda: self._server.started or self._failed or not self._thread.is_alive(),
            what="the proxy to listen",
        )
        if not self._server.started:
            raise RuntimeError(f"the proxy did not start: {self._failed!r}")
        wait_for(self._probed, what="every upstream to be probed")
        return self

    def _probed(self) -> bool:
        resp = httpx.get(self.url + "/phasewatch/ready", timeout=10)
        return all(u["up"] is not None for u in resp.json()["upstreams"])

    def call(self, work: Callable[[], Awaitable[T]] | Callable[[], T], timeout: float = 10) -> T:
        """Run `work` on the server's loop (a coroutine function is awaited there) and
        return its result: the app's objects belong to that loop."""
        assert self._loop is not None
        loop = self._loop
        done: Future[T] = Future()

        async def run() -> None:
            try:
                got = work()
                if asyncio.iscoroutine(got):
                    got = await got
                done.set_result(got)  # type: ignore[arg-type]
            except BaseException as exc:
                done.set_exception(exc)

        asyncio.run_coroutine_threadsafe(run(), loop)
        return done.result(timeout)

    def stop(self) -> None:
        self._server.should_exit = True
        self._thread.join(30)
        self._sock.close()

    def __enter__(self) -> InProcessProxy:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
