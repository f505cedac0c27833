"""The power series never carry a precision that was only not detected yet: a GPU's
samples wait for its upstream's first model list, and a series that was labelled
``unknown`` goes once the precision is known, its energy carried to the new series."""

from __future__ import annotations

import threading
from types import SimpleNamespace

from proxy.measure.metrics import Metrics
from proxy.measure.precision import Precision
from proxy.services.power import GpuMap, PowerSampler
from proxy.services.power.sources import Reading


class FixedSource:
    """One GPU drawing 100 W, its energy counter advancing 100 J per second of the clock."""

    name = "fixed"

    def __init__(self, clock: list[float]) -> None:
        self.clock = clock

    def open(self) -> None:
        pass

    def read(self) -> dict[str, Reading]:
        return {"0": Reading(100.0, int(self.clock[0] * 100_000))}

    def close(self) -> None:
        pass


def upstream(precisions: dict[str, str], probed: bool) -> SimpleNamespace:
    event = threading.Event()
    if probed:
        event.set()
    return SimpleNamespace(
        name="gpu0",
        active=set(),
        models={"m"},
        configured_models=set(),
        precision_of=lambda m: Precision(precisions.get(m, "unknown")),
        serves=lambda m: m == "m",
        probed=event,
    )


def series(metrics: Metrics, name: str) -> dict[str, float]:
    """precision -> summed value of the family's samples called `name`."""
    out: dict[str, float] = {}
    for family in metrics.registry.collect():
        for s in family.samples:
            if s.name == name:
                p = s.labels["precision"]
                out[p] = out.get(p, 0.0) + s.value
    return out


def sampler_for(up: SimpleNamespace) -> tuple[PowerSampler, Metrics, list[float]]:
    clock = [0.0]
    metrics = Metrics()
    gpus = GpuMap({"0": "m"}, [up], lambda model: up)
    sampler = PowerSampler(
        FixedSource(clock), metrics, gpus, interval=1.0, timeout=1.0, clock=lambda: clock[0]
    )
    assert sampler.open()
    return sampler, metrics, clock


def ticks(sampler: PowerSampler, clock: list[float], n: int) -> None:
    for _ in range(n):
        clock[0] += 1.0
        sampler.tick()


def test_no_unknown_series_before_the_first_model_list_and_no_energy_lost():
    precisions: dict[str, str] = {}
    up = upstream(precisions, probed=False)
    sampler, metrics, clock = sampler_for(up)
    ticks(sampler, clock, 5)  # the engine has not listed its models yet
    assert series(metrics, "phasewatch_gpu_power_sample_watts_count") == {}
    assert series(metrics, "phasewatch_gpu_energy_joules_total") == {}
    precisions["m"] = "bf16"  # the model list says what it serves
    up.probed.set()
    ticks(sampler, clock, 5)
    assert set(series(metrics, "phasewatch_gpu_power_sample_watts_count")) == {"bf16"}
    energy = series(metrics, "phasewatch_gpu_energy_joules_total")
    assert set(energy) == {"bf16"}
    # 9 s of the counter since the first reading, none of it dropped while waiting
    assert abs(energy["bf16"] - 900.0) < 1e-6, energy


def test_an_unknown_series_goes_once_the_precision_is_detected():
    precisions: dict[str, str] = {}
    up = upstream(precisions, probed=True)  # listed, but its precision not read yet
    sampler, metrics, clock = sampler_for(up)
    ticks(sampler, clock, 4)
    assert set(series(metrics, "phasewatch_gpu_power_sample_watts_count")) == {"unknown"}
    precisions["m"] = "int4"  # the engine's config says int4
    ticks(sampler, clock, 4)
    assert set(series(metrics, "phasewatch_gpu_power_sample_watts_count")) == {"int4"}
    assert set(series(metrics, "phasewatch_gpu_power_current_watts")) == {"int4"}
    energy = series(metrics, "phasewatch_gpu_energy_joules_total")
    assert set(energy) == {"int4"}
    assert abs(energy["int4"] - 700.0) < 1e-6, energy  # 7 s since the first reading
