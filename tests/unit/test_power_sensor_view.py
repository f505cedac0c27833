"""What phasewatch learns of a GPU power sensor, and how report/bench/status say it."""

from __future__ import annotations

import pytest

from proxy.measure.sensor import view
from proxy.measure.summary import Samples
from proxy.services.power.learn import PHASES_PER_RESOLUTION, SensorWatch


def poll(watch: SensorWatch, t0: float, t1: float, step: float, field_period: float) -> None:
    """Poll every `step` s a counter that steps every `field_period` s."""
    t = t0
    while t <= t1:
        watch.see(t, {"energy_counter": float(int(t / field_period)), "power_usage": 100.0})
        t += step


def test_a_100ms_counter_polled_at_25ms():
    w = SensorWatch("nvml")
    poll(w, 0.0, 2.0, 0.025, 0.1)
    assert w.preferred() == "energy_counter"
    assert w.refresh("energy_counter") == pytest.approx(0.1, abs=0.01)
    assert w.refresh("power_usage") is None  # never changed
    # through NVML the counter is read as it is; a DCGM page adds up to a period of lag
    assert w.min_phase(0.025, 2.0) == pytest.approx(PHASES_PER_RESOLUTION * 0.1, rel=0.1)
    d = SensorWatch("dcgm")
    poll(d, 0.0, 2.0, 0.025, 0.1)
    assert d.min_phase(0.025, 2.0) == pytest.approx(PHASES_PER_RESOLUTION * 0.3, rel=0.1)


def test_a_counter_changing_at_every_poll_has_no_page_lag():
    d = SensorWatch("dcgm")
    poll(d, 0.0, 2.0, 0.02, 0.001)
    assert d.min_phase(0.02, 2.0) == pytest.approx(PHASES_PER_RESOLUTION * 0.04, rel=0.1)


def test_a_30s_exporter_is_as_slow_as_its_silence():
    d = SensorWatch("dcgm")
    poll(d, 0.0, 0.5, 0.05, 30.0)
    assert d.resolution(0.05, 0.5) is None  # still probing
    poll(d, 0.55, 6.0, 0.05, 30.0)
    assert d.resolution(0.05, 6.0) >= 6.0  # at least as long as it has been silent


def samples(text: str) -> Samples:
    return Samples.from_text(text)


def test_why_power_is_not_sampled():
    none = view(samples('phasewatch_power_sampling_up{source="none"} 0\n'))
    assert none.lines() == [
        "Power: n/a, this phasewatch is not sampling GPU power (started with --power-source none)."
    ]
    down = view(samples('phasewatch_power_sampling_up{source="nvml"} 0\n'))
    assert "its nvml power source cannot be read" in down.lines()[0]
    assert "no power service" in view(samples("phasewatch_up 1\n")).lines()[0]


def test_the_sensor_lines_name_the_field_its_refresh_and_the_fix():
    page = (
        'phasewatch_power_sampling_up{source="dcgm"} 1\n'
        'phasewatch_gpu_power_sensor_info{gpu="0",source="dcgm",field="energy_counter"} 1\n'
        'phasewatch_gpu_power_sensor_info{gpu="0",source="dcgm",field="power_usage"} 0\n'
        'phasewatch_gpu_power_refresh_seconds{gpu="0",field="energy_counter"} 30\n'
        'phasewatch_gpu_power_resolution_seconds{gpu="0"} 225\n'
        'phasewatch_gpu_power_unresolved_total{upstream="u",model="m",precision="bf16",'
        'phase="decode"} 4\n'
        'phasewatch_gpu_power_unresolved_total{upstream="u",model="m",precision="bf16",'
        'phase="prefill"} 4\n'
    )
    lines = view(samples(page)).lines()
    assert lines[0] == (
        "GPU 0 power sensor (dcgm): energy counter, refreshed every 30 s; phases of "
        "225 s or longer measured."
    )
    assert lines[1] == (
        "Phases too short for the sensor (unresolved, no power figure): prefill 4 of 4, "
        "decode 4 of 4."
    )
    assert "dcgm-exporter with -c 100" in lines[2]
