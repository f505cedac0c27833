"""What phasewatch's GPU power sensor resolves, and why power may not be sampled at all,
from its own series (a ``/metrics`` page or a Prometheus server's answers): the lines
``report``, ``bench`` and the status page print.

Pure: samples in (:class:`~proxy.measure.summary.Samples`), text out.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .metrics import PREFIX
from .summary import Samples

#: A shortest measured phase above this (s) resolves no request's phase in practice.
COARSE_SECONDS = 5.0
#: What each field is, for a reader.
FIELD_NAMES = {
    "energy_counter": "energy counter",
    "power_instant": "instant power",
    "power_usage": "power usage (a 1 s mean on Ampere and later)",
    "power_average": "1 s mean power",
}
DCGM_FIX = (
    "run dcgm-exporter with -c 100 and deploy/dcgm/phasewatch-counters.csv "
    "(DCGM_FI_DEV_POWER_USAGE_INSTANT and the energy counter)"
)


@dataclass
class GpuSensor:
    gpu: str
    source: str = ""
    field: str = ""
    refresh: float | None = None  # the field's measured refresh period (s)
    min_phase: float | None = None  # the shortest phase measured (s)


@dataclass
class SensorView:
    sampled: bool
    why_not: str = ""
    gpus: list[GpuSensor] = field(default_factory=list)
    unresolved: dict[str, float] = field(default_factory=dict)  # phase -> count
    observed: dict[str, float] = field(default_factory=dict)  # phase -> count
    #: what the counts cover, where not the proxy's whole life ("in this bench's runs")
    scope: str = ""

    def lines(self) -> list[str]:
        """One line per GPU, then the unresolved phases; the fix when too coarse."""
        if not self.sampled:
            return [f"Power: n/a, this phasewatch is not sampling GPU power ({self.why_not})."]
        out = []
        for g in self.gpus:
            every = f", refreshed every {_s(g.refresh)} s" if g.refresh else ""
            phase = (
                f"phases of {_s(g.min_phase)} s or longer measured"
                if g.min_phase is not None
                else "still learning its refresh period"
            )
            name = FIELD_NAMES.get(g.field, g.field or "?")
            out.append(f"GPU {g.gpu} power sensor ({g.source}): {name}{every}; {phase}.")
        if self.unresolved:
            counts = ", ".join(
                f"{ph} {self.unresolved.get(ph, 0):.0f} of "
                f"{self.unresolved.get(ph, 0) + self.observed.get(ph, 0):.0f}"
                for ph in ("prefill", "decode")
            )
            out.append(
                "Phases too short for the sensor (unresolved, no power figure)"
                + (f" {self.scope}" if self.scope else "")
                + ": "
                + counts
                + "."
            )
        coarse = [g for g in self.gpus if (g.min_phase or 0) > COARSE_SECONDS]
        if coarse:
            fix = DCGM_FIX if any(g.source == "dcgm" for g in coarse) else "read NVML on the host"
            out.append(f"The sensor is too slow for per-request figures: {fix}.")
        return out


def _s(seconds: float) -> str:
    return f"{seconds:.0f}" if seconds >= 10 else f"{seconds:.2g}"


def view(samples: Samples) -> SensorView:
    """The sensor as phasewatch's series describe it."""
    up = samples.get(PREFIX + "power_sampling_up")
    if not up:
        return SensorView(False, "it exports no phasewatch_power_sampling_up: no power service")
    if not any(s.value > 0 for s in up):
        sources = sorted({s.labels.get("source", "") for s in up})
        if sources == ["none"]:
            why = "started with --power-source none"
        else:
            why = (
                f"its {', '.join(sources)} power source cannot be read: its log says why "
                "once, in a line starting 'GPU power is not'"
            )
        return SensorView(False, why)
    gpus: dict[str, GpuSensor] = {}
    for s in samples.get(PREFIX + "gpu_power_sensor_info"):
        if s.value > 0:
            g = gpus.setdefault(s.labels.get("gpu", "?"), GpuSensor(s.labels.get("gpu", "?")))
            g.source, g.field = s.labels.get("source", ""), s.labels.get("field", "")
    for s in samples.get(PREFIX + "gpu_power_resolution_seconds"):
        gpu = s.labels.get("gpu", "?")
        if gpu in gpus:
            gpus[gpu].min_phase = s.value
    for s in samples.get(PREFIX + "gpu_power_refresh_seconds"):
        gpu = s.labels.get("gpu", "?")
        if gpu in gpus and s.labels.get("field") == gpus[gpu].field:
            gpus[gpu].refresh = s.value
    v = SensorView(True, gpus=[gpus[k] for k in sorted(gpus)])
    v.unresolved, v.observed = phase_counts(samples)
    return v


def phase_counts(
    samples: Samples, models: set[str] | None = None
) -> tuple[dict[str, float], dict[str, float]]:
    """Request phases unresolved and observed, by phase (of `models` only, where given)."""
    out: tuple[dict[str, float], dict[str, float]] = ({}, {})
    for i, name in enumerate(("gpu_power_unresolved_total", "gpu_power_watts_count")):
        for s in samples.get(PREFIX + name):
            if models is None or s.labels.get("model") in models:
                ph = s.labels.get("phase", "?")
                out[i][ph] = out[i].get(ph, 0.0) + s.value
    return out
