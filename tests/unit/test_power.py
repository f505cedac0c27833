"""GPU power without a GPU: NVML replaced at the ``pynvml`` boundary by a scripted trace.

The sampler is driven tick by tick on a fake clock, so energy, classification and the
per-phase means are compared with the trace's exact values; the hang test uses real
threads and a real clock.
"""

from __future__ import annotations

import logging
import math
import random
import sys
import threading
import time
import types
from types import SimpleNamespace

import pytest

from proxy.measure.metrics import Metrics
from proxy.measure.precision import Precision
from proxy.measure.timeline import Marks
from proxy.services.power import (
    EnergyMeter,
    GpuMap,
    NvmlSource,
    PowerSampler,
    PowerService,
    Reading,
    parse_dcgm,
)
from proxy.settings import Settings

# --- a scripted NVML -----------------------------------------------------------------------


class Trace:
    """Power of one GPU over (fake) time, its exact energy, and scripted failures."""

    def __init__(
        self,
        power,
        *,
        counter_offset_mj: int = 0,
        reset_at: float | None = None,
        counter: bool = True,
    ) -> None:
        self.power = power  # t -> watts
        self.now = 0.0
        self.offset = counter_offset_mj
        self.reset_at = reset_at
        self.counter = counter
        self.fail_between: tuple[float, float] | None = None
        self.energy_fail_between: tuple[float, float] | None = None
        self.hang = threading.Event()  # set: power reads block until `release` is set
        self.release = threading.Event()

    def energy(self, a: float, b: float, step: float = 0.001) -> float:
        """Exact-enough energy (J) over [a, b]: midpoint rule at 1 ms."""
        n = max(1, round((b - a) / step))
        h = (b - a) / n
        return sum(self.power(a + (i + 0.5) * h) for i in range(n)) * h

    def counter_mj(self) -> int:
        """What the device's counter reads now (time only moves forward in these tests)."""
        start = 0.0 if self.reset_at is None or self.now < self.reset_at else self.reset_at
        if getattr(self, "_start", None) != start:
            self._start, self._t, self._e = start, start, 0.0
        self._e += self.energy(self._t, self.now)
        self._t = self.now
        base = self.offset if start == 0.0 else 0
        return (base + int(self._e * 1000)) % (1 << 64)


def fake_pynvml(traces: list[Trace]) -> types.ModuleType:
    mod = types.ModuleType("pynvml")

    class NVMLError(Exception):
        pass

    class NVMLError_NotSupported(NVMLError):
        pass

    class NVMLError_GpuIsLost(NVMLError):
        pass

    mod.NVMLError = NVMLError
    mod.NVMLError_NotSupported = NVMLError_NotSupported
    mod.nvmlInit = lambda: None
    mod.nvmlShutdown = lambda: None
    mod.nvmlDeviceGetCount = lambda: len(traces)
    mod.nvmlDeviceGetHandleByIndex = lambda i: traces[i]

    def power(tr: Trace) -> int:
        if tr.hang.is_set():
            tr.release.wait(30)
        if tr.fail_between and tr.fail_between[0] <= tr.now < tr.fail_between[1]:
            raise NVMLError_GpuIsLost("GPU is lost")
        return round(tr.power(tr.now) * 1000)

    def energy(tr: Trace) -> int:
        if not tr.counter:
            raise NVMLError_NotSupported("Not Supported")
        if (
            tr.energy_fail_between
            and tr.energy_fail_between[0] <= tr.now < tr.energy_fail_between[1]
        ):
            raise NVMLError("Unknown Error")
        return tr.counter_mj()

    mod.nvmlDeviceGetPowerUsage = power
    mod.nvmlDeviceGetTotalEnergyConsumption = energy
    return mod


def fake_upstream(name: str = "gpu0", models=("m-bf16",)) -> SimpleNamespace:
    precisions = {"m-bf16": "bf16", "m-int4": "int4", "m-fp8": "fp8"}
    return SimpleNamespace(
        name=name,
        active=set(),
        models=set(models),
        configured_models=set(),
        precision_of=lambda m: Precision(precisions.get(m, "unknown")),
        serves=lambda m: m in models,
    )


def make_sampler(
    monkeypatch, traces, upstreams=None, pairs=None, interval=0.2, timeout=1.0, clock=None
):
    monkeypatch.setitem(sys.modules, "pynvml", fake_pynvml(traces))
    ups = upstreams or [fake_upstream()]
    gpus = GpuMap(pairs or {}, ups, lambda model: ups[0])
    metrics = Metrics()
    sampler = PowerSampler(
        NvmlSource(),
        metrics,
        gpus,
        interval=interval,
        timeout=timeout,
        clock=clock or (lambda: traces[0].now),
    )
    assert sampler.open()
    return sampler, metrics, ups


def value(metrics: Metrics, name: str, **labels) -> float | None:
    return metrics.registry.get_sample_value(name, labels) if labels else None


def total(metrics: Metrics, name: str, **labels) -> float:
    out = 0.0
    for family in metrics.registry.collect():
        for s in family.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                out += s.value
    return out


def run_ticks(
    sampler, traces, t_end: float, step=lambda rng: rng.uniform(0.15, 0.25), seed=1, each=None
) -> float:
    """Ticks until t_end; returns the time of the last one."""
    rng = random.Random(seed)
    t = traces[0].now
    while True:
        nxt = t + step(rng)
        if nxt > t_end:
            return t
        t = nxt
        for tr in traces:
            tr.now = t
        if each is not None:
            each(t)
        sampler.tick()


def busy_trace(t: float) -> float:
    """Idle, a decode plateau with ripple, prefill bursts, a lower plateau."""
    if t < 100:
        return 60.0
    if t < 300:
        return 350.0 + 20.0 * math.sin(t)
    if t < 320:
        return 420.0 if int(t) % 4 < 2 else 90.0
    return 200.0 + 0.1 * (t - 320)


# --- energy ------------------------------------------------------------------------------------


def test_energy_from_counter_survives_wrap_reset_and_errors(monkeypatch, caplog):
    # The counter starts 2 kJ short of 2**64 mJ (wraps near t=105) and resets (driver
    # reload) at t=400; NVML fails for 2 s at t=200 and the energy call alone at t=250.
    tr = Trace(busy_trace, counter_offset_mj=(1 << 64) - 2_000_000, reset_at=400.0)
    tr.fail_between = (200.0, 202.0)
    tr.energy_fail_between = (250.0, 250.6)
    sampler, metrics, _ = make_sampler(monkeypatch, [tr])
    caplog.set_level(logging.INFO, logger="proxy")
    tr.now = 0.0
    sampler.tick()  # the baseline
    last = run_ticks(sampler, [tr], 600.0)
    measured = total(metrics, "phasewatch_gpu_energy_joules_total", gpu="0")
    truth = tr.energy(0.0, last)
    assert measured == pytest.approx(truth, rel=0.01)
    # Wrap and errors cost nothing with a counter; the reset interval is integrated.
    assert measured == pytest.approx(truth, rel=0.001)
    # The 2 s of errors: said once, said once when it came back, gauge back to 1.
    down = [r for r in caplog.records if "not being sampled" in r.getMessage()]
    assert len(down) == 1 and "GPU is lost" in down[0].getMessage()
    assert sum("resumed" in r.getMessage() for r in caplog.records) == 1
    assert value(metrics, "phasewatch_power_sampling_up", source="nvml") == 1.0


def test_energy_integrated_when_there_is_no_counter(monkeypatch):
    tr = Trace(busy_trace, counter=False)
    tr.fail_between = (200.0, 202.0)
    sampler, metrics, _ = make_sampler(monkeypatch, [tr])
    sampler.tick()
    last = run_ticks(sampler, [tr], 600.0)
    measured = total(metrics, "phasewatch_gpu_energy_joules_total", gpu="0")
    assert measured == pytest.approx(tr.energy(0.0, last), rel=0.01)


def test_energy_meter_rules():
    m = EnergyMeter()
    assert m.step(0.0, 100.0, 5_000) == 0.0  # first reading is the baseline
    assert m.step(1.0, 100.0, 105_000) == pytest.approx(100.0)  # counter: 100 J
    assert m.step(2.0, 300.0, None) == pytest.approx(200.0)  # no counter: trapezoid
    assert m.step(3.0, 300.0, 500_000) == pytest.approx(300.0)  # no baseline: trapezoid
    assert m.step(4.0, 300.0, 100) == pytest.approx(300.0)  # reset: trapezoid
    assert m.step(5.0, 300.0, 300_100) == pytest.approx(300.0)  # counter again
    m.step(6.0, 300.0, (1 << 32) - 100_000)
    assert m.step(7.0, 300.0, 200_000) == pytest.approx(300.0)  # a 32-bit wrap
    assert m.step(7.0 + 3600.0, 300.0, None) == 0.0  # an hour's gap is not made up


# --- classification and per-request power -------------------------------------------------------


class FakeExchange(SimpleNamespace):
    __hash__ = object.__hash__  # in a set, like the relay's Exchange
    __eq__ = object.__eq__

    @property
    def upstream_name(self):
        return self.upstream.name

    @property
    def precision(self):
        return self.upstream.precision_of(self.model_label).precision


class Scenario:
    """Requests on one GPU with power set by what runs: idle 50 W, prefill 400 W, decode
    300 W; marks and the upstream's in-flight set follow the fake clock."""

    IDLE, PREFILL, DECODE = 50.0, 400.0, 300.0

    def __init__(self, upstream, spans):
        self.upstream = upstream
        self.spans = spans  # (sent, first, last, stream)
        self.exchanges = [
            FakeExchange(
                upstream=upstream,
                model_label="m-bf16",
                prepared=SimpleNamespace(stream=stream),
                marks=Marks(t_recv=sent),
                client=f"c{i}",
                request_id=f"r{i}",  # the follow-up energy line is keyed by it
            )
            for i, (sent, first, last, stream) in enumerate(spans)
        ]

    def power(self, t: float) -> float:
        states = [
            ("prefill" if t < first else "decode")
            for sent, first, last, _ in self.spans
            if sent <= t < last
        ]
        if "prefill" in states:
            return self.PREFILL
        return self.DECODE if states else self.IDLE

    def advance(self, t: float) -> None:
        for ex, (sent, first, last, _) in zip(self.exchanges, self.spans):
            if sent <= t < last:
                self.upstream.active.add(ex)
                ex.marks.t_admit = ex.marks.t_sent = sent
                if t >= first and ex.prepared.stream:
                    ex.marks.t_first = first
            elif t >= last:
                self.upstream.active.discard(ex)
                ex.marks.t_admit = ex.marks.t_sent = sent
                if ex.prepared.stream:
                    ex.marks.t_first, ex.marks.t_last = first, last
                ex.marks.t_end = last


def run_scenario(monkeypatch, upstream, spans, until: float):
    """`spans` on one GPU sampled every 0.1 s at x.x5 (the steps fall between samples, as
    they would) until `until`: the scenario, its trace, the sampler and its metrics."""
    sc = Scenario(upstream, spans)
    tr = Trace(sc.power)
    sampler, metrics, _ = make_sampler(monkeypatch, [tr], upstreams=[upstream])
    tr.now = 0.05
    sc.advance(tr.now)
    sampler.tick()
    run_ticks(sampler, [tr], until, step=lambda rng: 0.1, each=sc.advance)
    return sc, tr, sampler, metrics


def settle(sampler, metrics, exchanges, completion_tokens=100) -> PowerService:
    """The service's listener and settling, on this sampler's rings."""
    service = PowerService.__new__(PowerService)
    service.metrics, service.sampler, service.book = metrics, sampler, sampler.book
    service.rings, service.gpus, service.worker = sampler.rings, sampler.gpus, 0
    for ex in exchanges:
        service.on_request(ex, SimpleNamespace(completion_tokens=completion_tokens))
    service.settle()
    return service


def test_samples_are_classified_and_phase_power_matches_the_trace(monkeypatch):
    up = fake_upstream()
    sc, tr, sampler, metrics = run_scenario(monkeypatch, up, [(10.0, 12.0, 20.0, True)], 30.0)

    counts = {
        s: total(metrics, "phasewatch_gpu_power_sample_watts_count", state=s)
        for s in ("idle", "prefill", "decode")
    }
    # a tick whose state changed since the last is in no state (idle->prefill->decode)
    # a sample is a state's once the state has held as long as a reading may describe
    # (the counter's 0.1 s refresh and NVML's power usage, a 1 s mean): the first 1.1 s
    # of each state (and the first second's learning) are in no state
    assert counts == {"idle": 177, "prefill": 8, "decode": 68}
    sums = {s: total(metrics, "phasewatch_gpu_power_sample_watts_sum", state=s) for s in counts}
    assert sums["idle"] / counts["idle"] == pytest.approx(50.0)
    assert sums["prefill"] / counts["prefill"] == pytest.approx(400.0)
    assert sums["decode"] / counts["decode"] == pytest.approx(300.0)
    labels = dict(upstream="gpu0", model="m-bf16", precision="bf16", gpu="0")
    assert value(metrics, "phasewatch_gpu_power_current_watts", **labels) == 50.0
    # the sensor learnt: a counter refreshed at every 0.1 s poll
    assert sampler.watches["0"].preferred() == "energy_counter"
    assert sampler.watches["0"].refresh("energy_counter") == pytest.approx(0.1)

    settle(sampler, metrics, sc.exchanges)
    hist = dict(upstream="gpu0", model="m-bf16", precision="bf16")
    assert value(metrics, "phasewatch_gpu_power_watts_count", phase="prefill", **hist) == 1.0
    # the request is charged from the first tick that saw it: up to a tick late
    assert value(
        metrics, "phasewatch_gpu_power_watts_sum", phase="prefill", **hist
    ) == pytest.approx(400.0, rel=0.02)
    assert value(
        metrics, "phasewatch_gpu_power_watts_sum", phase="decode", **hist
    ) == pytest.approx(300.0, rel=0.01)
    exact = tr.energy(10.0, 20.0)  # 2 s x 400 W + 8 s x 300 W
    got = total(metrics, "phasewatch_request_energy_joules_total", client="c0")
    assert got == pytest.approx(exact, rel=0.01)
    # conservation: the request's share plus idle is the counter's energy
    assert total(metrics, "phasewatch_request_phase_energy_joules_total") + total(
        metrics, "phasewatch_gpu_idle_energy_joules_total"
    ) == pytest.approx(total(metrics, "phasewatch_gpu_energy_joules_total"), abs=1e-6)


def test_a_short_prefill_reads_the_prefill_draw_and_a_shorter_one_is_unresolved(monkeypatch):
    """A 0.3 s prefill sampled every 0.1 s after an idle GPU reads the prefill's draw, not
    a blend with idle; a 0.15 s one is shorter than the sensor resolves: counted, not
    observed."""
    up = fake_upstream()
    spans = [(10.0, 10.3, 12.0, True), (20.0, 20.15, 22.0, True)]
    sc, tr, sampler, metrics = run_scenario(monkeypatch, up, spans, 25.0)
    assert sampler.min_phase("0") == pytest.approx(0.25, rel=0.05)
    settle(sampler, metrics, sc.exchanges)
    hist = dict(upstream="gpu0", model="m-bf16", precision="bf16")
    assert value(metrics, "phasewatch_gpu_power_watts_count", phase="prefill", **hist) == 1.0
    assert value(
        metrics, "phasewatch_gpu_power_watts_sum", phase="prefill", **hist
    ) == pytest.approx(Scenario.PREFILL, rel=0.05)  # ticks 0.1 s apart: one holds the edge
    assert value(metrics, "phasewatch_gpu_power_unresolved_total", phase="prefill", **hist) == 1
    assert value(metrics, "phasewatch_gpu_power_watts_count", phase="decode", **hist) == 2.0
    # the requests' energy still follows the trace across their whole lives (from the
    # first tick that saw it in flight: the 0.05 s before it went to idle)
    got = total(metrics, "phasewatch_request_energy_joules_total", client="c0")
    assert got == pytest.approx(tr.energy(10.05, 12.05), rel=0.001)


def test_a_sample_is_a_states_only_once_the_reading_can_show_it(monkeypatch):
    """NVML's power usage is a 1 s mean: a sample read within a second of a change blends
    the state before, so it joins neither state's histogram (a short phase's samples would
    otherwise read the power of the phase before it), and the state means are exact."""
    up = fake_upstream()
    sc = Scenario(up, [(10.0, 10.0, 13.0, False)])  # decode 10 s - 13 s, idle around

    def mean_1s(t: float) -> float:
        return sum(sc.power(t - 1.0 + (i + 0.5) * 0.01) for i in range(100)) / 100

    tr = Trace(mean_1s)
    sampler, metrics, _ = make_sampler(monkeypatch, [tr], upstreams=[up])
    tr.now = 0.05
    sc.advance(tr.now)
    sampler.tick()
    run_ticks(sampler, [tr], 16.0, step=lambda rng: 0.1, each=sc.advance)
    count, sums = "phasewatch_gpu_power_sample_watts_count", "phasewatch_gpu_power_sample_watts_sum"
    for state, watts in (("decode", Scenario.DECODE), ("idle", Scenario.IDLE)):
        n = total(metrics, count, state=state)
        assert n > 0, state
        assert total(metrics, sums, state=state) / n == pytest.approx(watts), state
    # the decode's 30 ticks less the reading's 1.1 s (to a tick)
    assert total(metrics, count, state="decode") == pytest.approx(19, abs=1)


def test_energy_is_shared_among_requests_in_flight(monkeypatch):
    up = fake_upstream()
    # B overlaps A's second half; a non-streamed C alone later (no prefill, all decode);
    # D lies between two ticks: no tick saw it, so its phases are unresolved.
    spans = [
        (10.0, 10.5, 20.0, True),
        (15.0, 15.5, 20.0, True),
        (30.0, 30.0, 40.0, False),
        (50.0, 50.01, 50.05, True),
    ]
    sc, tr, sampler, metrics = run_scenario(monkeypatch, up, spans, 60.0)
    settle(sampler, metrics, sc.exchanges, completion_tokens=10)
    a, b, c, d = (
        total(metrics, "phasewatch_request_energy_joules_total", client=f"c{i}") for i in range(4)
    )
    # A alone for 5 s, then A and B split 5 s of power.
    alone, shared = tr.energy(10.0, 15.0), tr.energy(15.0, 20.0)
    assert a == pytest.approx(alone + shared / 2, rel=0.02)
    assert b == pytest.approx(shared / 2, rel=0.02)
    assert a + b == pytest.approx(tr.energy(10.0, 20.0), rel=0.01)
    # Non-streamed: decode while in flight; energy over [sent, end].
    assert c == pytest.approx(tr.energy(30.0, 40.0), rel=0.01)
    hist = dict(upstream="gpu0", model="m-bf16", precision="bf16")
    assert value(metrics, "phasewatch_gpu_power_watts_count", phase="decode", **hist) == 3.0
    assert d == 0.0
    assert value(metrics, "phasewatch_gpu_power_unresolved_total", phase="prefill", **hist) == 1
    assert value(metrics, "phasewatch_gpu_power_unresolved_total", phase="decode", **hist) == 1
    # conservation
    assert a + b + c + total(metrics, "phasewatch_gpu_idle_energy_joules_total") == (
        pytest.approx(total(metrics, "phasewatch_gpu_energy_joules_total"), abs=1e-6)
    )


class Counts:
    """The engine's own count of what it holds, scripted (EngineCounts' interface)."""

    def __init__(self, spans, clock) -> None:
        self.spans, self.clock = spans, clock

    def of(self, upstream, model):
        t = self.clock()
        return float(sum(1 for sent, _, last, _ in self.spans if sent <= t < last)), t, t


def test_energy_of_requests_not_relayed_here_is_unattributed(monkeypatch):
    up = fake_upstream()
    # A and B are relayed here; X, sent to the engine by someone else, runs beside them:
    # the engine counts all three, phasewatch sees two.
    mine = [(10.0, 10.5, 20.0, True), (14.0, 14.5, 22.0, True)]
    x = (12.0, 12.5, 26.0, True)
    gpu = Scenario(up, mine + [x])  # the GPU's power follows all three
    relayed = Scenario(up, mine)  # only A and B pass through phasewatch
    tr = Trace(gpu.power)
    sampler, metrics, _ = make_sampler(monkeypatch, [tr], upstreams=[up])
    sampler.gpus.engine_counts = Counts(mine + [x], lambda: tr.now)
    tr.now = 0.05
    relayed.advance(tr.now)
    sampler.tick()
    run_ticks(sampler, [tr], 35.0, step=lambda rng: 0.1, each=relayed.advance)
    settle(sampler, metrics, relayed.exchanges, completion_tokens=10)
    a, b = (
        total(metrics, "phasewatch_request_energy_joules_total", client=f"c{i}") for i in range(2)
    )
    # truth: each moment's energy split evenly among the requests the engine ran
    true_a = tr.energy(10.0, 12.0) + tr.energy(12.0, 14.0) / 2 + tr.energy(14.0, 20.0) / 3
    true_b = tr.energy(14.0, 20.0) / 3 + tr.energy(20.0, 22.0) / 2
    assert a == pytest.approx(true_a, rel=0.03)
    assert b == pytest.approx(true_b, rel=0.03)
    others = total(metrics, "phasewatch_gpu_unattributed_energy_joules_total", reason="not_relayed")
    true_x = (
        tr.energy(12.0, 14.0) / 2
        + tr.energy(14.0, 20.0) / 3
        + tr.energy(20.0, 22.0) / 2
        + tr.energy(22.0, 26.0)
    )
    assert others == pytest.approx(true_x, rel=0.03)
    # X alone after B ended (22-26 s) is busy, not idle; conservation holds
    idle = total(metrics, "phasewatch_gpu_idle_energy_joules_total")
    assert idle == pytest.approx(tr.energy(0.05, 10.0) + tr.energy(26.0, 35.0), rel=0.05)
    assert a + b + others + idle == pytest.approx(
        total(metrics, "phasewatch_gpu_energy_joules_total"), abs=1e-6
    )


def test_gpu_map_labels_by_upstream_model_and_sharing():
    a = fake_upstream("a", ("m-bf16",))
    b = fake_upstream("b", ("m-int4", "m-fp8"))
    shared = GpuMap({}, [a, b], lambda m: a)
    assert shared.labels("0") == ("a+b", "all", "mixed")
    by_model = GpuMap({"0": "a", "1": "m-int4", "2": "b"}, [a, b], lambda m: b)
    assert by_model.labels("0") == ("a", "m-bf16", "bf16")
    assert by_model.labels("1") == ("b", "m-int4", "int4")
    assert by_model.labels("2") == ("b", "all", "mixed")
    assert by_model.owners("3") == ()  # a mapping leaves GPU 3 out: not sampled
    ex = SimpleNamespace(upstream=b, model_label="m-fp8")
    assert [g for g in "0123" if by_model.serves(g, ex)] == ["2"]


def test_unmapped_gpus_are_not_sampled(monkeypatch):
    traces = [Trace(lambda t: 100.0), Trace(lambda t: 200.0)]
    up = fake_upstream("a", ("m-int4",))
    sampler, metrics, _ = make_sampler(monkeypatch, traces, upstreams=[up], pairs={"1": "a"})
    sampler.tick()
    assert total(metrics, "phasewatch_gpu_power_sample_watts_count", gpu="0") == 0
    assert (
        value(
            metrics,
            "phasewatch_gpu_power_current_watts",
            upstream="a",
            model="m-int4",
            precision="int4",
            gpu="1",
        )
        == 200.0
    )


# --- failure ----------------------------------------------------------------------------------------


def test_a_hung_nvml_call_costs_a_timeout_then_sampling_resumes(monkeypatch, caplog):
    tr = Trace(lambda t: 123.0)
    sampler, metrics, _ = make_sampler(monkeypatch, [tr], timeout=0.3, clock=time.monotonic)
    caplog.set_level(logging.INFO, logger="proxy")
    sampler.tick()
    labels = dict(upstream="gpu0", model="m-bf16", precision="bf16", gpu="0")
    assert value(metrics, "phasewatch_gpu_power_current_watts", **labels) == 123.0
    tr.hang.set()
    t0 = time.monotonic()
    sampler.tick()  # waits for the timeout, no longer
    sampler.tick()  # the hung call has not returned: gives up at once
    # two ticks cost about one timeout (0.3 s), nowhere near the hung call (forever)
    assert time.monotonic() - t0 < 8 * 0.3
    assert value(metrics, "phasewatch_power_sampling_up", source="nvml") == 0.0
    # Stale or absent, never zero: the current gauge is gone, the counters stop.
    assert value(metrics, "phasewatch_gpu_power_current_watts", **labels) is None
    assert sum("not being sampled" in r.getMessage() for r in caplog.records) == 1
    tr.hang.clear()
    tr.release.set()
    deadline = time.monotonic() + 5
    while sampler.up is not True and time.monotonic() < deadline:
        time.sleep(0.05)
        sampler.tick()
    assert sampler.up is True
    assert value(metrics, "phasewatch_power_sampling_up", source="nvml") == 1.0
    assert value(metrics, "phasewatch_gpu_power_current_watts", **labels) == 123.0


def test_sampler_thread_starts_and_stops_and_never_blocks_the_caller(monkeypatch):
    tr = Trace(lambda t: 80.0)
    monkeypatch.setitem(sys.modules, "pynvml", fake_pynvml([tr]))
    up = fake_upstream()
    metrics = Metrics()
    sampler = PowerSampler(
        NvmlSource(), metrics, GpuMap({}, [up], lambda m: up), interval=0.02, timeout=0.2
    )
    tr.hang.set()  # every read hangs; start() and stop() still return promptly
    t0 = time.monotonic()
    sampler.start()
    time.sleep(0.5)
    assert sampler.up is False
    sampler.stop()
    assert time.monotonic() - t0 < 2.0
    tr.release.set()


def test_no_nvml_says_so_once_and_exports_no_power(monkeypatch, caplog):
    mod = types.ModuleType("pynvml")

    class NVMLError(Exception):
        pass

    def init():
        raise NVMLError("NVML Shared Library Not Found")

    mod.NVMLError, mod.nvmlInit = NVMLError, init
    monkeypatch.setitem(sys.modules, "pynvml", mod)
    caplog.set_level(logging.INFO, logger="proxy")
    up = fake_upstream()
    metrics = Metrics()
    sampler = PowerSampler(
        NvmlSource(), metrics, GpuMap({}, [up], lambda m: up), interval=0.2, timeout=1.0
    )
    assert sampler.open() is False
    said = [r.getMessage() for r in caplog.records if "not sampled" in r.getMessage()]
    assert len(said) == 1 and "NVML Shared Library Not Found" in said[0]
    assert value(metrics, "phasewatch_power_sampling_up", source="nvml") == 0.0
    assert total(metrics, "phasewatch_gpu_power_sample_watts_count") == 0


def test_settings_for_power():
    s = Settings(upstream=["a=http://h:1"], power_gpu="0=a 1=org/model-AWQ")
    assert s.power_options().power_gpu == {"0": "a", "1": "org/model-AWQ"}
    assert s.power_interval == 0.2 and s.power_source == "auto"
    with pytest.raises(ValueError):
        Settings(power_gpu=["0"])
    with pytest.raises(ValueError):
        Settings(power_gpu=["0=a", "0=b"])
    with pytest.raises(ValueError):
        Settings(power_dcgm_url="gpu-host:9400")
    with pytest.raises(ValueError, match="power-dcgm-url"):
        PowerService(
            Settings(upstream=["a=http://h:1"], power_source="dcgm").power_options(),
            Metrics(),
            SimpleNamespace(all=[], route=None),
        )


# --- DCGM-exporter format -------------------------------------------------------------------------

DCGM_PAGE = """\
# HELP DCGM_FI_DEV_POWER_USAGE Power draw (in W).
# TYPE DCGM_FI_DEV_POWER_USAGE gauge
DCGM_FI_DEV_POWER_USAGE{gpu="0",UUID="GPU-1f027ee8-6e1e-2b8c-0108-3d370e5f0418",pci_bus_id="00000000:00:1E.0",device="nvidia0",modelName="NVIDIA A100-SXM4-80GB",GPU_I_PROFILE="2g.20gb",GPU_I_ID="3",Hostname="node-1",DCGM_FI_DRIVER_VERSION="535.129.03"} 54.581000
DCGM_FI_DEV_POWER_USAGE{gpu="0",UUID="GPU-1f027ee8-6e1e-2b8c-0108-3d370e5f0418",pci_bus_id="00000000:00:1E.0",device="nvidia0",modelName="NVIDIA A100-SXM4-80GB",GPU_I_PROFILE="2g.20gb",GPU_I_ID="5",Hostname="node-1",DCGM_FI_DRIVER_VERSION="535.129.03"} 54.581000
DCGM_FI_DEV_POWER_USAGE{gpu="1",UUID="GPU-c07eb90d-74b0-d3b4-e6ce-f18687564243",pci_bus_id="00000000:00:1F.0",device="nvidia1",modelName="NVIDIA A100-SXM4-80GB",Hostname="node-1",DCGM_FI_DRIVER_VERSION="535.129.03"} 312.5
# HELP DCGM_FI_DEV_POWER_USAGE_INSTANT Current instantaneous power usage of the device in Watts.
# TYPE DCGM_FI_DEV_POWER_USAGE_INSTANT gauge
DCGM_FI_DEV_POWER_USAGE_INSTANT{gpu="1",UUID="GPU-c07e",vgpu="7"} 999
# HELP DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION Total energy consumption since boot (in mJ).
# TYPE DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION counter
DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION{gpu="0",UUID="GPU-1f027ee8-6e1e-2b8c-0108-3d370e5f0418",device="nvidia0",Hostname="node-1"} 257858316
DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION{gpu="1",UUID="GPU-c07eb90d-74b0-d3b4-e6ce-f18687564243",device="nvidia1",Hostname="node-1"} 7.824041e+06
DCGM_FI_DEV_POWER_USAGE{UUID="GPU-nolabel"} 10
vllm:num_requests_running{engine="0",model_name="m"} 1.0
"""


def test_parse_dcgm_exporter_page():
    got = parse_dcgm(DCGM_PAGE)
    # the instant field where the counters file has it (dcgm-exporter's default has not)
    assert got == {"0": Reading(54.581, 257858316), "1": Reading(312.5, 7824041, 999.0)}
    assert parse_dcgm("vllm:num_requests_running 1\n") == {}
