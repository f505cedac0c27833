"""Streams whose output stopped: stall detection from the proxy's side, for every engine.

An engine can accept a request, answer its head (and a role-only first event) and then
send nothing, while its health endpoint answers and its model list reads: no request
finishes, so no figure moves. Only the proxy, which holds every stream in flight, sees
the silence. A stream (a streamed generation sent upstream and not finished) is stalled
when its output has not advanced for longer than it should:

- before its first output event: longer than ``--stall-prefill-factor`` times its prompt
  at the measured prefill rate of its upstream, model and prompt band (the prompt's size
  estimated from its body, generously; a band not measured yet at the slowest rate
  measured for a longer band, else at :data:`FALLBACK_PREFILL_TPS`: a rate learnt on
  short prompts says nothing of a long one's prefill), and never less than
  ``--stall-floor``; and only while its upstream has produced no output on
  any stream for ``--stall-floor`` either (a request waiting in the engine's queue behind
  streams that progress is queued, not stalled);
- after it: longer than ``--stall-gaps`` inter-token gaps at the measured decode rate, and
  never less than ``--stall-floor``.

A long but steady generation (every gap short) or a long prefill within its allowance is
never a stall. Nor is a stream **held back by its own client**: a client that stops
reading pauses the proxy's read of the engine (backpressure), so the stream's output
stops advancing while the engine is not silent at all; such a stream is skipped (its
silence counts again from when the client catches up), counted apart in
``phasewatch_client_held_streams``, and taken for progress of its upstream (it must not
make a queued request beside it look stalled either): else any client could mark a
healthy engine stalled, and move a pool's traffic, with one request it never reads.

The watcher scans the upstreams' in-flight exchanges a few times per floor
(off the request path: nothing here runs per event), sets ``upstream.stalled`` (which a
pool avoids and readiness reports), the gauges ``phasewatch_stalled_streams``,
``phasewatch_stream_longest_silence_seconds`` and ``phasewatch_client_held_streams``,
counts each stream that stalls in ``phasewatch_stalls_total`` and logs it once.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ..fleet.supervisor import every
from ..measure.metrics import PROMPT_BANDS, prompt_band

if TYPE_CHECKING:
    from ..core.exchange import Exchange
    from ..fleet.upstream import Upstream
    from ..fleet.upstreams import Upstreams
    from ..measure.metrics import Metrics
    from ..measure.timeline import Figures

log = logging.getLogger(__name__)

#: Prefill rate assumed for a model not measured yet (tokens/s): slow on purpose, so a
#: long first prompt to a cold model is given time.
FALLBACK_PREFILL_TPS = 500.0
#: Request-body bytes per prompt token assumed: fewer than any tokenizer's, so the prompt
#: is over- rather than underestimated (a longer allowance, never a false stall).
BYTES_PER_TOKEN = 3.0
#: Weight of the newest request in the measured rates (an average that forgets).
ALPHA = 0.2


@dataclass(frozen=True, slots=True)
class StallOptions:
    """The thresholds (flags ``--stall-floor``, ``--stall-prefill-factor``, ``--stall-gaps``)."""

    stall_floor: float = 60.0  # seconds; 0 turns detection off
    stall_prefill_factor: float = 4.0
    stall_gaps: float = 100.0

    @property
    def interval(self) -> float:
        """How often the streams are scanned: a few times per floor, within 0.25-5 s."""
        return min(5.0, max(0.25, self.stall_floor / 8))


#: The prompt bands from the shortest to the longest (``unknown`` left out).
_BANDS = [b for b in PROMPT_BANDS if b != "unknown"]


@dataclass(slots=True)
class Rates:
    """Measured rates of one upstream's model: prefill tok/s by prompt band, and seconds
    per token."""

    prefill_tps: dict[str, float] = field(default_factory=dict)
    itl_s: float | None = None

    def prefill(self, tokens: float) -> float:
        """The prefill rate to expect for a prompt of `tokens`: its band's, else the
        slowest of the longer bands measured (a longer prompt is not prefilled faster),
        else :data:`FALLBACK_PREFILL_TPS`."""
        band = prompt_band(int(tokens))
        if band in self.prefill_tps:
            return self.prefill_tps[band]
        longer = [
            self.prefill_tps[b] for b in _BANDS[_BANDS.index(band) :] if b in self.prefill_tps
        ]
        return min(longer, default=FALLBACK_PREFILL_TPS)


class StallWatch:
    """Scans the streams in flight and publishes what is stalled."""

    def __init__(self, options: StallOptions, metrics: Metrics, upstreams: Upstreams) -> None:
        self.options = options
        self.metrics = metrics
        self.upstreams = upstreams
        self.rates: dict[tuple[str, str], Rates] = {}
        #: monotonic time of each upstream's last output event of a finished stream
        self.last_output: dict[str, float] = {}
        self._stalled: set[Exchange] = set()
        #: the last scan, per upstream: (stalled streams, longest silence)
        self.view: dict[str, tuple[int, float]] = {}

    def start(self) -> None:
        if self.options.stall_floor > 0:
            # every upstream's count exists from the start, at 0: the first stall is then
            # an increase a dashboard sees, not the value a new series is born with
            for u in self.upstreams.all:
                for phase in ("prefill", "decode"):
                    self.metrics.stalls_total.labels(u.name, phase)
            self.upstreams.spawn(every(self.options.interval, self._step, "stall scan"))

    async def _step(self) -> None:
        self.scan(time.monotonic())

    # --- measured rates (a recorder listener) -------------------------------------------

    def on_request(self, ex: Exchange, f: Figures) -> None:
        """Learn the upstream's rates from a finished request (no log-line fields)."""
        name = ex.upstream.name
        if ex.marks.t_last is not None:
            self.last_output[name] = max(self.last_output.get(name, 0.0), ex.marks.t_last)
        prefill = f.prefill_tps.get("proxy") or f.prefill_tps.get("engine")
        itl = f.tpot.get("proxy") or f.tpot.get("engine")
        if prefill is None and itl is None:
            return
        r = self.rates.setdefault((name, ex.model_label), Rates())
        band = prompt_band(f.prompt_tokens)
        if prefill is not None and prefill > 0 and band != "unknown":
            old = r.prefill_tps.get(band)
            r.prefill_tps[band] = prefill if old is None else _ewma(old, prefill)
        if itl is not None and itl > 0:
            r.itl_s = itl if r.itl_s is None else _ewma(r.itl_s, itl)

    # --- the scan --------------------------------------------------------------------------

    def allowance(self, ex: Exchange) -> tuple[str, float]:
        """(phase, seconds of silence allowed) for a stream in flight."""
        o = self.options
        r = self.rates.get((ex.upstream.name, ex.model_label)) or Rates()
        if ex.marks.t_first is None:
            tokens = len(ex.prepared.body) / BYTES_PER_TOKEN
            expected = tokens / r.prefill(tokens)
            return "prefill", max(o.stall_floor, o.stall_prefill_factor * expected)
        return "decode", max(o.stall_floor, o.stall_gaps * (r.itl_s or 0.0))

    def silence(self, ex: Exchange, now: float) -> float | None:
        """Seconds since the stream last advanced, or since its client last caught up
        (None: not a stream in flight)."""
        m = ex.marks
        if not ex.prepared.stream or m.t_sent is None or m.t_end is not None:
            return None
        since = m.t_last if m.t_last is not None else m.t_sent
        if ex.released is not None:
            since = max(since, ex.released)
        return now - since

    def scan(self, now: float) -> None:
        """Find the stalled streams of every upstream; publish them."""
        stalled_now: set[Exchange] = set()
        for u in self.upstreams.all:
            active = list(u.active)  # the relay adds and removes on the same loop
            held = [ex for ex in active if ex.held_since is not None and ex.marks.t_end is None]
            progressed = max(
                [self.last_output.get(u.name, 0.0), now if held else 0.0]
                + [ex.marks.t_last for ex in active if ex.marks.t_last is not None]
            )
            quiet_upstream = now - progressed > self.options.stall_floor
            count, longest = 0, 0.0
            for ex in active:
                if ex.held_since is not None:
                    continue  # its client holds it back: the engine is not silent
                silent = self.silence(ex, now)
                if silent is None:
                    continue
                longest = max(longest, silent)
                phase, allowed = self.allowance(ex)
                if silent <= allowed or (phase == "prefill" and not quiet_upstream):
                    continue
                count += 1
                stalled_now.add(ex)
                if ex not in self._stalled:
                    self._stalled.add(ex)
                    self.metrics.stalls_total.labels(u.name, phase).inc()
                    log.warning(
                        "stream %s to upstream %s stalled in %s: no output for %.0f s "
                        "(allowed %.0f s)",
                        ex.request_id,
                        u.name,
                        phase,
                        silent,
                        allowed,
                    )
            self._publish(u, count, longest, len(held))
        self._stalled &= stalled_now

    def _publish(self, u: Upstream, count: int, longest: float, held: int) -> None:
        self.view[u.name] = (count, longest)
        u.stalled = count
        u.client_held = held
        u.stall_reason = (
            f"{count} stream(s) stalled, the longest silent {longest:.0f} s" if count else None
        )
        self.metrics.stalled_streams.labels(u.name).set(count)
        self.metrics.stream_longest_silence_seconds.labels(u.name).set(round(longest, 3))
        self.metrics.client_held_streams.labels(u.name).set(held)


def _ewma(old: float, new: float) -> float:
    return old + ALPHA * (new - old)
