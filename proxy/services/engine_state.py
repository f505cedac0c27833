"""The engines' own state, scraped off the request path and re-exported under phasewatch
names with phasewatch's `upstream` / `model` / `precision` labels.

What each engine exposes about state the proxy cannot see per request (running and
waiting requests, KV-cache use and size, loaded models) is read by its engine module
(:meth:`proxy.engines.base.Dialect.read_state`). Gauges go to the phasewatch_engine_*
gauges; the engine's own counters and histograms (vLLM's preemptions, its TTFT and
end-to-end histograms) are re-exported as scraped by
:class:`proxy.measure.engine_series.EngineSeries`; the element type the engine keeps a model's
KV cache in goes to the upstream (its KV bytes per token). A scrape that fails leaves
everything as it was and sets ``phasewatch_engine_scrape_up`` to 0; series of models that
went away are removed.

Under ``--workers N`` the primary scrapes and writes the re-exported series to a board
the other workers load, so whichever worker answers /metrics serves them.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import httpx
from prometheus_client import Gauge

from ..engines.probe import read_bounded
from ..engines.prometheus import parse_prometheus
from ..fleet.host import Board, Host
from ..fleet.supervisor import every

if TYPE_CHECKING:
    from ..engines import EngineReading
    from ..fleet.upstream import Upstream
    from ..fleet.upstreams import Upstreams
    from ..measure.metrics import Metrics

log = logging.getLogger(__name__)

BOARD = "engine-series.json"


class EngineGauges:
    """Scrapes one upstream's state and sets the phasewatch_engine_* series."""

    def __init__(self, upstream: Upstream, metrics: Metrics) -> None:
        self.u = upstream
        self.m = metrics
        self._series: set[tuple[str, tuple[str, str, str]]] = set()
        self.gauges: dict[str, Gauge] = {
            "running": metrics.engine_requests_running,
            "waiting": metrics.engine_requests_waiting,
            "kv": metrics.engine_kv_cache_usage_ratio,
            "kv_capacity": metrics.engine_kv_cache_capacity_tokens,
            "slots": metrics.engine_slots,
            "loaded": metrics.engine_model_loaded,
            "vram": metrics.engine_model_vram_bytes,
            "size": metrics.engine_model_size_bytes,
            "expiry": metrics.engine_model_expiry_seconds,
        }

    async def read(self) -> EngineReading | None:
        return await self.u.dialect.read_state(self.u.client, self.u.models)

    def _base(self, model: str) -> tuple[str, str, str]:
        label = self.u.model_label(model or None)
        return (self.u.name, label, self.u.precision_of(label).precision)

    async def scrape(self) -> bool:
        """One scrape; False when the engine's state could not be read."""
        if not self.u.up:
            return False
        try:
            reading = await self.read()
        except (httpx.HTTPError, ValueError, RecursionError):  # TooLarge is a ValueError
            reading = None
        self.m.engine_scrape_up.labels(self.u.name, self.u.engine).set(
            1 if reading is not None else 0
        )
        if reading is None:
            self.u.engine_load = (None, None, None)
            return False
        self.u.engine_load = load_of(reading)
        seen = set()
        for model, values in reading.gauges.items():
            base = self._base(model)
            for key, value in values.items():
                gauge = self.gauges.get(key)
                if gauge is None:
                    continue
                gauge.labels(*base).set(value)
                seen.add((key, base))
        for key, base in self._series - seen:  # models that went away (unloaded)
            try:
                self.gauges[key].remove(*base)
            except KeyError:
                pass
        self._series = seen
        series: dict[tuple[str, str], tuple[dict[str, float], dict[str, tuple]]] = {}
        for model in set(reading.counters) | set(reading.histograms):
            _, label, precision = self._base(model)
            if label == "other":  # a model the upstream does not list: not re-exported
                continue
            hists = {
                k: (h.buckets, h.sum, h.count) for k, h in reading.histograms.get(model, {}).items()
            }
            series[(label, precision)] = (dict(reading.counters.get(model, {})), hists)
        self.m.engine_series.set(self.u.name, series)
        for model, dtype in reading.kv_dtype.items():
            label = self.u.model_label(model or None)
            if label != "other":
                self.u.set_kv_dtype(label, dtype)
        return True


def load_of(reading: EngineReading) -> tuple[float | None, float | None, float | None]:
    """The engine's running and waiting requests (summed over its models) and its
    KV-cache use (the fullest model's), for the balancer; None where it does not say."""
    values = list(reading.gauges.values())

    def total(key: str) -> float | None:
        found = [v[key] for v in values if key in v]
        return sum(found) if found else None

    kv = [v["kv"] for v in values if "kv" in v]
    return total("running"), total("waiting"), (max(kv) if kv else None)


def start(
    upstreams: Upstreams, metrics: Metrics, interval: float, host: Host | None = None
) -> None:
    """Scrape every upstream's state every `interval` seconds (0: never). Under --workers
    N the primary scrapes and the others follow its board."""
    if interval <= 0:
        return
    board = Board(host.path(BOARD)) if host is not None else None
    if host is not None and not host.primary:
        assert board is not None

        async def follow() -> None:
            doc = board.read_if_changed()
            if doc is not None:
                metrics.engine_series.load(doc)

        upstreams.spawn(every(min(1.0, interval), follow, "reading the primary's engine series"))
        return
    for u in upstreams.all:
        gauges = EngineGauges(u, metrics)

        async def scrape(gauges: EngineGauges = gauges) -> None:
            await gauges.scrape()
            if board is not None:
                board.write(metrics.engine_series.snapshot())

        upstreams.spawn(
            every(
                interval,
                scrape,
                f"engine state scrape of upstream {u.name}",
                first_delay=min(1.0, interval),
            )
        )


#: The fastest the engines' own counts are read for the energy ledger (s): every read
#: costs the engine a /metrics or /slots answer, and its CPU matters more than ours.
COUNT_FLOOR = 0.1
#: The slowest (s), whatever the sensor's step.
COUNT_CEILING = 1.0
#: A count older than this (s) is not used: the ledger falls back to its own in flight.
COUNT_STALE = 2.0


class EngineCounts:
    """Each upstream's own count of the requests it holds (running + waiting, per model):
    the dialect's busy gauges on the engine's /metrics, else its
    :meth:`~proxy.engines.base.Dialect.read_state` (llama-server's /slots), read as often
    as the GPU's energy sensor steps, so the energy ledger divides each step among everything the
    engine ran, not only what this host relayed (:mod:`proxy.services.power.ledger`).

    Read by the process that samples power only; the ticks carry what it read to the other
    workers. An engine that gives no count (Ollama, a generic OpenAI server) is said once:
    its GPU's energy is then divided as if phasewatch relayed every request it runs.
    """

    def __init__(
        self,
        metrics: Metrics,
        period: Callable[[], float | None],
        wanted: Callable[[], bool] = lambda: True,
    ) -> None:
        self.m = metrics
        self.period = period  # the sensor's step (s), None while not learnt
        self.wanted = wanted  # False while power is not sampled: nothing is read
        #: upstream name -> (monotonic times the read was sent and answered, {model:
        #: requests held}): the engine counted somewhere between the two
        self.counts: dict[str, tuple[float, float, dict[str, float]]] = {}
        self.uncounted: set[str] = set()  # upstreams whose engine gives no count
        self._whole: set[str] = set()  # upstreams read with the dialect's whole read
        self.reads = 0
        self.read_seconds = 0.0  # the proxy's wall time spent reading, for the cost

    def interval(self) -> float:
        p = self.period()
        return min(COUNT_CEILING, max(COUNT_FLOOR, p if p is not None else COUNT_FLOOR))

    async def read(self, u: Upstream) -> None:
        """One read of `u`'s count (nothing while it is not up, or power not sampled)."""
        if not u.up or not self.wanted():
            return
        t0 = time.monotonic()
        try:
            counts = await self._busy(u)
            reading = None
            if counts is None:
                reading = await u.dialect.read_state(u.client, u.models)
                counts = {
                    model: g["running"] + g.get("waiting", 0.0)
                    for model, g in (reading.gauges.items() if reading is not None else ())
                    if "running" in g
                }
        except (httpx.HTTPError, ValueError, RecursionError):
            counts, reading = {}, None
        t1 = time.monotonic()
        self.reads += 1
        self.read_seconds += t1 - t0
        gives_none = not counts and (reading is not None or not u.dialect.busy_gauges)
        if gives_none and u.name not in self.uncounted:
            self.uncounted.add(u.name)
            log.info(
                "upstream %s (%s) gives no count of the requests it runs: its GPU energy "
                "is divided among the requests phasewatch relays, assuming it relays every "
                "request the GPU runs",
                u.name,
                u.engine,
            )
        if counts or gives_none:  # a read that failed leaves it as it was
            self.m.power_engine_count_up.labels(u.name).set(1 if counts else 0)
        if counts:
            self.uncounted.discard(u.name)
            self.counts[u.name] = (t0, t1, counts)

    async def _busy(self, u: Upstream) -> dict[str, float] | None:
        """The dialect's busy gauges (running, then waiting) from the engine's /metrics,
        only their lines parsed (a whole vLLM page, parsed at the sensor's rate, would
        cost the proxy much more: docs/performance.md); the names are asked for too,
        which an exporter serving prometheus_client's app honours. None where /metrics
        has none of them (llama-server without --metrics): the dialect's whole read
        serves."""
        busy = u.dialect.busy_gauges
        if not busy or u.name in self._whole:
            return None
        query = "&".join(f"name[]={name}" for name in busy)
        status, body = await read_bounded(u.client, "GET", "/metrics?" + query)
        if status == 200:
            text = body.decode("utf-8", "replace")
            lines = [ln for ln in text.splitlines() if ln.startswith(busy)]
            names = dict(zip(busy, ("running", "waiting"), strict=False))
            only = next(iter(u.models)) if len(u.models) == 1 else None
            gauges = parse_prometheus("\n".join(lines) + "\n", names, only)
            counts = {
                model: g["running"] + g.get("waiting", 0.0)
                for model, g in gauges.items()
                if "running" in g
            }
            if counts:
                return counts
        self._whole.add(u.name)
        return None

    def of(self, u: Upstream, model: str | None) -> tuple[float, float, float] | None:
        """What `u`'s engine holds (for `model`, or all of it), and when the read was
        sent and answered (monotonic); None when not known."""
        got = self.counts.get(u.name)
        if got is None or time.monotonic() - got[1] > COUNT_STALE:
            return None
        t0, t1, counts = got
        if model is None or set(counts) == {""}:
            return sum(counts.values()), t0, t1
        n = sum(v for m, v in counts.items() if m == model or u.model_label(m) == model)
        return n, t0, t1

    def start(self, upstreams: Upstreams) -> list[asyncio.Task[None]]:
        """One reading loop per upstream; the tasks (cancelled by the caller)."""

        def loop(u: Upstream) -> asyncio.Task[None]:
            return asyncio.create_task(
                every(
                    COUNT_FLOOR,
                    lambda: self.read(u),
                    f"reading upstream {u.name}'s count of running requests",
                    next_delay=self.interval,
                )
            )

        return [loop(u) for u in upstreams.all]
