"""`phasewatch bench` and the GPU power sensor, as a new user meets them: the README's
own demo (Ampere-style sensors behind a 100 ms exporter) with its traffic on and off, and
a phasewatch that does not sample power."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time

import httpx

from proxy.sim.physics import PROFILES, RTX_4090

from ...support.servers import ROOT, free_port, start_proxy, start_sim

BF16 = "meta-llama/Llama-3.1-8B-Instruct"
FAST = ["--decode-tokens", "128", "--concurrency", "", "--quiet", "--idle-seconds", "0"]


def bench(url: str, *args: str) -> subprocess.CompletedProcess:
    res = subprocess.run(
        [sys.executable, "-m", "proxy", "bench", "--url", url, "--model", BF16, *FAST, *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert res.returncode == 0, res.stderr[-3000:]
    return res


def demo(rate: str):
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "proxy", "demo", "--rate", rate, "--port", str(port)]
        + ["--sim-port", str(free_port()), "--duration", "240"],
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            page = httpx.get(url + "/metrics", timeout=1).text
            if 'phasewatch_gpu_power_sensor_info{field="energy_counter"' in page:
                return proc, url  # the sensor learnt
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    proc.kill()
    raise AssertionError("the demo did not start sampling power")


def test_bench_of_the_demo_with_its_traffic_says_in_one_line_to_turn_it_off():
    proc, url = demo("2")
    try:
        res = bench(url, "--repeat", "1", "--prompt-tokens", "1024")
    finally:
        proc.terminate()
        proc.wait(30)
    warned = [ln for ln in res.stdout.splitlines() if ln.startswith("- ⚠")]
    assert len(warned) == 1, res.stdout
    assert "phasewatch demo --rate 0" in warned[0] and len(warned[0]) < 250, warned


def test_bench_of_a_quiet_demo_measures_power_the_way_the_sensor_allows():
    proc, url = demo("0")
    try:
        res = bench(url, "--repeat", "3", "--prompt-tokens", "2048", "--json")
    finally:
        proc.terminate()
        proc.wait(30)
    r = json.loads(res.stdout)
    assert not r["warnings"], r["warnings"]
    m = r["models"][0]
    bf16 = PROFILES["bf16"]
    # decode is long enough for the sensor run by run; within 7 % of the simulator's draw
    assert abs(m["power"]["decode_watts"] / bf16.decode_watts - 1) < 0.07, m["power"]
    # each ~0.2 s prefill is shorter than the sensor resolves: their energy added up
    assert abs(m["power"]["prefill_watts"] / bf16.prefill_watts - 1) < 0.12, m["power"]
    assert any("back-to-back" in n for n in m["notes"]), (m["notes"], m["power"])
    # the table says which field, how often it refreshes, the shortest phase measured
    line = next(ln for ln in r["power_sensor"] if ln.startswith("GPU 0 power sensor (dcgm)"))
    got = re.search(r"energy counter, refreshed every ([0-9.]+) s; phases of ([0-9.]+) s", line)
    assert got and abs(float(got[1]) - 0.1) < 0.02 and float(got[2]) > 0.3, line
    assert RTX_4090.tdp_watts >= bf16.prefill_watts


def test_bench_through_a_phasewatch_without_power_says_why():
    sim = start_sim("vllm", speed=4.0)
    proxy = start_proxy(f"sim={sim.url}", args=["--power-source", "none"])
    try:
        res = bench(proxy.url, "--repeat", "1", "--prompt-tokens", "256")
    finally:
        proxy.stop()
        sim.stop()
    lines = [ln for ln in res.stdout.splitlines() if "Power: n/a" in ln]
    assert lines == [
        "- Power: n/a, this phasewatch is not sampling GPU power (started with "
        "--power-source none)."
    ], res.stdout
