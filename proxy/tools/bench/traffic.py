"""Other traffic on the engine while ``phasewatch bench`` measures: a benchmark that
shares the engine with other requests measures them too (slower decode, queueing in the
TTFT, other requests' power in the decode watts), so the bench watches for them.

Three signals, from the ``/metrics`` page of the URL benched:

- **requests counted that the bench did not send**: through phasewatch,
  ``phasewatch_requests_total`` of the model's upstream grows by the bench's own requests
  and nothing else (compared cumulatively: the proxy counts a request when it ends, a
  little after the bench has read it, which can only hide, never invent, a request);
- **tokens generated that the bench did not ask for**: straight at an engine (each
  engine module names its counter, ``generated_tokens``), vLLM's
  ``vllm:generation_tokens_total`` or llama-server's ``llamacpp:tokens_predicted_total``
  beyond the ``max_tokens`` of every request the bench sent;
- **busy beyond the bench's own requests**: the proxy's ``in_flight_requests`` and
  ``queued_requests`` (live), the engine's ``requests_running`` and
  ``requests_waiting`` (through phasewatch they are scraped every few seconds, so they
  are compared with the most the bench had in flight over the last :data:`STALE_S`
  seconds), read as each measured run ends and every :data:`POLL_S` seconds during a
  longer one.

The page is filtered to the few series needed before it is parsed, so polling costs the
client about a millisecond.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from dataclasses import dataclass, field

import httpx
from prometheus_client.parser import text_string_to_metric_families

from ...engines import ENGINES

#: Seconds between polls of the busy gauges during a run: half of phasewatch's default
#: --engine-scrape (its engine gauges change no faster), and rare enough that serving
#: and reading the page does not disturb what is measured (runs shorter than this are
#: checked at their ends only).
POLL_S = 2.5
#: How old the engine's gauges can be when read through phasewatch (its --engine-scrape
#: default is 5 s).
STALE_S = 6.0
#: How long a gauge read straight from the proxy or the engine can trail the bench.
FRESH_S = 1.0

_PW_REQUESTS = "phasewatch_requests_total"
_PW_LIVE = ("phasewatch_in_flight_requests", "phasewatch_queued_requests")
_PW_ENGINE = ("phasewatch_engine_requests_running", "phasewatch_engine_requests_waiting")
#: Straight at an engine: its own busy gauges and generated-tokens counter, as each engine
#: of the registry names them.
_ENGINE_BUSY = tuple(name for engine in ENGINES.values() for name in engine.busy_gauges)
_ENGINE_TOKENS = tuple(name for engine in ENGINES.values() for name in engine.generated_tokens)
_WANTED = (
    _PW_REQUESTS,
    *_PW_LIVE,
    *_PW_ENGINE,
    *_ENGINE_BUSY,
    *_ENGINE_TOKENS,
    "phasewatch_model_info",
)
#: The power series the bench reads from the same page (sums and counts, no buckets).
POWER = (
    "phasewatch_gpu_power_watts_sum",
    "phasewatch_gpu_power_watts_count",
    "phasewatch_gpu_power_sample_watts_sum",
    "phasewatch_gpu_power_sample_watts_count",
    # GPU power as the sensor resolves it: phases it could not resolve, phase energy,
    # what the sensor is, and the demo's own traffic generator
    "phasewatch_gpu_power_unresolved_total",
    "phasewatch_request_phase_energy_joules_total",
    "phasewatch_power_sampling_up",
    "phasewatch_gpu_power_sensor_info",
    "phasewatch_gpu_power_resolution_seconds",
    "phasewatch_gpu_power_refresh_seconds",
    "phasewatch_demo_traffic_requests_per_second",
)
#: Sample names asked for with ``?name[]=``: prometheus-client's exposition (vLLM's, and
#: phasewatch's) then renders only those; a server that ignores it sends everything.
NAMES = [*_WANTED, *POWER]


@dataclass
class Reading:
    """What the page said at one moment, for the model's upstream (or the whole engine)."""

    at: float
    requests: float | None = None  # requests counted (phasewatch)
    tokens: float | None = None  # tokens generated (engine counters)
    live_busy: float | None = None  # in flight + queued, fresh
    stale_busy: float | None = None  # the engine's running + waiting, scraped by the proxy


def parse(text: str, model: str) -> Reading:
    """A Reading from a /metrics page; phasewatch series are kept for `model`'s upstream."""
    lines = [ln for ln in text.splitlines() if ln.startswith(_WANTED) or ln.startswith("# TYPE ")]
    samples = []
    for fam in text_string_to_metric_families("\n".join(lines) + "\n"):
        samples += fam.samples
    upstreams = {
        s.labels.get("upstream")
        for s in samples
        if s.name == "phasewatch_model_info" and s.labels.get("model") == model
    }

    def total(names, scoped: bool) -> float | None:
        vals = [
            s.value
            for s in samples
            if s.name in names
            and (not scoped or not upstreams or s.labels.get("upstream") in upstreams)
        ]
        return sum(vals) if vals else None

    r = Reading(time.monotonic())
    r.requests = total((_PW_REQUESTS,), True)
    r.live_busy = total(_PW_LIVE, True)
    r.stale_busy = total(_PW_ENGINE, True)
    if r.requests is None:  # straight at an engine
        r.tokens = total(_ENGINE_TOKENS, False)
        r.live_busy = total(_ENGINE_BUSY, False)
    return r


@dataclass
class Own:
    """What the bench itself has sent: requests, their max_tokens, and how many were in
    flight when (so a gauge can be compared with what the bench had running)."""

    sent: int = 0
    max_tokens: int = 0
    in_flight: int = 0
    history: deque = field(default_factory=lambda: deque(maxlen=4096))

    def start(self, max_tokens: int) -> None:
        self.sent += 1
        self.max_tokens += max_tokens
        self.in_flight += 1
        self.history.append((time.monotonic(), self.in_flight))

    def end(self) -> None:
        self.in_flight -= 1
        self.history.append((time.monotonic(), self.in_flight))

    def most_since(self, since: float) -> int:
        """The most requests the bench had in flight from `since` on."""
        most = self.in_flight
        before = 0
        for t, n in self.history:
            if t < since:
                before = n
            else:
                most = max(most, n)
        return max(most, before)


def seen_notes(seen: dict) -> list[str]:
    if seen["busy"] >= 1:
        return [f"up to {seen['busy']:.0f} more requests busy than the bench's"]
    return []


class Watch:
    """Watches one model's runs for traffic that is not the bench's."""

    def __init__(self, http: httpx.AsyncClient, own: Own, model: str) -> None:
        self.http, self.own, self.model = http, own, model
        self.base: Reading | None = None
        self.base_sent = 0
        self.base_max_tokens = 0
        self.reported = 0.0  # foreign requests/tokens already attributed to a run
        self.busy_excess = 0.0
        self.available = True
        self.text: str | None = None  # the page at the last read
        self.before_text: str | None = None  # the page before the last measured run

    async def read(self) -> Reading | None:
        if not self.available:
            return None
        try:
            resp = await self.http.get("/metrics", params={"name[]": NAMES})
        except httpx.HTTPError:
            return None
        if resp.status_code != 200:
            self.available = False
            return None
        try:
            reading = parse(resp.text, self.model)
        except ValueError:
            self.available = False
            return None
        self.text = resp.text
        return reading

    async def begin(self) -> None:
        """Take the counters as the baseline, once they have settled: the proxy counts
        the bench's last request (the warm-up) a moment after the bench has read it."""
        self.base = await self.read()
        for _ in range(3):
            await asyncio.sleep(0.05)
            again = await self.read()
            if again is None or self.base is None:
                break
            settled = (again.requests, again.tokens) == (self.base.requests, self.base.tokens)
            self.base = again
            if settled:
                break
        self.base_sent, self.base_max_tokens = self.own.sent, self.own.max_tokens
        self.reported = 0.0

    def foreign(self, r: Reading | None) -> tuple[float, str] | None:
        """Requests (or tokens) counted since `begin` that the bench did not send."""
        b = self.base
        if r is None or b is None:
            return None
        if r.requests is not None and b.requests is not None:
            return r.requests - b.requests - (self.own.sent - self.base_sent), "requests"
        if r.tokens is not None and b.tokens is not None:
            return r.tokens - b.tokens - (self.own.max_tokens - self.base_max_tokens), "tokens"
        return None

    def excess(self, r: Reading) -> float:
        """How far the busy gauges exceed what the bench had in flight."""
        worst = 0.0
        if r.live_busy is not None:
            worst = max(worst, r.live_busy - self.own.most_since(r.at - FRESH_S))
        if r.stale_busy is not None:
            worst = max(worst, r.stale_busy - self.own.most_since(r.at - STALE_S))
        return worst

    async def during(self, coro, check: bool = True):
        """Run `coro` (one measured run) while polling the busy gauges; returns its
        result and what was seen: None, or a short text saying what. With `check` false
        the page is not read at the run's end (the next checked run's end covers it:
        the counters are compared cumulatively)."""
        stop = asyncio.Event()
        seen = {"busy": 0.0}
        self.before_text = self.text
        # the poller's reads must not stand in for the page after the run
        last_text = self.text

        async def poll() -> None:
            while True:
                try:
                    await asyncio.wait_for(stop.wait(), POLL_S)
                    return
                except TimeoutError:
                    pass
                r = await self.read()
                if r is not None:
                    seen["busy"] = max(seen["busy"], self.excess(r))

        poller = asyncio.create_task(poll())
        try:
            result = await coro
        finally:
            stop.set()
            await poller
        self.text = last_text
        if not check:
            return result, ("; ".join(seen_notes(seen)) or None)
        notes = []
        r = await self.read()
        if r is not None:  # what is still busy as the run ends
            seen["busy"] = max(seen["busy"], self.excess(r))
        f = self.foreign(r)
        if f is not None and f[0] - self.reported >= 1:
            notes.append(f"{f[0] - self.reported:.0f} {f[1]} not the bench's")
            self.reported = f[0]
        notes += seen_notes(seen)
        return result, "; ".join(notes) or None
