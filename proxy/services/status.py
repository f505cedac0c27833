"""The live status page's data: the benchmark table, recent TTFT and decode rates,
in-flight and queued requests and power, computed by the proxy itself (no Grafana, no
external assets).

The table is :mod:`proxy.measure.summary` computed from the proxy's own registry. The
charts come from a bounded ring of per-request points that the recorder hands over
after each request (one deque append per request, nothing on the per-event path). The
routes (``/phasewatch/``, ``/phasewatch/api/summary``) are the own API's
(:mod:`proxy.api`).
"""

from __future__ import annotations

import collections
import json
import statistics
import time
from collections.abc import Callable, Iterable
from importlib import resources
from typing import TYPE_CHECKING, Any

from .. import __version__
from ..measure.advice import advise
from ..measure.sensor import view as sensor_view
from ..measure.summary import MIN_FIGURE_REQUESTS, Samples, build

if TYPE_CHECKING:
    from ..core.exchange import Exchange
    from ..fleet.upstreams import Upstreams
    from ..measure.metrics import Metrics
    from ..measure.timeline import Figures

#: How far back the charts reach, and the most points kept.
WINDOW_SECONDS = 600.0
MAX_POINTS = 4000
#: Window of the "recent" columns.
RECENT_SECONDS = 60.0
#: Seconds between two points of the power chart.
POWER_STEP_SECONDS = 2.0
_SAMPLE_SUM = "phasewatch_gpu_power_sample_watts_sum"
_SAMPLE_COUNT = "phasewatch_gpu_power_sample_watts_count"

_INITIAL_MARK = "/*__INITIAL_SUMMARY__*/null"


class StatusPage:
    """Serves the page and its JSON; collects recent per-request points."""

    def __init__(self, metrics: Metrics, upstreams: Upstreams) -> None:
        self.metrics = metrics
        self.upstreams = upstreams
        self.started = time.time()
        #: Set by ``phasewatch demo``: the engine, its GPUs and their watts are simulated,
        #: and the page says so.
        self.simulated = False
        self.points: collections.deque = collections.deque(maxlen=MAX_POINTS)
        self._keys: dict[tuple[str, str, str], int] = {}
        self._template: str | None = None
        #: (time, {gpu label: watts}) every POWER_STEP_SECONDS while requests finish or
        #: the page is open: the latest power samples, read from the one gauge.
        self.power_points: collections.deque = collections.deque(
            maxlen=int(WINDOW_SECONDS / POWER_STEP_SECONDS) + 1
        )
        self._power_t = 0.0
        self._power_last: dict[str, tuple[float, float]] = {}  # GPU -> (sum, count) seen
        self._summary: tuple[float, int, dict] | None = None
        #: energy per token by phase fitted over many requests (the power service's
        #: rows of ``GET /phasewatch/api/energy``), set by the app where power is sampled
        self.energy: Callable[[], list[dict]] | None = None
        self._finished = 0  # requests seen by on_request
        for u in upstreams.all:  # the cached summary must not outlive an up/down change
            u.on_change.append(self._upstream_changed)

    def _upstream_changed(self, _upstream: object) -> None:
        """An upstream went up or down: the next summary says so (readiness and the
        up gauge already do), rather than the one cached for up to a second."""
        self._summary = None

    # --- the recorder's listener (once per finished request) -------------------------

    def on_request(self, ex: Exchange, f: Figures) -> None:
        self._finished += 1
        if ex.outcome != "ok":
            return
        key = (ex.upstream_name, ex.model_label, ex.precision)
        idx = self._keys.get(key)
        if idx is None:
            if len(self._keys) >= 256:  # labels are bounded already; belt and braces
                return
            idx = self._keys[key] = len(self._keys)
        now = time.time()
        self.points.append(
            (
                now,
                idx,
                f.ttft,
                f.decode_tps.get("proxy", f.decode_tps.get("engine")),
                f.prompt_tokens,
                f.completion_tokens,
            )
        )
        self._power_tick(now)
        return

    def _power_tick(self, now: float, samples: Iterable[Any] | None = None) -> None:
        """Every POWER_STEP_SECONDS, one point per GPU: the mean of all its power samples
        since the last point (from the samples histogram's sum and count), not the latest
        sample alone, which spikes with every prefill."""
        if now - self._power_t < POWER_STEP_SECONDS:
            return
        self._power_t = now
        if samples is None:  # this process's own samples (cheap: one metric)
            samples = (
                s for fam in self.metrics.gpu_power_sample_watts.collect() for s in fam.samples
            )
        totals: dict[str, list[float]] = {}
        for s in samples:
            if s.name not in (_SAMPLE_SUM, _SAMPLE_COUNT):
                continue
            lab = s.labels
            model = lab.get("model", "")
            label = f"{lab.get('upstream', '')} gpu {lab.get('gpu', '')}" + (
                f" · {model}" if model and model != "all" else ""
            )
            t = totals.setdefault(label, [0.0, 0.0])
            t[0 if s.name == _SAMPLE_SUM else 1] += s.value
        watts = {}
        for label, (total, count) in totals.items():
            last_total, last_count = self._power_last.get(label, (0.0, 0.0))
            if count > last_count:
                watts[label] = (total - last_total) / (count - last_count)
            self._power_last[label] = (total, count)
        if watts:
            self.power_points.append((now, watts))

    # --- data ------------------------------------------------------------------------

    def summary(self) -> dict:
        """The page's data; computed at most once a second however many pages poll,
        unless a request finished since."""
        now = time.time()
        cached = self._summary
        if cached is not None and now - cached[0] < 1.0 and cached[1] == self._finished:
            return cached[2]
        data = self._compute(now)
        self._summary = (now, self._finished, data)
        return data

    def _compute(self, now: float) -> dict:
        reg = Samples.from_registry(self.metrics.exposition)  # all workers' figures
        self._power_tick(now, reg.get(_SAMPLE_SUM) + reg.get(_SAMPLE_COUNT))
        rep = build(reg, source="this proxy", include_idle_models=True)
        as_dict = rep.as_dict()
        advice = [a.as_dict() for a in advise(reg, rep)]
        keys: list[tuple[str, str, str]] = sorted(self._keys, key=self._keys.__getitem__)
        cutoff = now - WINDOW_SECONDS
        points = [p for p in list(self.points) if p[0] >= cutoff]
        recent: dict[int, dict] = {}
        for t, idx, ttft, dec, _pt, ct in points:
            if t >= now - RECENT_SECONDS:
                r = recent.setdefault(idx, {"ttft": [], "dec": [], "n": 0, "tokens": 0})
                r["n"] += 1
                r["tokens"] += ct or 0
                if ttft is not None:
                    r["ttft"].append(ttft)
                if dec is not None:
                    r["dec"].append(dec)
        rows = []
        for row in as_dict["rows"]:
            key = (row["upstream"], row["model"], row["precision"])
            got = recent.get(self._keys.get(key, -1))
            row["recent"] = {
                "requests_per_min": got["n"] * 60.0 / RECENT_SECONDS if got else 0.0,
                "tokens_per_s": got["tokens"] / RECENT_SECONDS if got else 0.0,
                "ttft_s": statistics.median(got["ttft"]) if got and got["ttft"] else None,
                "decode_tok_s": statistics.median(got["dec"]) if got and got["dec"] else None,
            }
            rows.append(row)
        upstreams = []
        for u in self.upstreams.all:
            upstreams.append(
                {
                    "name": u.name,
                    "engine": u.engine,
                    "up": u.up,  # None until its first probe answered or failed
                    "reason": None if u.up else u.reason,  # why it is down (None while up)
                    "models": len(u.models),
                    "requests": reg.total("phasewatch_requests_total", upstream=u.name),
                    "errors": sum(
                        reg.total("phasewatch_requests_total", upstream=u.name, outcome=o)
                        for o in ("error", "rejected")
                    ),
                    "in_flight": reg.total("phasewatch_in_flight_requests", upstream=u.name),
                    "queued": reg.total("phasewatch_queued_requests", upstream=u.name),
                    # False: the engine gives no count of what it runs, so GPU energy
                    # is divided as if phasewatch relayed all of it (None: not known)
                    "energy_counted": _counted(reg, u.name),
                    # streams whose output stopped (proxy.services.stall)
                    "stalled": u.stalled,
                    "stall_reason": u.stall_reason,
                    # streams whose clients stopped reading: not stalls
                    "client_held": u.client_held,
                    "watts": sum(g["watts"] for g in rep.gpus if u.name in g["upstream"].split("+"))
                    if rep.gpus
                    else None,
                }
            )
        return {
            "version": __version__,
            "now": now,
            "uptime_s": now - self.started,
            "simulated": self.simulated,
            "window_s": WINDOW_SECONDS,
            "recent_s": RECENT_SECONDS,
            "power_sampled": rep.power,
            # requests a derived figure (speed-up, power saved, J/token) needs to be shown
            "min_figure_requests": MIN_FIGURE_REQUESTS,
            # what the GPU power sensor resolves, or why power is not sampled
            "power_sensor": sensor_view(reg).lines(),
            "gpus": rep.gpus,
            "upstreams": upstreams,
            "pools": self.upstreams.pools.summary(),
            "bands": as_dict["bands"],
            "rows": rows,
            "advice": advice,  # proxy.measure.advice's rows: the page's advice panel
            # energy per token by phase from many requests (prefill W where single
            # prefills are too short for the sensor)
            "energy": self.energy() if self.energy is not None else [],
            "series": [{"upstream": k[0], "model": k[1], "precision": k[2]} for k in keys],
            "points": [
                [round(t - now, 3), idx, _r(ttft, 5), _r(dec, 2), pt, ct]
                for t, idx, ttft, dec, pt, ct in points
            ],
            "power_points": [
                [round(t - now, 3), w] for t, w in list(self.power_points) if t >= cutoff
            ],
        }

    def advice(self) -> list[dict]:
        """The advice rows (``GET /phasewatch/api/advice``): the summary's own, so the
        API and the page's panel always agree."""
        return list(self.summary()["advice"])

    def page(self) -> bytes:
        """The page, with the current summary inlined (it renders before its first poll)."""
        if self._template is None:
            self._template = (
                resources.files("proxy.services").joinpath("static/status.html").read_text("utf-8")
            )
        initial = json.dumps(self.summary(), separators=(",", ":")).replace("<", "\\u003c")
        return self._template.replace(_INITIAL_MARK, initial, 1).encode("utf-8")


def _counted(reg: Samples, upstream: str) -> bool | None:
    """Whether the engine's own count of running requests divides its GPU's energy."""
    got = reg.get("phasewatch_power_engine_count_up", upstream=upstream)
    return bool(max(s.value for s in got)) if got else None


def _r(value: float | None, digits: int) -> float | None:
    return None if value is None else round(value, digits)
