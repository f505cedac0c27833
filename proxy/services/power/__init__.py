"""GPU power, a side service: sources, the sampler thread, energy, per-request phase power.

When power cannot be read, everything else goes on: power series go stale or absent (never
zero), ``phasewatch_power_sampling_up`` is 0, and one log line says why.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import httpx

from ...measure.metrics import Metrics
from ..engine_state import EngineCounts
from .energy import EnergyMeter
from .fit import EnergyFitter
from .ledger import Entry, InFlightBook, TickRing
from .sampler import GpuMap, Owner, PowerSampler, classify
from .shared import SharedInFlight, SharedRings
from .sources import (
    DcgmSource,
    NvmlSource,
    PowerUnavailable,
    Reading,
    Source,
    choose_source,
    parse_dcgm,
)

if TYPE_CHECKING:
    from ...fleet.host import Host
    from ...fleet.upstreams import Upstreams

log = logging.getLogger(__name__)
#: The follow-up line of each request's settled energy goes beside its request line.
access_log = logging.getLogger("proxy.access")

#: Why a request's phase has no watts (the follow-up line's ``*_unresolved``).
TOO_SHORT = "shorter_than_sensor_resolves"
NOT_SAMPLED = "shorter_than_sampling"
NOT_COVERED = "sensor_never_covered_it"
NO_RESOLUTION = "sensor_resolution_not_known"

#: How often finished requests are checked for a sensor that has covered them (s).
SETTLE_EVERY = 0.05
#: How often a worker publishes what it has in flight (s).
PUBLISH_EVERY = 0.01
#: A finished request the sensor has not covered after this long (s) is unresolved.
GIVE_UP_SECONDS = 60.0


@dataclass(frozen=True, slots=True)
class PowerOptions:
    """Where and how often power is read, and which GPU serves what."""

    power_source: str = "auto"  # auto | nvml | dcgm | none
    power_dcgm_url: str | None = None
    power_interval: float = 0.2
    power_gpu: dict[str, str] = field(default_factory=dict)  # GPU -> upstream or model
    power_max_watts: float = 3000.0  # above it (or 2x a GPU's limit) a reading is refused
    power_dcgm_max_bytes: int = 4 << 20  # a longer DCGM page is refused


def _where(url: str | None) -> str:
    """The DCGM page's scheme, host and path for a log line (no credentials, no query)."""
    if not url:
        return "dcgm"
    u = httpx.URL(url)
    return f"{u.scheme}://{u.host}{':' + str(u.port) if u.port else ''}{u.path}"


class PowerService:
    """The power side service as the app sees it: start, stop, and a recorder listener.

    In one process it samples and computes each request's power itself. Under
    ``--workers N`` the primary samples into memory shared with every worker
    (:mod:`.shared`), and each worker publishes what it has in flight and computes its
    own requests' power from the shared samples.
    """

    #: energy per token by phase from many requests (one process only: it needs every
    #: request on the GPU beside the sampler's steps)
    fitter: EnergyFitter | None = None

    #: Write each request's follow-up energy line (the app turns it off with the access
    #: log).
    access_lines = True

    def __init__(
        self,
        options: PowerOptions,
        metrics: Metrics,
        upstreams: Upstreams,
        host: Host | None = None,
    ) -> None:
        self.metrics = metrics
        self.options = options
        self.host = host
        self.upstreams = upstreams
        self.sampler: PowerSampler | None = None
        self.rings: Any = None
        self.shared_in_flight: SharedInFlight | None = None
        self._publisher: asyncio.Task[None] | None = None
        self._settler: asyncio.Task[None] | None = None
        self._counting: list[asyncio.Task[None]] = []
        self.engine_counts: EngineCounts | None = None
        self.book: InFlightBook | None = None
        source = choose_source(
            options.power_source,
            options.power_dcgm_url,
            options.power_interval,
            options.power_dcgm_max_bytes,
        )
        if source is None:
            metrics.power_sampling_up.labels("none").set(0)
            if host is None or host.primary:
                log.info("GPU power is not sampled (--power-source none)")
            return
        self.gpus = GpuMap(options.power_gpu, upstreams.all, upstreams.route)
        self.worker = 0
        membership = None
        if host is not None:
            self.book = InFlightBook(self.gpus.in_flight)
            self.worker = host.index
            self.rings = SharedRings(host.path("power-rings.bin"), host.workers)
            self.shared_in_flight = SharedInFlight(
                host.path("power-in-flight.bin"), host.workers, stale_after=30.0
            )
            membership = self._host_membership
        else:
            self.rings = {}
        if host is None or host.primary:
            self.sampler = PowerSampler(
                source,
                metrics,
                self.gpus,
                interval=options.power_interval,
                timeout=max(1.0, 4 * options.power_interval),
                rings=self.rings,
                membership=membership,
                describe=_where(options.power_dcgm_url) if source.name == "dcgm" else "",
                max_watts=options.power_max_watts,
            )
            if self.book is None:
                self.book = self.sampler.book
            # the engines' own counts: energy of requests others sent them is not ours
            sampler = self.sampler
            self.engine_counts = EngineCounts(
                metrics, sampler.sensor_step, lambda: sampler.opened and sampler.up is not False
            )
            self.gpus.engine_counts = self.engine_counts
            if host is None:
                self.fitter = EnergyFitter(metrics, self.gpus, self.sampler.clock)
                self.sampler.on_step = self.fitter.on_step
        if host is not None and host.primary:
            log.info(
                "energy per token by phase (GET /phasewatch/api/energy) is fitted with "
                "--workers 1 only: each worker sees only its own requests"
            )

    def _host_membership(self, gpus: list[str], now: float):
        """Every worker's snapshot number and (prefill, decode) per GPU, from their rows."""
        assert self.shared_in_flight is not None and self.rings is not None
        slots = {gpu: self.rings.slot(gpu) for gpu in gpus}
        seqs, by_slot = self.shared_in_flight.read()
        counts = {
            gpu: by_slot.get(slot, (0, 0)) if slot is not None else (0, 0)
            for gpu, slot in slots.items()
        }
        return seqs, counts

    async def _publish_forever(self) -> None:
        """Tell the sampler what this worker has in flight, numbered, every few ms."""
        assert self.host is not None and self.shared_in_flight is not None
        assert self.book is not None
        while True:
            gpus = self.rings.gpus()
            seq, counts = self.book.snapshot(gpus, time.monotonic())
            by_slot = {}
            for gpu, c in counts.items():
                slot = self.rings.slot(gpu)
                if slot is not None:
                    by_slot[slot] = c
            self.shared_in_flight.publish(self.host.index, seq, by_slot)
            await asyncio.sleep(PUBLISH_EVERY)

    def start(self) -> None:
        if self.sampler is not None:
            self.sampler.start()
        if self.engine_counts is not None:
            self._counting = self.engine_counts.start(self.upstreams)
        if self.shared_in_flight is not None:
            self._publisher = asyncio.create_task(self._publish_forever())
        if self.book is not None:
            self._settler = asyncio.create_task(self._settle_forever())
        if self.fitter is not None:
            self.fitter.start()

    def stop(self) -> None:
        for task in (self._publisher, self._settler, *self._counting):
            if task is not None:
                task.cancel()
        if self.fitter is not None:
            self.fitter.stop()
        if self.sampler is not None:
            self.sampler.stop()

    async def check_mapping(self) -> None:
        """Once every upstream's model list was first asked for: warn about each
        ``--power-gpu GPU=TARGET`` whose target no upstream is named or lists (a model
        can only be checked against the lists, so this cannot be refused at start)."""
        if self.sampler is None or not self.sampler.gpus.pairs:
            return
        await asyncio.gather(*(u.probed.wait() for u in self.upstreams.all))
        silent = [u.name for u in self.upstreams.all if not u.up]
        for gpu, target in sorted(self.sampler.gpus.unresolved().items()):
            log.warning(
                "--power-gpu %s=%s: no upstream is named %r or lists a model %r%s; GPU %s's "
                "power is attributed to no request until one does (check the name against "
                "/v1/models, or add it to --models)",
                gpu,
                target,
                target,
                target,
                f" (not answering yet: {', '.join(silent)})" if silent else "",
                gpu,
            )

    def on_request(self, ex: Any, f: Any) -> dict | None:
        """Recorder listener: the request is finished; its power is settled once the
        sensor has covered its end (:meth:`settle`). A request no tick saw in flight was
        shorter than the sampling could resolve."""
        if self.fitter is not None:
            self.fitter.on_request(ex, f)
        book = self.book
        if book is None or not self.rings:  # no power read (yet): no power figures
            return None
        if book.recorded(ex, f.completion_tokens) is None and ex.marks.t_sent is not None:
            phases = tuple(self._windows(ex))
            self._unresolved(ex, phases)
            why: dict[str, float | str] = dict.fromkeys(phases, NOT_SAMPLED)
            self._energy_line(ex, {}, why, NOT_SAMPLED)
        return None

    def energy(self) -> list[dict]:
        """``GET /phasewatch/api/energy``: energy per token by phase, per upstream x model
        x precision (:mod:`.fit`); empty where power is not sampled or the fit cannot run
        (``--workers N``)."""
        return self.fitter.rows() if self.fitter is not None else []

    def _unresolved(self, ex: Any, phases) -> None:
        base = (ex.upstream_name, ex.model_label, ex.precision)
        for phase in phases:
            self.metrics.gpu_power_unresolved_total.labels(*base, phase).inc()

    async def _settle_forever(self) -> None:
        while True:
            await asyncio.sleep(SETTLE_EVERY)
            try:
                self.settle()
            except Exception:
                log.exception("settling requests' power failed")

    def settle(self) -> int:
        """Observe the power of each finished request the sensor has covered; how many."""
        book = self.book
        if book is None:
            return 0
        done = 0
        # the clock the snapshots were taken with (a test's, or the host's monotonic)
        now = self.sampler.clock() if self.sampler is not None else time.monotonic()
        for e in book.ended(now, GIVE_UP_SECONDS):
            got = self._settle_one(e)
            if got or (e.ended is not None and now - e.ended > GIVE_UP_SECONDS):
                if not got:  # the sensor never covered it (power went down)
                    left = self._windows(e.ex).keys() - e.decided
                    self._unresolved(e.ex, sorted(left))
                    why: dict[str, float | str] = dict.fromkeys(self._windows(e.ex), NOT_COVERED)
                    self._energy_line(e.ex, {}, why, NOT_COVERED)
                book.drop(e)
                done += 1
        return done

    @staticmethod
    def _windows(ex: Any) -> dict[str, tuple[float, float]]:
        """The request's phases by the proxy's marks (absent: no such phase)."""
        mk = ex.marks
        end = mk.t_end if mk.t_end is not None else mk.t_last
        out = {}
        if mk.t_sent is not None and mk.t_first is not None and mk.t_first > mk.t_sent:
            out["prefill"] = (mk.t_sent, mk.t_first)
        start = mk.t_first if mk.t_first is not None else mk.t_sent
        if start is not None and end is not None and end > start:
            out["decode"] = (start, end)
        return out

    def _settle_one(self, e: Entry) -> bool:
        ex = e.ex
        base = (ex.upstream_name, ex.model_label, ex.precision)
        m = self.metrics
        rings = [self.rings.get(gpu) for gpu in e.gpus]
        if any(r is None for r in rings):
            return False
        windows = self._windows(ex)
        mins = [r.min_phase for r in rings]
        # a phase the sensor cannot resolve is said so at once, not when it has covered it
        for phase, (a, b) in windows.items():
            known = phase not in e.decided and all(x is not None for x in mins)
            if known and b - a < max(x for x in mins if x is not None):
                e.decided.add(phase)
                m.gpu_power_unresolved_total.labels(*base, phase).inc()
        sums = []
        for ring in rings:
            got = ring.settle(self.worker, e)
            if got is None:
                return False
            sums.append(got)
        total = 0.0
        shares: dict[str, float] = {}
        watts: dict[str, float | str] = {}  # phase -> watts, or why not
        for phase in ("prefill", "decode"):
            joules = sum(s[phase].joules for s in sums)
            share = sum(s[phase].share for s in sums)
            seconds = max((s[phase].seconds for s in sums), default=0.0)
            total += share
            if share > 0:
                m.request_phase_energy_joules_total.labels(*base, phase).inc(share)
            if phase not in windows:
                continue
            shares[phase] = share
            if phase in e.decided:
                watts[phase] = TOO_SHORT
            elif seconds > 0 and all(x is not None for x in mins):
                watts[phase] = joules / seconds
                m.gpu_power_watts.labels(*base, phase).observe(joules / seconds)
            else:
                watts[phase] = NO_RESOLUTION if seconds > 0 else TOO_SHORT
                m.gpu_power_unresolved_total.labels(*base, phase).inc()
        if total > 0:  # the request's share, attributed to its client
            client = getattr(ex, "client", "unknown")
            m.request_energy_joules_total.labels(*base, client).inc(total)
        self._energy_line(ex, shares, watts, None)
        return True

    def _energy_line(
        self, ex: Any, shares: dict[str, float], watts: dict[str, float | str], why: str | None
    ) -> None:
        """The request's settled energy, keyed by its request id: its share of the GPU's
        energy by phase (``*_j``), the GPU's mean draw over each phase (``*_w``) or why
        it has none (``*_unresolved``); ``energy_unresolved`` when nothing settled. One
        line, after the request's own line (energy settles once the sensor covers its
        end), and a count per client of the requests settled and unresolved."""
        client = getattr(ex, "client", "unknown")
        base = (ex.upstream_name, ex.model_label, ex.precision)
        result = "unresolved" if why is not None else "settled"
        self.metrics.request_energy_requests_total.labels(*base, client, result).inc()
        if not (self.access_lines and access_log.isEnabledFor(logging.INFO)):
            return
        fields: dict[str, object] = {
            "request_id": ex.request_id,
            "client": client,
            "upstream": base[0],
            "model": base[1],
            "precision": base[2],
        }
        if why is not None:
            fields["energy_unresolved"] = why
        else:
            fields["energy_j"] = round(sum(shares.values()), 3)
        for phase in ("prefill", "decode"):
            if phase in shares:
                fields[f"{phase}_j"] = round(shares[phase], 3)
            got = watts.get(phase)
            if isinstance(got, float):
                fields[f"{phase}_w"] = round(got, 1)
            elif got is not None:
                fields[f"{phase}_unresolved"] = got
        access_log.info("energy", extra={"fields": fields})


__all__ = [
    "DcgmSource",
    "EnergyFitter",
    "EnergyMeter",
    "Entry",
    "GpuMap",
    "InFlightBook",
    "NvmlSource",
    "Owner",
    "PowerOptions",
    "PowerSampler",
    "PowerService",
    "PowerUnavailable",
    "Reading",
    "Source",
    "TickRing",
    "choose_source",
    "classify",
    "parse_dcgm",
]
