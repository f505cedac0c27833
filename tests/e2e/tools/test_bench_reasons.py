"""`phasewatch bench` says why a figure is absent and counts its own runs: decode watts
too short for the sensor, the unresolved phases of the bench (not the proxy's life), and a
GGUF listed by its local path named by its file, as `report` and the page name it."""

from __future__ import annotations

import json
import re

import httpx

from ...support.servers import metric_samples, sample, start_sim
from .advice_scenarios import INT4, drive
from .test_bench_power_sensor import demo

FAST = ["--concurrency", "", "--quiet", "--idle-seconds", "0", "--json"]


def _bench(url: str, *args: str) -> dict:
    from .advice_scenarios import cli

    return json.loads(cli("bench", "--url", url, *FAST, *args, timeout=300))


def test_decode_too_short_for_the_sensor_says_why_and_counts_only_the_benchs_runs():
    proc, url = demo("0")
    try:
        # traffic before the bench: its unresolved phases are the proxy's, not the bench's
        drive(url, [(INT4, 100, 8)] * 6, 3)
        before = sample(metric_samples(url), "phasewatch_requests_total")
        r = _bench(
            url,
            "--model",
            INT4,
            "--decode-tokens",
            "64",
            "--repeat",
            "3",
            "--prompt-tokens",
            "256",
        )
        sent = sample(metric_samples(url), "phasewatch_requests_total") - before
        text = _table(url, INT4)
    finally:
        proc.terminate()
        proc.wait(30)
    (m,) = r["models"]
    assert m["power"].get("decode_watts") is None
    (note,) = [n for n in m["notes"] if n.startswith("decode W and J/tok: n/a")]
    got = re.search(r"decode lasted ([0-9.]+) s < ([0-9.]+) s the GPU power sensor resolves", note)
    assert got, note
    lasted, resolves = float(got[1]), float(got[2])
    assert lasted < resolves
    assert abs(lasted - 63 / m["decode"]["tok_s"]) < 0.1 * lasted  # 63 gaps at the rate
    # the bench's own requests (each decode unresolved), the six before it left out
    (line,) = [ln for ln in r["power_sensor"] if ln.startswith("Phases too short")]
    assert "in this bench's runs" in line, line
    decode = re.search(r"decode (\d+) of (\d+)", line)
    assert decode and int(decode[1]) == int(decode[2]) == sent > 0, (line, sent)
    assert "decode lasted" in text


def _table(url: str, model: str) -> str:
    from .advice_scenarios import cli

    return cli(
        "bench",
        "--url",
        url,
        "--model",
        model,
        "--decode-tokens",
        "64",
        "--repeat",
        "1",
        "--prompt-tokens",
        "256",
        "--concurrency",
        "",
        "--quiet",
        "--idle-seconds",
        "0",
        timeout=300,
    )


def test_a_gguf_listed_by_its_path_is_named_by_its_file():
    sim = start_sim("llamacpp", speed=4.0, extra=["--no-alias"])
    try:
        listed = httpx.get(sim.url + "/v1/models", timeout=10).json()["data"][0]["id"]
        r = _bench(sim.url, "--repeat", "1", "--prompt-tokens", "256", "--decode-tokens", "32")
    finally:
        sim.stop()
    assert listed.startswith("/") and listed.endswith(".gguf")  # the scenario is real
    (m,) = r["models"]
    assert m["model"] == listed.rsplit("/", 1)[1]
    assert m["precision"] != "unknown"
