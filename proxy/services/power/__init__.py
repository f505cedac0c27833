"""GPU power, a side service: sources, the sampler thread, energy, per-request phase power.

When power cannot be read, everything else goes on: power series go stale or absent (never
zero), ``phasewatch_power_sampling_up`` is 0, and one log line says why.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ...measure.metrics import Metrics
from .energy import EnergyMeter, Ring, integrate
from .sampler import GpuMap, Owner, PowerSampler, classify
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
    from ...core.upstreams import Upstreams

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class PowerOptions:
    """Where and how often power is read, and which GPU serves what."""

    source: str = "auto"  # auto | nvml | dcgm | none
    dcgm_url: str | None = None
    interval: float = 0.2
    gpu_map: dict[str, str] = field(default_factory=dict)  # GPU -> upstream or model


class PowerService:
    """The power side service as the app sees it: start, stop, and a recorder listener."""

    def __init__(self, options: PowerOptions, metrics: Metrics, upstreams: Upstreams) -> None:
        self.metrics = metrics
        self.sampler: PowerSampler | None = None
        source = choose_source(options.source, options.dcgm_url, options.interval)
        if source is None:
            metrics.power_sampling_up.labels("none").set(0)
            log.info("GPU power is not sampled (--power-source none)")
            return
        gpus = GpuMap(options.gpu_map, upstreams.all, upstreams.route)
        self.sampler = PowerSampler(
            source, metrics, gpus, interval=options.interval, timeout=max(1.0, 4 * options.interval)
        )

    def start(self) -> None:
        if self.sampler is not None:
            self.sampler.start()

    def stop(self) -> None:
        if self.sampler is not None:
            self.sampler.stop()

    def on_request(self, ex: Any, f: Any) -> dict | None:
        """Recorder listener: observes per-phase power and returns the log-line fields."""
        if self.sampler is None or not self.sampler.rings:
            return None
        got = self.sampler.request_power(ex, f.completion_tokens)
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
]
