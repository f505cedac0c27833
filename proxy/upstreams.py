"""Upstream engines: where a request goes, its dialect, its admission gate, its models.

One pooled keep-alive ``httpx.AsyncClient`` per upstream. The model list is refreshed in
the background and bounds the `model` label: names the upstream does not list (or the
operator did not configure) are labelled ``other``.
"""

from __future__ import annotations

import asyncio
import collections
import logging

import httpx

from . import detect
from .dialects import get_dialect
from .engine_gauges import EngineGauges
from .metrics import Metrics
from .precision import Precision, PrecisionTable
from .upstream_client import LeanTransport

log = logging.getLogger("phasewatch")

OTHER = "other"


class QueueFull(Exception):
    """The admission queue is at its bound: answer 429."""


class QueueTimeout(Exception):
    """A request waited longer than queue_timeout: answer 503."""


class AdmissionGate:
    """At most `limit` requests in flight; up to `max_queue` more wait in FIFO order.

    With limit 0 the gate admits everything at once (t_admit = t_recv).
    """

    def __init__(self, limit: int, max_queue: int, timeout: float) -> None:
        self.limit = limit
        self.max_queue = max_queue
        self.timeout = timeout
        self.active = 0
        self._waiters: collections.deque[asyncio.Future] = collections.deque()

    @property
    def queued(self) -> int:
        return len(self._waiters)

    async def acquire(self) -> None:
        if self.limit <= 0 or (self.active < self.limit and not self._waiters):
            self.active += 1
            return
        if len(self._waiters) >= self.max_queue:
            raise QueueFull()
        fut = asyncio.get_running_loop().create_future()
        self._waiters.append(fut)
        try:
            if self.timeout > 0:
                await asyncio.wait_for(asyncio.shield(fut), self.timeout)
            else:
                await fut
        except (asyncio.TimeoutError, asyncio.CancelledError) as exc:
            if fut.done() and not fut.cancelled():  # admitted while giving up: pass it on
                self._release_slot()
            else:
                fut.cancel()
                try:
                    self._waiters.remove(fut)
                except ValueError:
                    pass
            if isinstance(exc, asyncio.TimeoutError):
                raise QueueTimeout() from None
            raise

    def release(self) -> None:
        if self.limit <= 0:
            self.active -= 1
            return
        self._release_slot()

    def _release_slot(self) -> None:
        while self._waiters:
            fut = self._waiters.popleft()
            if not fut.done():
                fut.set_result(None)  # the slot passes straight to the next waiter
                return
        self.active -= 1


class Upstream:
    """One engine behind the proxy."""

    def __init__(self, name: str, url: str, *, engine: str | None, metrics: Metrics,
                 precision: PrecisionTable, extra_models: list[str], max_models: int,
                 connect_timeout: float, read_timeout: float, max_concurrency: int,
                 max_queue: int, queue_timeout: float, client: str = "lean",
                 api_key: str | None = None) -> None:
        self.name = name
        self.url = url
        self.engine_override = engine
        self.engine = engine or "vllm"  # until detected (proxy.detect)
        self.dialect = get_dialect(self.engine)
        self.precision_read: set[str] = set()  # models whose precision the engine was asked
        self.metrics = metrics
        self.precision = precision
        self.max_models = max_models
        self.configured_models = set(extra_models)
        self.models: set[str] = set()
        self.up = False
        self.gate = AdmissionGate(max_concurrency, max_queue, queue_timeout)
        self.client = httpx.AsyncClient(
            base_url=url,
            timeout=httpx.Timeout(connect=connect_timeout, read=read_timeout,
                                  write=read_timeout, pool=None),
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=256,
                                keepalive_expiry=60.0),
            follow_redirects=False,
            trust_env=False,
            # the engine key also goes with the proxy's own calls (model lists, detection,
            # gauge scrapes), so an engine that requires one is not taken for down
            headers={"authorization": f"Bearer {api_key}"} if api_key else None,
            # The lean transport (proxy.upstream_client) keeps httpx's API but costs a
            # fraction per streamed chunk; limits above apply to httpx's own transport.
            transport=LeanTransport(max_keepalive=256, keepalive_expiry=60.0)
            if client == "lean" else None,
        )
        self._label_cache: dict[str, str] = {}
        #: Exchanges admitted and not finished. Side services (the power sampler) read it
        #: from their own thread to classify the GPU's state: a request with no first
        #: token yet is in prefill, one with a first token is decoding.
        self.active: set = set()

    # --- labels ---------------------------------------------------------------------

    def model_label(self, model: str | None) -> str:
        """The bounded `model` label for a client-supplied model name."""
        if model is None:
            return next(iter(self.models)) if len(self.models) == 1 else OTHER
        label = self._label_cache.get(model)
        if label is None:
            label = self.canonical(model)
            if label is None and self.engine == "llamacpp" and len(self.models) == 1:
                label = next(iter(self.models))  # llama-server answers any name with its model
            label = label or OTHER
            if len(self._label_cache) < 4096:
                self._label_cache[model] = label
        return label

    def precision_of(self, model_label: str) -> Precision:
        if model_label == OTHER:
            return Precision.unknown()
        return self.precision.get(model_label)

    def canonical(self, model: str) -> str | None:
        """The listed name a request's model means (Ollama: ``llama3.2`` is
        ``llama3.2:latest``), or None when the upstream does not list it."""
        if model in self.models or model in self.configured_models:
            return model
        if self.engine == "ollama" and ":" not in model and model + ":latest" in self.models:
            return model + ":latest"
        return None

    def serves(self, model: str | None) -> bool:
        return model is not None and self.canonical(model) is not None

    def set_engine(self, engine: str) -> None:
        if engine != self.engine:
            try:
                self.metrics.upstream_up.remove(self.name, self.engine)
            except KeyError:
                pass
            self.engine = engine
            self.dialect = get_dialect(engine)
            self._label_cache.clear()

    # --- model list -------------------------------------------------------------------

    async def refresh(self) -> None:
        """Read the engine's model list; keeps the old list when the engine is down. The
        engine is (re)detected when the upstream was down (or at start)."""
        if self.engine_override is None and not self.up:
            engine = await detect.detect_engine(self.client)
            if engine is not None:
                self.set_engine(engine)
        names = await detect.list_models(self)  # reads each new model's precision too
        if names is None:
            if self.up:
                log.warning("upstream %s (%s) is not answering its model list", self.name, self.url)
            self.up = False
            self.metrics.upstream_up.labels(self.name, self.engine).set(0)
            return
        self.precision_read &= set(names)  # a model that comes back is read again
        if not self.up:
            log.info("upstream %s (%s) is up, engine=%s, models=%s", self.name, self.url,
                     self.engine, ",".join(names) or "-")
        self.up = True
        self.metrics.upstream_up.labels(self.name, self.engine).set(1)
        new = set(names)
        if new != self.models:
            self.models = new
            self._label_cache.clear()
            self.publish_models()

    def publish_models(self) -> None:
        for model in sorted(self.models | self.configured_models):
            p = self.precision.get(model)
            self.metrics.model_info.labels(self.name, model, p.precision, p.quant, p.source).set(1)

    async def refresh_forever(self, interval: float) -> None:
        while True:
            await asyncio.sleep(interval)
            await self.refresh()

    async def aclose(self) -> None:
        await self.client.aclose()


class Upstreams:
    """All upstreams, and routing by model."""

    def __init__(self, upstreams: list[Upstream]) -> None:
        if not upstreams:
            raise ValueError("at least one upstream is needed")
        self.all = upstreams
        self._tasks: list[asyncio.Task] = []

    def route(self, model: str | None) -> Upstream:
        """The upstream serving `model`; the first one when none lists it."""
        if len(self.all) > 1 and model is not None:
            for u in self.all:
                if u.serves(model):
                    return u
        return self.all[0]

    async def start(self, refresh_interval: float, scrape_interval: float = 0.0) -> None:
        await asyncio.gather(*(u.refresh() for u in self.all))
        for u in self.all:
            u.publish_models()
            self._tasks.append(asyncio.create_task(u.refresh_forever(refresh_interval)))
            if scrape_interval > 0:  # the engines' own gauges, off the request path
                gauges = EngineGauges(u, u.metrics)
                self._tasks.append(asyncio.create_task(gauges.run_forever(scrape_interval)))

    async def stop(self) -> None:
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await asyncio.gather(*(u.aclose() for u in self.all), return_exceptions=True)
