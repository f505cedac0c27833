"""GPU power, a side service: sources, the sampler thread, energy, per-request phase power.

When power cannot be read, everything else goes on: power series go stale or absent (never
zero), ``phasewatch_power_sampling_up`` is 0, and one log line says why.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ...measure.metrics import Metrics
from .energy import RING_SECONDS, EnergyMeter, Ring, integrate, phase_integral
from .sampler import GpuMap, Owner, PowerSampler, classify, request_power
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
    from ...core.fleet import Upstreams
    from ...core.host import Host

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class PowerOptions:
    """Where and how often power is read, and which GPU serves what."""

    source: str = "auto"  # auto | nvml | dcgm | none
    dcgm_url: str | None = None
    interval: float = 0.2
    gpu_map: dict[str, str] = field(default_factory=dict)  # GPU -> upstream or model


class PowerService:
    """The power side service as the app sees it: start, stop, and a recorder listener.

    In one process it samples and computes each request's power itself. Under
    ``--workers N`` the primary samples into memory shared with every worker
    (:mod:`.shared`), and each worker publishes what it has in flight and computes its
    own requests' power from the shared samples.
    """

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
        source = choose_source(options.source, options.dcgm_url, options.interval)
        if source is None:
            metrics.power_sampling_up.labels("none").set(0)
            if host is None or host.primary:
                log.info("GPU power is not sampled (--power-source none)")
            return
        self.gpus = GpuMap(options.gpu_map, upstreams.all, upstreams.route)
        in_flight = None
        if host is not None:
            capacity = int(RING_SECONDS / options.interval) + 1
            self.rings = SharedRings(host.path("power-rings.bin"), capacity)
            self.shared_in_flight = SharedInFlight(
                host.path("power-in-flight.bin"), host.workers, stale_after=5 * options.interval + 1
            )
            in_flight = self._host_in_flight
        else:
            self.rings = {}
        if host is None or host.primary:
            self.sampler = PowerSampler(
                source,
                metrics,
                self.gpus,
                interval=options.interval,
                timeout=max(1.0, 4 * options.interval),
                rings=self.rings,
                in_flight=in_flight,
            )

    def _host_in_flight(self, gpu: str) -> tuple[int, int]:
        """Every worker's (prefill, decode) on `gpu`, from their published rows."""
        assert self.shared_in_flight is not None and self.rings is not None
        slot = self.rings.slot(gpu)
        if slot is None:  # first sample of this GPU: the workers have not seen it yet
            return self.gpus.counts(gpu)
        return self.shared_in_flight.counts(slot)

    async def _publish_forever(self) -> None:
        """Tell the sampler what this worker has in flight, every sampling interval."""
        assert self.host is not None and self.shared_in_flight is not None
        while True:
            counts = {}
            for gpu, _ in self.rings.items():
                slot = self.rings.slot(gpu)
                if slot is not None:
                    counts[slot] = self.gpus.counts(gpu)
            self.shared_in_flight.publish(self.host.index, counts)
            await asyncio.sleep(self.options.interval / 2)

    def start(self) -> None:
        if self.sampler is not None:
            self.sampler.start()
        if self.shared_in_flight is not None:
            self._publisher = asyncio.create_task(self._publish_forever())

    def stop(self) -> None:
        if self._publisher is not None:
            self._publisher.cancel()
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
        """Recorder listener: observes per-phase power and returns the log-line fields."""
        if not self.rings:
            return None
        got = request_power(self.rings, self.gpus, ex, f.completion_tokens)
        if not got:
            return None
        base = (ex.upstream_name, ex.model_label, ex.precision)
        fields: dict = {}
        for phase in ("prefill", "decode"):
            if phase in got:
                self.metrics.gpu_power_watts.labels(*base, phase).observe(got[phase])
                fields[f"{phase}_watts"] = round(got[phase], 1)
        if "energy" in got:
            fields["energy_j"] = round(got["energy"], 3)
            if got["energy"] > 0:  # the request's share, attributed to its client
                client = getattr(ex, "client", "unknown")
                self.metrics.request_energy_joules_total.labels(*base, client).inc(got["energy"])
        if "joules_per_token" in got:
            fields["joules_per_token"] = round(got["joules_per_token"], 4)
        return fields


__all__ = [
    "DcgmSource",
    "EnergyMeter",
    "GpuMap",
    "NvmlSource",
    "Owner",
    "PowerOptions",
    "PowerSampler",
    "PowerService",
    "PowerUnavailable",
    "Reading",
    "Ring",
    "Source",
    "choose_source",
    "classify",
    "integrate",
    "parse_dcgm",
    "phase_integral",
]
