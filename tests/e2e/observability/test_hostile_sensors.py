"""Lying GPU sensors: a dcgm-exporter page (or NVML) that reports what no GPU can do.

A test-side sensor (:class:`LyingSensor`) serves a DCGM page and the stand-in pynvml's JSON
for one GPU drawing a true 100 W, with a lie switched on by the test: infinite or absurd
watts, an energy counter that jumps or jitters, a 50 MB page. The proxy sits in front of
the simulator, so requests are measured as usual. Whatever the lie, nothing non-finite or
absurd may reach /metrics, the GPU's energy must stay within what the GPU can draw, each
refusal is counted by reason and logged once; a huge page must cost bounded memory and
move no request by more than 50 ms against the same run's baseline.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import pytest

from proxy.sim.physics import DEFAULT_MODELS

from ...support.hostile import PeakRss
from ...support.servers import (
    free_port,
    metric_samples,
    sample,
    start_proxy,
    start_sim,
    wait_for,
)
from ...support.watch import ROUNDS, Watch, within

NVML = Path(__file__).resolve().parents[2] / "support" / "nvml"
MODEL = DEFAULT_MODELS[0].id
TRUE_WATTS = 100.0
#: --power-max-watts given to the proxy: what no GPU here can draw above
MAX_WATTS = 1000.0
#: The NVML stand-in's power limit: readings above twice it are refused there
LIMIT_WATTS = 300.0
LABELS = 'gpu="0",UUID="GPU-fake-0",device="nvidia0",modelName="Fake GPU",Hostname="h"'


class LyingSensor:
    """One GPU at a true 100 W: its energy counter (mJ) grows with the wall clock. `lie`
    (set by the test) maps (reads so far, honest fields) to the fields served."""

    def __init__(self) -> None:
        self.t0 = time.monotonic()
        self.reads = 0
        self.lie: Callable[[int, dict], dict] = lambda n, f: f
        self.lock = threading.Lock()
        sensor = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:  # quiet
                pass

            def do_GET(self) -> None:  # http.server names it
                body = sensor.answer(self.path)
                self.send_response(200)
                kind = "application/json" if self.path == "/nvml" else "text/plain"
                self.send_header("Content-Type", kind)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                try:
                    self.wfile.write(body)
                except OSError:  # the reader stopped reading: its bound
                    pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def truth(self) -> float:
        """The GPU's true energy so far (J): an upper bound of what was sampled."""
        return TRUE_WATTS * (time.monotonic() - self.t0)

    def answer(self, path: str) -> bytes:
        with self.lock:
            self.reads += 1
            n = self.reads
        honest = {"watts": TRUE_WATTS, "energy_mj": 7_000_000 + self.truth() * 1000.0}
        f = self.lie(n, honest)
        if path == "/nvml":
            gpu = {
                "power_usage_mw": f["watts"] * 1000.0,
                "energy_mj": f["energy_mj"],
                "power_instant_mw": None,
                "power_average_mw": None,
                "power_limit_mw": LIMIT_WATTS * 1000.0,
            }
            return json.dumps({"gpus": [gpu]}).encode()
        page = f"DCGM_FI_DEV_POWER_USAGE{{{LABELS}}} {f['watts']}\n"
        if f["energy_mj"] is not None:
            page += f"DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION{{{LABELS}}} {f['energy_mj']:.0f}\n"
        return page.encode()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def rig():
    """(sensor, start): start(path) runs the simulator and a proxy reading the sensor."""
    sensor = LyingSensor()
    started = []

    def start(path: str = "dcgm", extra: list[str] | None = None):
        sim = start_sim("vllm", jitter=0.0)
        args = ["--power-interval", "0.05", "--power-max-watts", str(MAX_WATTS)]
        env = None
        if path == "nvml":
            args += ["--power-source", "nvml"]
            env = {
                "PYTHONPATH": os.pathsep.join([str(NVML), os.environ.get("PYTHONPATH", "")]),
                "PHASEWATCH_TEST_NVML_URL": sensor.url + "/nvml",
            }
        else:
            args += ["--power-source", "dcgm", "--power-dcgm-url", sensor.url + "/metrics"]
        proxy = start_proxy(f"sim={sim.url}", env=env, args=args + (extra or []))
        started.extend([proxy, sim])
        return sim, proxy

    yield sensor, start
    for s in started:
        s.stop()
    sensor.close()


def chat(url: str, max_tokens: int = 20, stream: bool = True) -> float:
    """One chat completion through `url`, read to its end; its latency (s)."""
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "hello " * 50}],
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "stream": stream,
    }
    t = time.monotonic()
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=60) as resp:
        assert resp.status_code == 200
        for _ in resp.iter_raw():
            pass
    return time.monotonic() - t


def power_values(samples: dict) -> dict[tuple, float]:
    """Every GPU-power and energy sample the proxy exports."""
    return {
        k: v
        for k, v in samples.items()
        if any(s in k[0] for s in ("power", "energy")) and not k[0].endswith("_created")
    }


def assert_sane(proxy, sensor: LyingSensor) -> dict:
    """Nothing non-finite or absurd on /metrics; the GPU's energy within what it can draw."""
    s = metric_samples(proxy.url)
    bad = {k: v for k, v in power_values(s).items() if not math.isfinite(v)}
    assert not bad, f"non-finite values on /metrics: {bad}"
    for k, v in s.items():
        if k[0] in ("phasewatch_gpu_power_current_watts",):
            assert 0 <= v <= MAX_WATTS, f"{k} = {v}"
    energy = sample(s, "phasewatch_gpu_energy_joules_total")
    assert energy <= 2 * sensor.truth(), f"{energy} J for {sensor.truth():.0f} J drawn"
    requests = sample(s, "phasewatch_request_energy_joules_total")
    assert requests <= energy + 1e-6
    return s


def rejected(proxy, reason: str) -> float:
    return sample(metric_samples(proxy.url), "phasewatch_gpu_sensor_rejected_total", reason=reason)


def wait_rejected(proxy, reason: str, at_least: float = 1) -> None:
    wait_for(lambda: rejected(proxy, reason) >= at_least, what=f"a {reason} refusal")


def logged_once(proxy, needle: str) -> None:
    lines = [ln for ln in proxy.log().splitlines() if needle in ln]
    assert len(lines) == 1, f"{needle!r} logged {len(lines)} times:\n{proxy.log()}"


def sampled(proxy, joules: float = 50.0) -> None:
    """Wait until the GPU's energy has been counted (the sampler is past its start)."""
    wait_for(
        lambda: sample(metric_samples(proxy.url), "phasewatch_gpu_energy_joules_total") >= joules,
        what="energy counted",
    )


@pytest.mark.parametrize("value", ["+Inf", "1e30", "-5"])
def test_impossible_watts_never_reach_metrics(rig, value):
    """+Inf, 1e30 and negative watts from the page (the counter absent, so power is
    integrated): refused, counted, logged once; energy stays what 100 W gives."""
    sensor, start = rig
    # no counter on the page: power is integrated, each reading counts
    sensor.lie = lambda n, f: {"watts": f["watts"] if n % 2 else float(value), "energy_mj": None}
    _, proxy = start()
    reason = {"+Inf": "not_finite", "1e30": "too_high", "-5": "negative"}[value]
    wait_rejected(proxy, reason)
    sampled(proxy)
    chat(proxy.url)
    wait_for(
        lambda: sample(metric_samples(proxy.url), "phasewatch_request_energy_joules_total") > 0,
        what="the request's energy",
    )
    wait_rejected(proxy, reason, 10)
    assert_sane(proxy, sensor)
    logged_once(proxy, f"reason={reason}")


def test_a_counter_jump_is_refused(rig):
    """The energy counter jumps by 1e15 mJ and stays there: the jump is not energy."""
    sensor, start = rig
    jumped = threading.Event()

    def lie(n: int, f: dict) -> dict:
        if jumped.is_set():
            f["energy_mj"] += 1e15
        return f

    sensor.lie = lie
    _, proxy = start()
    sampled(proxy)
    jumped.set()
    wait_rejected(proxy, "counter_jump")
    chat(proxy.url)
    before = sample(metric_samples(proxy.url), "phasewatch_gpu_energy_joules_total")
    # counted again from the new level once it goes on as a counter does
    wait_for(
        lambda: (
            sample(metric_samples(proxy.url), "phasewatch_gpu_energy_joules_total") > before + 20
        ),
        what="energy counted after the jump",
    )
    assert_sane(proxy, sensor)
    logged_once(proxy, "reason=counter_jump")


def test_a_jittering_counter_is_not_counted_again(rig):
    """+5 kJ on every other read, back on the next: neither the jump nor the jump back
    (a reset?) is energy; the GPU's energy stays what 100 W gives."""
    sensor, start = rig

    def lie(n: int, f: dict) -> dict:
        if n % 2:
            f["energy_mj"] += 5_000_000
        return f

    sensor.lie = lie
    _, proxy = start()
    wait_for(lambda: sensor.reads > 100, what="100 reads")
    chat(proxy.url)
    wait_for(lambda: sensor.reads > 200, what="200 reads")
    assert rejected(proxy, "counter_jump") + rejected(proxy, "counter_backwards") >= 10
    assert_sane(proxy, sensor)


def test_nvml_values_are_checked_too(rig):
    """The NVML path: negative milliwatts, 700 W on a GPU limited to 300 W (below
    --power-max-watts, above twice the limit), a counter jump (by 100 ms slots: the
    stand-in pynvml asks once per call, not once per reading)."""
    sensor, start = rig

    def lie(n: int, f: dict) -> dict:
        k = int(time.monotonic() * 10) % 4
        if k == 1:
            f["watts"] = -7.0
        elif k == 2:
            f["watts"] = 2 * LIMIT_WATTS + 100
        elif k == 3:
            f["energy_mj"] += 1e15
        return f

    sensor.lie = lie
    _, proxy = start("nvml")
    wait_rejected(proxy, "negative")
    wait_rejected(proxy, "too_high")
    chat(proxy.url)
    wait_for(lambda: sensor.reads > 200, what="200 reads")
    s = assert_sane(proxy, sensor)
    shown = [v for k, v in s.items() if k[0] == "phasewatch_gpu_power_current_watts"]
    assert all(v <= 2 * LIMIT_WATTS for v in shown)
    logged_once(proxy, "reason=negative")
    logged_once(proxy, "reason=too_high")


#: A sensor in a process of its own (writing 50 MB pages in the test's process would
#: slow the measuring): the honest page until /huge, then a 50 MB page that ends at the
#: close, unannounced, until /honest; /huge-count says how many it began.
HUGE_SENSOR = """
import sys, threading, time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
LABELS = sys.argv[2]
t0, state = time.monotonic(), {"huge": False, "count": 0}
pad = "".join(f'DCGM_FI_DEV_SM_CLOCK{{gpu="{i}",UUID="GPU-{i:06d}"}} 1410\\n' for i in range(4000))
pad = pad.encode() * (50_000_000 // len(pad))
class H(BaseHTTPRequestHandler):
    def log_message(self, *a): pass
    def do_GET(self):
        if self.path in ("/huge", "/honest"):
            state["huge"] = self.path == "/huge"
        honest = (f"DCGM_FI_DEV_POWER_USAGE{{{LABELS}}} 100.0\\n"
                  f"DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION{{{LABELS}}} "
                  f"{7e6 + 1e5 * (time.monotonic() - t0):.0f}\\n").encode()
        body = str(state["count"]).encode() if self.path == "/huge-count" else honest
        huge = self.path == "/metrics" and state["huge"]
        self.send_response(200)
        if huge:
            state["count"] += 1
        else:
            self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        try:
            self.wfile.write(pad + body if huge else body)
        except OSError:
            pass
srv = ThreadingHTTPServer(("127.0.0.1", int(sys.argv[1])), H)
srv.daemon_threads = True
srv.serve_forever()
"""
#: The issue's bounds for a huge page, beside the same run's baseline.
SLACK_S = 0.050
RSS_MIB = 64


def test_a_50mb_page_costs_bounded_memory_and_no_request_time(rig):
    """A 50 MB exporter page, read while a client streams and probes health (in a
    process of its own): refused at --power-dcgm-max-bytes, counted, logged once; the
    proxy's peak RSS grows by at most 64 MiB, and nobody waits 50 ms longer than in the
    same run's baseline (up to ROUNDS rounds: a busy box stalls anyone now and then)."""
    _, start = rig
    port = free_port()
    huge = subprocess.Popen([sys.executable, "-c", HUGE_SENSOR, str(port), LABELS])
    url = f"http://127.0.0.1:{port}"
    count = lambda: int(httpx.get(url + "/huge-count").text)  # noqa: E731
    try:
        wait_for(lambda: _answers(url), what="the sensor")
        _, proxy = start(extra=["--power-dcgm-url", url + "/metrics"])
        sampled(proxy)
        with Watch(proxy.url, MODEL) as warm:  # an ordinary request first
            warm.wait()
        rounds = []
        for _ in range(ROUNDS):
            with Watch(proxy.url, MODEL) as w:
                base = w.wait()
            n = count()
            with PeakRss(proxy.proc.pid) as rss, Watch(proxy.url, MODEL) as w:
                httpx.get(url + "/huge")
                wait_for(lambda: count() > n, what="a huge page asked for")
                hostile = w.wait()
            httpx.get(url + "/honest")
            print(f"baseline {base}; a 50 MB page {hostile}; RSS +{rss.growth_mib:.1f} MiB")
            assert rss.growth_mib <= RSS_MIB
            rounds.append((base, hostile))
            if within(base, hostile, SLACK_S):
                break
        assert within(base, hostile, SLACK_S), [f"{b} / {h}" for b, h in rounds]
        wait_rejected(proxy, "page_too_large", len(rounds))
        logged_once(proxy, "reason=page_too_large")
        # sampled again once the page is back to an exporter's
        wait_for(lambda: sample(metric_samples(proxy.url), "phasewatch_power_sampling_up") == 1)
    finally:
        huge.kill()
        huge.wait()


def _answers(url: str) -> bool:
    try:
        return httpx.get(url + "/huge-count").status_code == 200
    except httpx.HTTPError:
        return False
