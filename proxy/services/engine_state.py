"""The engines' own gauges, scraped off the request path and re-exported under phasewatch
names with phasewatch's `upstream` / `model` / `precision` labels.

What each engine exposes about state the proxy cannot see per request (running and
waiting requests, KV-cache use, loaded models) is read by its engine module
(:meth:`proxy.engines.base.Dialect.read_state`). A scrape that fails leaves the gauges as
they were and sets ``phasewatch_engine_scrape_up`` to 0; series of models that went away
are removed.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import httpx
from prometheus_client import Gauge

from ..core.supervisor import every

if TYPE_CHECKING:
    from ..core.upstreams import Upstream, Upstreams
    from ..engines import EngineState
    from ..measure.metrics import Metrics

log = logging.getLogger(__name__)


class EngineGauges:
    """Scrapes one upstream's state and sets the phasewatch_engine_* gauges."""

    def __init__(self, upstream: Upstream, metrics: Metrics) -> None:
        self.u = upstream
        self.m = metrics
        self._series: set[tuple[str, tuple[str, str, str]]] = set()
        self.gauges: dict[str, Gauge] = {
            "running": metrics.engine_requests_running,
            "waiting": metrics.engine_requests_waiting,
            "kv": metrics.engine_kv_cache_usage_ratio,
            "loaded": metrics.engine_model_loaded,
            "vram": metrics.engine_model_vram_bytes,
            "size": metrics.engine_model_size_bytes,
            "expiry": metrics.engine_model_expiry_seconds,
        }

    async def read(self) -> EngineState | None:
        return await self.u.dialect.read_state(self.u.client, self.u.models)

    async def scrape(self) -> bool:
        """One scrape; False when the engine's state could not be read."""
        if not self.u.up:
            return False
        try:
            state = await self.read()
        except (httpx.HTTPError, ValueError, RecursionError):  # TooLarge is a ValueError
            state = None
        self.m.engine_scrape_up.labels(self.u.name, self.u.engine).set(
            1 if state is not None else 0
        )
        if state is None:
            return False
        seen = set()
        for model, values in state.items():
            label = self.u.model_label(model or None)
            base = (self.u.name, label, self.u.precision_of(label).precision)
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
        return True


def start(upstreams: Upstreams, metrics: Metrics, interval: float) -> None:
    """Scrape every upstream's state every `interval` seconds (0: never)."""
    if interval <= 0:
        return
    for u in upstreams.all:
        gauges = EngineGauges(u, metrics)
        upstreams.spawn(
            every(
                interval,
                gauges.scrape,
                f"engine state scrape of upstream {u.name}",
                first_delay=min(1.0, interval),
            )
        )
