"""The power sampler: a daemon thread reading a source, learning what it resolves
(:mod:`.learn`), feeding the power metrics and each GPU's tick ring (:mod:`.ledger`), from
which requests' phase energy is settled.

Every driver or HTTP call runs behind a timeout on a second daemon thread, so a hung NVML
call can neither stall the proxy nor keep it from exiting. Each tick records what the GPU's
upstream had in flight (idle / prefill / decode); each step of the energy counter (else
integrated power) is spread over the ticks it covers.
"""

from __future__ import annotations

import collections
import concurrent.futures
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ...measure.metrics import Metrics
from .energy import EnergyMeter
from .guard import SensorGuard
from .learn import FASTEST_POLL, PROBE_SECONDS, SensorWatch
from .ledger import NO_COUNT, InFlightBook, TickRing
from .sources import PageTooLarge, PowerUnavailable, Reading, Source

log = logging.getLogger(__name__)


# --- which GPU serves what ------------------------------------------------------------------


@dataclass(frozen=True, eq=False)
class Owner:
    upstream: Any  # proxy.core.Upstream (duck-typed: name, active, models, precision_of)
    model: str | None  # None: the whole upstream


class GpuMap:
    """GPU -> the upstream(s) or model it serves, from ``--power-gpu GPU=UPSTREAM|MODEL``;
    with no mapping every GPU serves every upstream."""

    def __init__(self, pairs: dict[str, str], upstreams: list, route: Callable[[str], object]):
        self.pairs = pairs
        self.upstreams = upstreams
        self.route = route
        self._owners: dict[str, tuple[Owner, ...]] = {}
        #: the engines' own counts (:class:`proxy.services.engine_state.EngineCounts`),
        #: where the process samples power; None: this host's in flight is all there is
        self.engine_counts: Any = None

    def owners(self, gpu: str) -> tuple[Owner, ...]:
        """Who this GPU works for; empty when a mapping is given and leaves it out."""
        found = self._owners.get(gpu)
        if found is None:
            if not self.pairs:
                found = tuple(Owner(u, None) for u in self.upstreams)
            elif gpu not in self.pairs:
                found = ()
            else:
                target = self.pairs[gpu]
                by_name = [u for u in self.upstreams if u.name == target]
                if by_name:
                    found = (Owner(by_name[0], None),)
                else:
                    found = (Owner(self.route(target), target),)
                    if not any(u.serves(target) for u in self.upstreams):
                        return found  # not listed yet: asked again once the lists are known
            self._owners[gpu] = found
        return found

    def unresolved(self) -> dict[str, str]:
        """GPU -> target for the mappings that name neither an upstream nor a model an
        upstream lists (or ``--models`` names): their GPU's power is attributed to no
        request."""
        names = {u.name for u in self.upstreams}
        return {
            gpu: target
            for gpu, target in self.pairs.items()
            if target not in names and not any(u.serves(target) for u in self.upstreams)
        }

    def labels(self, gpu: str) -> tuple[str, str, str]:
        """(upstream, model, precision) for this GPU's series. A GPU shared by several
        upstreams is labelled with their names joined by '+'; one serving several models
        has model ``all`` and their common precision, or ``mixed``."""
        owners = self.owners(gpu)
        upstream = "+".join(sorted({o.upstream.name for o in owners}))
        models: dict[tuple[str, str | None], Any] = {}  # (upstream name, model) -> upstream
        for o in owners:
            listed = (
                [o.model]
                if o.model is not None
                else sorted(o.upstream.models | o.upstream.configured_models) or [None]
            )
            models.update(((o.upstream.name, m), o.upstream) for m in listed)
        if len(models) == 1:
            (_, model), up = next(iter(models.items()))
            if model is not None:
                return upstream, model, up.precision_of(model).precision
        precisions = {
            up.precision_of(m).precision if m else "unknown" for (_, m), up in models.items()
        }
        return upstream, "all", precisions.pop() if len(precisions) == 1 else "mixed"

    def settled(self, gpu: str) -> bool:
        """Whether this GPU's labels are final: every upstream it serves has answered its
        first model-list probe (until then the precision reads ``unknown`` only because it
        has not been detected yet)."""
        for o in self.owners(gpu):
            probed = getattr(o.upstream, "probed", None)
            if probed is not None and not probed.is_set():
                return False
        return True

    def in_flight(self, gpu: str) -> list:
        out = []
        for o in self.owners(gpu):
            try:
                active = list(o.upstream.active)
            except RuntimeError:  # changed while copied: take the next tick's view
                active = []
            out.extend(
                active if o.model is None else [ex for ex in active if ex.model_label == o.model]
            )
        return out

    def engine_count(self, gpu: str) -> tuple[float, float, float] | None:
        """What the engines serving `gpu` said they hold (running + waiting), summed over
        its owners, and the span their reads were sent and answered in; None when any
        of them does not say."""
        if self.engine_counts is None:
            return None
        n, sent, answered = 0.0, float("inf"), float("-inf")
        for o in self.owners(gpu):
            got = self.engine_counts.of(o.upstream, o.model)
            if got is None:
                return None
            n, sent, answered = n + got[0], min(sent, got[1]), max(answered, got[2])
        return n, sent, answered

    def counts(self, gpu: str) -> tuple[int, int]:
        """(prefill, decode): this process's requests in flight on `gpu`, by phase."""
        prefill = decode = 0
        for ex in self.in_flight(gpu):
            if ex.marks.t_first is None and ex.prepared.stream:
                prefill += 1
            else:
                decode += 1
        return prefill, decode

    def serves(self, gpu: str, ex) -> bool:
        return any(
            o.upstream is ex.upstream and (o.model is None or o.model == ex.model_label)
            for o in self.owners(gpu)
        )


def classify(prefill: int, decode: int) -> str:
    """idle / prefill / decode for what a GPU's upstream has in flight. Any request before
    its first token makes it prefill (the engine runs that prompt now); a non-streamed
    request shows no first token, and counts as decode, where it spends most of its time."""
    return "prefill" if prefill else "decode" if decode else "idle"


#: Each GPU's tick ring: a dict of this process's, or the workers' shared rings.
RingStore = Any


# --- the sampler -------------------------------------------------------------------------------


class _Caller:
    """Runs source calls on one daemon thread, so a call that hangs in the driver costs a
    timeout, not the sampler (and never blocks interpreter exit)."""

    def __init__(self) -> None:
        self.jobs: queue.SimpleQueue = queue.SimpleQueue()
        self.busy: concurrent.futures.Future | None = None
        threading.Thread(target=self._run, name="phasewatch-power-call", daemon=True).start()

    def _run(self) -> None:
        while True:
            fn, fut = self.jobs.get()
            try:
                fut.set_result(fn())
            except BaseException as exc:  # noqa: BLE001 - handed to the caller
                fut.set_exception(exc)

    def call(self, fn, timeout: float):
        """fn() or raises; TimeoutError while a previous call is still hung."""
        if self.busy is not None and not self.busy.done():
            raise TimeoutError("a previous call has not returned yet")
        fut: concurrent.futures.Future = concurrent.futures.Future()
        self.busy = fut
        self.jobs.put((fn, fut))
        try:
            return fut.result(timeout)
        except concurrent.futures.TimeoutError:
            raise TimeoutError(f"no answer within {timeout:g}s") from None


#: How often a DCGM page refused as too large is asked for again (s).
PAGE_RETRY_SECONDS = 5.0

#: Ticks of in-flight counts kept per GPU to match an engine count to (a few seconds).
OURS_KEPT = 512

#: The reason of energy owed to requests the engine ran and this host did not relay.
NOT_RELAYED = "not_relayed"

#: A step whose share owed to others is above this part of it is *shared*: the fit of
#: energy per token leaves it out (its work is not all known here).
SHARED_SHARE = 0.01

#: A resolution above this (s) is too coarse for per-request figures: warned about once.
COARSE_RESOLUTION = 2.0

#: (snapshot numbers, one per process; gpu -> (prefill, decode) in flight)
Membership = tuple[tuple[int, ...], dict[str, tuple[int, int]]]


class PowerSampler:
    """Samples a source, learns what it resolves, feeds the power metrics and the per-GPU
    tick rings (energy by tick, :mod:`.ledger`).

    :meth:`tick` does one sample; :meth:`start` runs it on a daemon thread, fast for the
    first second (learning each field's refresh period), then every `interval` or a
    quarter of the sensor's refresh period, whichever is shorter. Tests drive
    :meth:`tick` with their own clock.
    """

    def __init__(
        self,
        source: Source,
        metrics: Metrics,
        gpus: GpuMap,
        *,
        interval: float,
        timeout: float,
        clock: Callable[[], float] = time.monotonic,
        rings: RingStore = None,
        membership: Callable[[list[str], float], Membership] | None = None,
        describe: str = "",
        max_watts: float = 3000.0,
    ) -> None:
        self.source = source
        self.metrics = metrics
        self.gpus = gpus
        self.interval = interval
        self.poll = FASTEST_POLL
        self.timeout = timeout
        self.clock = clock
        self.describe = describe or source.name
        #: refuses what no GPU reports, before any figure uses it
        self.guard = SensorGuard(max_watts, metrics)
        #: gpu -> its ticks: this process's, or (--workers N) the shared file's
        self.rings: RingStore = rings if rings is not None else {}
        if membership is None:
            book = InFlightBook(gpus.in_flight)
            self.book: InFlightBook | None = book

            def membership(gs: list[str], now: float) -> Membership:
                seq, counts = book.snapshot(gs, now)
                return (seq,), counts

        else:
            self.book = None
        self.membership = membership
        self.meters: dict[str, EnergyMeter] = {}
        self.watches: dict[str, SensorWatch] = {}
        self._since: dict[str, float] = {}  # gpu -> start of the energy not yet spread
        self._unspread: dict[str, float] = {}  # gpu -> joules counted, not yet spread
        self._state: dict[str, str] = {}  # gpu -> state at its last tick
        self._steady: dict[str, float] = {}  # gpu -> since when its state has held
        self._told: dict[str, tuple[float, float]] = {}  # gpu -> resolution logged, when
        self._warned = False
        self.started: float | None = None
        self.up: bool | None = None  # None until the first tick
        self.opened = False
        self._current: dict[str, tuple] = {}  # gpu -> labels of its current-watts gauge
        #: gpu -> joules counted under its current labels (carried over when an
        #: ``unknown`` precision is detected and the series is relabelled)
        self._joules: dict[str, float] = {}
        self._idle: dict[str, float] = {}
        self._others: dict[str, float] = {}  # gpu -> unattributed joules so counted
        #: gpu -> (tick time, this host's requests in flight) over the last ticks
        self._ours: dict[str, collections.deque[tuple[float, int]]] = {}
        self._read_at: dict[str, float] = {}  # gpu -> mid-time of its engine count's read
        self._beside: dict[str, int] = {}  # gpu -> others' requests at that read
        #: gpu -> (joules, idle, unattributed joules) measured before its labels settled
        self._pending: dict[str, tuple[float, float, float]] = {}
        self._caller = _Caller()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._up_gauge = metrics.power_sampling_up.labels(source.name)
        #: told each spread step of a GPU's energy (gpu, start, stop, joules, shared: the
        #: engine ran requests this host did not relay in it): the energy-per-token fit
        #: (:mod:`.fit`)
        self.on_step: Callable[[str, float, float, float, bool], None] | None = None

    # --- lifecycle ---------------------------------------------------------------------

    def open(self) -> bool:
        """Open the source; False (said once) when power cannot be read here at all."""
        try:  # nvmlInit can take seconds on a many-GPU host without persistence mode
            self._caller.call(self.source.open, max(30.0, self.timeout))
        except PowerUnavailable as exc:
            self._set_down(str(exc), permanent=True)
            return False
        except Exception as exc:  # noqa: BLE001 - a hang or a driver error
            self._set_down(f"opening {self.source.name} failed: {exc}", permanent=True)
            return False
        self.opened = True
        return True

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="phasewatch-power", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2 * self.timeout + self.interval)
        if self.opened:
            try:
                self._caller.call(self.source.close, 1.0)
            except Exception:  # noqa: BLE001 - shutting down anyway
                pass

    def _run(self) -> None:
        if not self.open():
            return
        next_t = time.monotonic()
        while not self._stop.is_set():
            try:
                self.tick()
            except Exception:
                log.exception("power sampler tick failed")
            next_t += self.poll
            delay = next_t - time.monotonic()
            if delay < 0:  # fell behind (a hang): skip the missed ticks
                next_t, delay = time.monotonic(), 0.0
            self._stop.wait(delay)

    # --- one sample -----------------------------------------------------------------------

    def tick(self) -> None:
        t_c = self.clock()
        if self.started is None:
            self.started = t_c
        seqs, counts = self.membership(sorted(self.meters), t_c)
        try:
            readings = self._caller.call(self.source.read, self.timeout)
        except TimeoutError as exc:
            self._set_down(f"a call to {self.source.name} hung ({exc})")
            return
        except PageTooLarge as exc:
            what = f"{exc} at {self.describe}, over --power-dcgm-max-bytes"
            self.guard.refuse("all", "page_too_large", what)
            self._set_down(f"reading {self.source.name} failed: {what}")
            # such a page is not fixed in a moment: asked for again only now and then
            self.poll = max(self.interval, PAGE_RETRY_SECONDS)
            return
        except Exception as exc:  # noqa: BLE001 - driver or HTTP error: said once
            self._set_down(f"reading {self.source.name} failed: {exc}")
            return
        t_read = self.clock()
        t = (t_c + t_read) / 2.0
        if readings.keys() - self.meters.keys():  # a GPU seen for the first time
            seqs, counts = self.membership(sorted(readings), t_c)
        # what was in flight once the source had answered: a sample read while that
        # changed (a request began or ended) belongs to neither state's histogram
        after = self.membership(sorted(readings), t_read)[1]
        seen = 0
        for gpu, raw in sorted(readings.items()):
            if not self.gpus.owners(gpu):
                continue
            seen += 1
            r = self.guard.check(gpu, raw, t)
            if r is None:  # an impossible reading: this tick is not this GPU's, and its
                # current power is absent until a good one (its labels are kept)
                old = self._current.get(gpu)
                if old is not None:
                    _remove(self.metrics.gpu_power_current_watts, old)
                continue
            self._sample(gpu, r, t_c, t, counts.get(gpu, (0, 0)), seqs, after)
        if seen:
            self._set_up(len(readings), seen)
            self._learnt(t)
        else:
            self._set_down(
                f"{self.source.name} reports GPUs {sorted(readings)}, none of them "
                "mapped by --power-gpu"
            )

    def _sample(
        self,
        gpu: str,
        r: Reading,
        t_c: float,
        t: float,
        counts: tuple[int, int],
        seqs: tuple[int, ...],
        after: dict[str, tuple[int, int]],
    ) -> None:
        watch = self.watches.get(gpu)
        if watch is None:
            watch = self.watches[gpu] = SensorWatch(self.source.name)
        prev_t = watch.prev_t
        changed = watch.see(t, r.fields())
        ring = self.rings.get(gpu)
        if ring is None:
            ring = self.rings.setdefault(gpu, TickRing())
        n_engine = self._running(gpu, ring, t_c, counts[0] + counts[1])
        ring.append(t_c, counts[0], counts[1], seqs, n_engine)
        # others' requests running beside none of ours: busy, in a phase not known here
        state = classify(*counts) if n_engine <= 0 or any(counts) else "decode"
        if self._state.get(gpu) != state:  # it began after the last tick, at t_c at the latest
            self._steady[gpu] = t_c
        use = watch.preferred()
        counter = None
        if use == "energy_counter" and r.energy_mj is not None:
            counter = int(r.energy_mj)
        watts = r.instant if r.instant is not None else r.watts
        # energy the meter counted and no tick has been given yet (a counter that has not
        # stepped since)
        joules = self._unspread.get(gpu, 0.0)
        joules += self.meters.setdefault(gpu, EnergyMeter()).step(t, watts, counter)
        spread = idle = 0.0
        step: tuple[float, float] | None = None  # the interval spread this tick
        if counter is None:  # a power reading: held over the last poll
            if prev_t is not None:
                # a counter that failed or was refused this tick: the energy since its
                # last step is spread with this tick's integrated power
                since = self._since.get(gpu)
                start = prev_t if since is None else min(since, prev_t)
                spread, idle = joules, ring.distribute(start, t, joules)
                step = (start, t)
                if use == "energy_counter":
                    self._since[gpu] = t
        elif "energy_counter" in changed:  # the counter stepped: the energy since its last step
            period = watch.refresh(use) or 0.0
            at = t  # a counter that steps at every poll is read as it is
            if prev_t is not None and period > 1.5 * (t - prev_t):
                at = (t + prev_t) / 2.0  # it stepped somewhere between the two polls
                if self.source.name == "dcgm":
                    at -= period / 2.0  # the exporter collected it up to a period before
            since = self._since.get(gpu)
            if since is not None and at > since:
                spread, idle = joules, ring.distribute(since, at, joules)
                step = (since, at)
            self._since[gpu] = at
        self._unspread[gpu] = joules - spread if self._since.get(gpu) is not None else 0.0
        others = ring.take_unattributed()  # owed to requests this host did not relay
        if step is not None:
            self._told_step(gpu, step[0], step[1], spread, others > SHARED_SHARE * spread)
        if not self.gpus.settled(gpu):
            # no series labelled with a precision not detected yet: the energy waits
            # for the labels
            pj, pi, po = self._pending.get(gpu, (0.0, 0.0, 0.0))
            self._pending[gpu] = (pj + spread, pi + idle, po + others)
        else:
            # a sample is the state's only when the state held over all the reading may
            # describe (a lagged or averaged field still shows the state before) and
            # still holds once the source has answered
            age = watch.age("power_instant" if r.instant is not None else "power_usage", self.poll)
            same = (
                age is not None
                and t_c - self._steady.get(gpu, t_c) >= age
                and classify(*after.get(gpu, counts)) == state
                and (n_engine <= 0 or any(counts))
            )
            self._publish(gpu, watts, spread, idle, others, state if same else None)
        self._state[gpu] = state

    def _told_step(self, gpu: str, a: float, b: float, joules: float, shared: bool) -> None:
        if self.on_step is not None:
            try:
                self.on_step(gpu, a, b, joules, shared)
            except Exception:  # a listener's bug must not stop the sampling
                log.exception("energy step listener failed")

    def _running(self, gpu: str, ring: TickRing, t: float, ours: int) -> int:
        """How many requests the GPU runs at this tick: ours now, and the others the
        engine held at its last count (its count less what we had in flight while it
        was asked). Our own requests come and go at once, not a read later. When a new
        count arrives, the ticks since halfway from the previous one that hold no energy
        yet take it too, so others' arrivals and departures are placed within half a
        read. :data:`~.ledger.NO_COUNT` when the engine gives none."""
        hist = self._ours.setdefault(gpu, collections.deque(maxlen=OURS_KEPT))
        hist.append((t, ours))
        got = self.gpus.engine_count(gpu)
        if got is None:
            return NO_COUNT
        engine, sent, answered = got
        if answered > t:  # read after this tick's snapshot: matched at the next tick
            return ours + self._beside.get(gpu, 0)
        # what we had in flight while the engine was asked: the most of the ticks from
        # the one before the read was sent to the one after it was answered (a request
        # of ours that started or ended meanwhile may or may not be in the count)
        then, after = 0, 0
        for t_h, n in reversed(hist):
            if t_h > answered:
                after = n  # ends as the first tick after the answer
                continue
            then = max(then, n)
            if t_h < sent:
                break
        then = max(then, after)
        others = max(0, round(engine) - then)
        when = (sent + answered) / 2.0
        last = self._read_at.get(gpu)
        if last is not None and when > last:
            ring.recount((last + when) / 2.0, others)
        self._read_at[gpu] = when
        self._beside[gpu] = others
        return ours + others

    def _publish(
        self,
        gpu: str,
        watts: float,
        joules: float,
        idle: float,
        others: float,
        state: str | None,
    ) -> None:
        m = self.metrics
        labels = self.gpus.labels(gpu)
        current = labels + (gpu,)
        old = self._current.get(gpu)
        if old is not None and old != current:
            _remove(m.gpu_power_current_watts, old)
            if old[2] == "unknown":  # the precision is known now: no stale unknown series
                _remove(m.gpu_energy_joules_total, old)
                _remove(m.gpu_idle_energy_joules_total, old)
                _remove(m.gpu_unattributed_energy_joules_total, old + (NOT_RELAYED,))
                for st in ("idle", "prefill", "decode"):
                    _remove(m.gpu_power_sample_watts, old + (st,))
                joules += self._joules.get(gpu, 0.0)  # the GPU's energy stays counted
                idle += self._idle.get(gpu, 0.0)
                others += self._others.get(gpu, 0.0)
            self._joules[gpu] = self._idle[gpu] = self._others[gpu] = 0.0
        if state is not None:  # a tick whose state changed since the last is in no state
            m.gpu_power_sample_watts.labels(*labels, gpu, state).observe(watts)
        m.gpu_power_current_watts.labels(*current).set(watts)
        self._current[gpu] = current
        pj, pi, po = self._pending.pop(gpu, (0.0, 0.0, 0.0))
        joules, idle, others = joules + pj, idle + pi, others + po
        if joules > 0:
            m.gpu_energy_joules_total.labels(*current).inc(joules)
            self._joules[gpu] = self._joules.get(gpu, 0.0) + joules
        if idle > 0:
            m.gpu_idle_energy_joules_total.labels(*current).inc(idle)
            self._idle[gpu] = self._idle.get(gpu, 0.0) + idle
        if others > 0:
            m.gpu_unattributed_energy_joules_total.labels(*current, NOT_RELAYED).inc(others)
            self._others[gpu] = self._others.get(gpu, 0.0) + others

    # --- what the sensor resolves -------------------------------------------------------

    def sensor_step(self) -> float | None:
        """How often the field energy is taken from refreshes (s), the fastest GPU's;
        None while not learnt."""
        steps = [p for w in list(self.watches.values()) if (p := w.refresh(w.preferred()))]
        return min(steps) if steps else None

    def min_phase(self, gpu: str, now: float | None = None) -> float | None:
        """The shortest phase measured on `gpu` (s); None while not known yet."""
        watch = self.watches.get(gpu)
        if watch is None:
            return None
        return watch.min_phase(self.poll, self.clock() if now is None else now)

    def _learnt(self, now: float) -> None:
        """After the fast first second: the poll interval, the gauges, and one line per
        GPU (again when its resolution changes twofold)."""
        assert self.started is not None
        if now - self.started < PROBE_SECONDS:
            return
        m = self.metrics
        polls = []
        for gpu, watch in self.watches.items():
            use = watch.preferred()
            period = watch.refresh(use)
            polls.append(self.interval if period is None else max(0.02, period / 4.0))
            res = watch.resolution(self.poll, now)
            for name in watch.fields:
                p = watch.refresh(name)
                if p is not None:
                    m.gpu_power_refresh_seconds.labels(gpu, name).set(p)
            for name in watch.fields:
                m.gpu_power_sensor_info.labels(gpu, self.source.name, name).set(
                    1 if name == use else 0
                )
            min_phase = watch.min_phase(self.poll, now)
            ring = self.rings.get(gpu)
            if ring is not None:
                ring.min_phase = min_phase
            if min_phase is not None:
                m.gpu_power_resolution_seconds.labels(gpu).set(min_phase)
            # one line at start, then again when the resolution changes twofold (at most
            # once a minute: a busy machine's late polls are not a new sensor)
            told, told_at = self._told.get(gpu, (None, -1e9))
            changed = told is None or not told / 2 < (res or 0) < told * 2
            if res is not None and changed and (told is None or now - told_at >= 60.0):
                self._told[gpu] = (res, now)
                self._say(gpu, watch, use, period, res)
            elif res is not None:
                self._warn_coarse(res)
        self.poll = min(self.interval, min(polls)) if polls else self.interval

    def _say(self, gpu: str, watch: SensorWatch, use: str, period, res: float) -> None:
        fields = ", ".join(
            f"{n} every {watch.refresh(n):.3g}s" if watch.refresh(n) else f"{n} unchanged"
            for n in sorted(watch.fields)
        )
        min_phase = watch.min_phase(self.poll, self.clock())
        log.info(
            "GPU %s power sensor (%s): %s; phase energy from %s, phases of %.2gs or "
            "longer are measured, shorter ones counted unresolved",
            gpu,
            self.describe,
            fields,
            use,
            min_phase or res,
        )
        self._warn_coarse(res)

    def _warn_coarse(self, res: float) -> None:
        """Once: a sensor too slow for per-request figures, and how to fix it."""
        if res > COARSE_RESOLUTION and not self._warned:
            self._warned = True
            if self.source.name == "dcgm":
                fix = (
                    "run dcgm-exporter with -c 100 and a counters file with "
                    "DCGM_FI_DEV_POWER_USAGE_INSTANT and "
                    "DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION (deploy/dcgm/phasewatch-counters.csv)"
                )
            else:
                fix = "read NVML on the GPU's own host (--power-source nvml)"
            log.warning(
                "GPU power from %s changes only every %.3gs or more: too slow for "
                "per-request phase power, every phase is counted in "
                "phasewatch_gpu_power_unresolved_total; to fix it, %s",
                self.describe,
                res,
                fix,
            )

    def _set_up(self, visible: int, used: int) -> None:
        if self.up is None:
            log.info(
                "GPU power sampled from %s: %d of %d GPUs (learning each field's refresh "
                "period for %gs)",
                self.source.name,
                used,
                visible,
                PROBE_SECONDS,
            )
        elif self.up is False:
            log.info("GPU power sampling from %s resumed", self.source.name)
        self.up = True
        self._up_gauge.set(1)

    def _set_down(self, why: str, permanent: bool = False) -> None:
        if self.up is not False:
            if permanent:
                log.info(
                    "GPU power is not sampled: %s. Requests are relayed and measured as "
                    "usual; for a GPU on another host use --power-source dcgm "
                    "--power-dcgm-url URL",
                    why,
                )
            else:
                log.warning(
                    "GPU power is not being sampled: %s. Requests are still relayed "
                    "and measured; power metrics stay stale until it recovers",
                    why,
                )
        self.up = False
        self._up_gauge.set(0)
        for labels in self._current.values():
            _remove(self.metrics.gpu_power_current_watts, labels)
        self._current.clear()


def _remove(metric, labels: tuple) -> None:
    try:
        metric.remove(*labels)
    except KeyError:
        pass
