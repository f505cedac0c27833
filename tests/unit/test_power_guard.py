"""The sensor guard: readings no GPU can produce are refused, counted and logged once; an
energy counter's jumps, jitter and resets are told apart (proxy.services.power.guard)."""

from __future__ import annotations

import logging
import math
import time

import httpx
import pytest

from proxy.measure.metrics import Metrics
from proxy.services.power import DcgmSource, Reading, parse_dcgm
from proxy.services.power.guard import BURST_SECONDS, CounterGuard, SensorGuard, bad_watts
from proxy.services.power.sources import PageTooLarge
from proxy.settings import Settings

from .test_power import Trace, make_sampler, run_ticks, total


def rejected(metrics: Metrics, **labels) -> float:
    return total(metrics, "phasewatch_gpu_sensor_rejected_total", **labels)


def test_impossible_watts():
    assert bad_watts(math.inf, 1000) == "not_finite"
    assert bad_watts(math.nan, 1000) == "not_finite"
    assert bad_watts(-0.5, 1000) == "negative"
    assert bad_watts(1e30, 1000) == "too_high"
    assert bad_watts(999.0, 1000) is None and bad_watts(0.0, 1000) is None


def test_the_cap_is_twice_a_believable_limit():
    g = SensorGuard(3000.0, Metrics())
    assert g.cap(450.0) == 900.0
    assert g.cap(None) == 3000.0
    assert g.cap(1e30) == 3000.0  # a lying limit is not believed
    assert g.cap(1.0) == 3000.0  # nor one that would refuse every honest reading
    assert g.cap(math.nan) == 3000.0


def feed(guard: CounterGuard, values, dt: float = 0.1, cap: float = 1000.0):
    """[(value passed on, why)] for readings `dt` apart."""
    return [guard.see(v, i * dt, cap) for i, v in enumerate(values)]


def test_the_first_value_is_the_base_and_later_steps_count():
    got = feed(CounterGuard(), [5_000, 5_000, 15_000, 25_000])  # 100 W
    assert got == [(5_000, None), (5_000, None), (15_000, None), (25_000, None)]


def test_a_jump_is_refused_once_and_the_counter_goes_on_from_it():
    g = CounterGuard()
    jump = 10**15
    got = feed(g, [0, 10_000, jump + 20_000, jump + 20_000, jump + 30_000, jump + 40_000])
    assert [why for _, why in got] == [None, None, "counter_jump", None, "rebased", None]
    # passed on: never across the jump (None between), so no step ever spans it
    assert [v for v, _ in got] == [0, 10_000, None, None, jump + 30_000, jump + 40_000]


def test_a_jittering_counter_counts_neither_the_jump_nor_the_jump_back():
    g = CounterGuard()
    values = []
    for i in range(200):  # a true 100 W, every other reading 5 kJ ahead
        values.append(i * 10_000 + (5_000_000 if i % 2 else 0))
    got = feed(g, values)
    counted = 0
    last = None
    for v, _ in got:
        if v is not None and last is not None:
            counted += v - last
        last = v
    assert counted / 1000.0 <= 100.0 * 20.0  # at most what 100 W gives over the 20 s
    assert sum(why is not None for _, why in got) >= 90  # each lie refused


def test_a_genuine_reset_is_counted_from_zero():
    g = CounterGuard()
    got = feed(g, [7_000_000, 7_010_000, 7_020_000, 0, 10_000, 20_000])
    assert [why for _, why in got] == [None, None, None, "counter_backwards", "rebased", None]
    assert [v for v, _ in got][-2:] == [10_000, 20_000]


def test_a_wrap_is_a_step():
    g = CounterGuard()
    top = (1 << 64) - 5_000
    assert feed(g, [top - 20_000, top - 10_000, 5_000])[-1] == (5_000, None)


def test_a_slow_counter_steps_by_a_whole_period():
    """An exporter collecting every 30 s: each step is 30 s of a 700 W GPU (cap 1400 W)."""
    g = CounterGuard()
    t, out = 0.0, []
    for k in range(10):
        for _ in range(150):  # polled every 0.2 s, the value held for 30 s
            out.append(g.see(k * 21_000_000, t, 1400.0))
            t += 0.2
    assert all(why is None for _, why in out)
    assert out[-1][0] == 9 * 21_000_000


def test_a_counter_running_fast_is_held_to_the_cap_over_time():
    g = CounterGuard()
    cap, dt = 1000.0, 0.1
    values = [round(i * 1.5 * cap * dt * 1000) for i in range(1000)]  # 1.5x the cap
    got = feed(g, values, dt, cap)
    counted, last = 0, None
    for v, _ in got:
        if v is not None and last is not None:
            counted += v - last
        last = v
    assert counted / 1000.0 <= cap * (1000 * dt + BURST_SECONDS)


def test_the_guard_counts_and_logs_once_per_reason(caplog):
    metrics = Metrics()
    g = SensorGuard(1000.0, metrics)
    caplog.set_level(logging.WARNING, logger="proxy")
    for t in range(3):
        assert g.check("0", Reading(math.inf), float(t)) is None
        assert g.check("0", Reading(100.0, instant=1e30), float(t)) is None
    assert g.check("0", Reading(100.0, average=-1.0), 9.0) is None
    assert g.check("0", Reading(100.0, 5_000.0), 10.0) == Reading(100.0, 5_000)  # the base
    assert rejected(metrics, reason="not_finite") == 3
    assert rejected(metrics, reason="too_high") == 3
    assert rejected(metrics, reason="negative") == 1
    lines = [r.getMessage() for r in caplog.records]
    assert sum("reason=not_finite" in m for m in lines) == 1
    assert sum("reason=too_high" in m for m in lines) == 1
    assert "'0'" in lines[0]  # the wire's GPU name is quoted, never raw


def test_the_dcgm_parser_keeps_what_it_reads_for_the_guard():
    page = (
        'DCGM_FI_DEV_POWER_USAGE{gpu="0"} +Inf\n'
        'DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION{gpu="0"} 1e30\n'
        'DCGM_FI_DEV_POWER_MGMT_LIMIT{gpu="0"} 450\n'
        'DCGM_FI_DEV_POWER_USAGE{gpu="1"} NaN\n'
    )
    got = parse_dcgm(page)
    assert got["0"].watts == math.inf and got["0"].energy_mj == 1e30 and got["0"].limit == 450
    assert math.isnan(got["1"].watts)


def test_a_dcgm_page_is_read_up_to_its_bound():
    def pages(request: httpx.Request) -> httpx.Response:
        line = b'DCGM_FI_DEV_POWER_USAGE{gpu="0"} 100\n'
        if request.url.path == "/told":  # says its length: refused unread
            return httpx.Response(200, content=line * 10_000)
        chunks = (line * 1000 for _ in range(1_000_000))  # 37 GB if read whole
        return httpx.Response(200, content=chunks)

    src = DcgmSource("http://gpu-host/metrics", timeout=1.0, max_bytes=64 << 10)
    src.client = httpx.Client(transport=httpx.MockTransport(pages))
    with pytest.raises(PageTooLarge):
        src.read()
    src.url = "http://gpu-host/told"
    with pytest.raises(PageTooLarge, match="370000 bytes"):
        src.read()
    src.max_bytes = 1 << 20
    assert src.read()["0"].watts == 100.0


def test_a_dcgm_page_is_asked_for_uncompressed_and_refused_compressed():
    asked = []

    def page(request: httpx.Request) -> httpx.Response:
        asked.append(request.headers.get("accept-encoding"))
        gzip = {"Content-Encoding": "gzip"}
        return httpx.Response(200, content=iter([b"\x1f\x8b..."]), headers=gzip)

    src = DcgmSource("http://gpu-host/metrics", timeout=1.0)
    src.client = httpx.Client(transport=httpx.MockTransport(page), headers=src.client.headers)
    with pytest.raises(RuntimeError, match="'gzip' page, not asked for"):
        src.read()
    assert asked == ["identity"]


def test_a_lying_nvml_never_reaches_the_energy(monkeypatch):
    """Through the sampler: every fifth reading lies (Inf is impossible through NVML's
    integers, so: negative, absurd, a counter jump and a counter going back); the energy
    stays the truth's within 1 %, and nothing impossible is shown."""
    tr = Trace(lambda t: 200.0 + 50.0 * math.sin(t / 10), counter_offset_mj=10**9)
    sampler, metrics, _ = make_sampler(monkeypatch, [tr])
    nvml = sampler.source.nvml
    power, energy = nvml.nvmlDeviceGetPowerUsage, nvml.nvmlDeviceGetTotalEnergyConsumption
    k = {"n": 0}

    def lying_power(h):
        k["n"] += 1
        return {1: -7_000, 2: 10**33}.get(k["n"] % 5, power(h))

    def lying_energy(h):
        return energy(h) + {3: 10**15, 4: -5_000_000}.get(k["n"] % 5, 0)

    monkeypatch.setattr(nvml, "nvmlDeviceGetPowerUsage", lying_power)
    monkeypatch.setattr(nvml, "nvmlDeviceGetTotalEnergyConsumption", lying_energy)
    tr.now = 0.0
    sampler.tick()
    shown = []
    last = run_ticks(
        sampler,
        [tr],
        300.0,
        each=lambda t: shown.append(total(metrics, "phasewatch_gpu_power_current_watts")),
    )
    measured = total(metrics, "phasewatch_gpu_energy_joules_total", gpu="0")
    assert measured == pytest.approx(tr.energy(0.0, last), rel=0.01)
    assert all(0 <= w <= 3000 for w in shown)
    for reason in ("negative", "too_high"):
        assert rejected(metrics, gpu="0", reason=reason) > 10, reason
    # the lies and the truth interleaved are two counters, each plausible alone: either
    # may be followed, the other's readings refused; never a step across them
    counter = ("counter_jump", "counter_backwards")
    assert sum(rejected(metrics, gpu="0", reason=r) for r in counter) > 10


def test_settings_for_the_guard(monkeypatch):
    s = Settings(upstream=["a=http://h:1"])
    assert (s.power_max_watts, s.power_dcgm_max_bytes) == (3000.0, 4 << 20)
    monkeypatch.setenv("PHASEWATCH_POWER_MAX_WATTS", "1500")
    monkeypatch.setenv("PHASEWATCH_POWER_DCGM_MAX_BYTES", "65536")
    opts = Settings(upstream=["a=http://h:1"]).power_options()
    assert (opts.power_max_watts, opts.power_dcgm_max_bytes) == (1500.0, 65536)
    with pytest.raises(ValueError):
        Settings(power_max_watts=0)
    with pytest.raises(ValueError):
        Settings(power_dcgm_max_bytes=100)


def test_a_dripped_dcgm_page_is_not_waited_for_past_the_timeout():
    def drip():
        for _ in range(1000):  # 50 s at this pace, each chunk well within a read timeout
            time.sleep(0.05)
            yield b"# x\n"

    src = DcgmSource("http://gpu-host/metrics", timeout=0.2)
    src.client = httpx.Client(
        transport=httpx.MockTransport(lambda r: httpx.Response(200, content=drip()))
    )
    with pytest.raises(RuntimeError, match=r"took over 0\.2s"):
        src.read()
