"""Energy per token by phase from many short prefills, against the simulator's truth.

Chat traffic whose prefills last 0.05-0.3 s, every precision at once (one GPU each),
through the `ampere` sensor behind a dcgm-exporter collecting every 100 ms: no single
prefill is resolved there (phases of ~0.75 s or longer are), but the fit over the energy
counter's steps (``GET /phasewatch/api/energy``) must give each precision's energy per
prompt token and per output token within 15 % of the truth, and its prefill watts within
12 %. Truth: each GPU's true power trace from the simulator's truth log, each moment's
draw split evenly among the requests running then.
"""

from __future__ import annotations

import concurrent.futures
import json
import random
import subprocess
import sys

import httpx

from proxy.sim.physics import DEFAULT_MODELS, RTX_4090, prefill_seconds

from ...support.browser import Browser
from ...support.servers import _spawn, free_port, metric_samples, stream_chat, wait_for
from .test_power_sensors import REALISTIC, learnt, start, total

MODELS = {m.profile.name: m for m in DEFAULT_MODELS}  # precision -> spec; GPU i = model i
REQUESTS = 45  # per precision
LIMIT = {"prefill": 0.15, "decode": 0.15, "watts": 0.12}


def prompt_for(spec, seconds: float) -> int:
    """The prompt length (tokens) the simulated GPU prefills in about `seconds`."""
    lo, hi = 16, 20000
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if prefill_seconds(spec, RTX_4090, mid) < seconds:
            lo = mid
        else:
            hi = mid
    return lo


def traffic(url: str, precision: str, seed: int) -> None:
    """REQUESTS streamed chats one after another, prefills of 0.05-0.3 s, 20-60 tokens."""
    rng = random.Random(seed)
    spec = MODELS[precision]
    for i in range(REQUESTS):
        prompt = prompt_for(spec, rng.uniform(0.05, 0.3))
        # the chat template adds a few tokens; a unique head keeps the prefix cache out
        stream_chat(url, spec.id, f"{precision}{i} " + "w " * (prompt - 20), rng.randint(20, 60))


def energy_over(trace: list[list[float]], a: float, b: float, running) -> float:
    """The true energy of [a, b] that falls to one request: the power steps split evenly
    among the requests running at each moment (`running(t)`)."""
    joules = 0.0
    for k, (t, w) in enumerate(trace):
        t2 = trace[k + 1][0] if k + 1 < len(trace) else float("inf")
        lo, hi = max(a, t), min(b, t2)
        if hi > lo:
            joules += w * (hi - lo) / max(1, running((lo + hi) / 2))
    return joules


def truth_by_precision(records: list[dict]) -> dict[str, dict[str, float]]:
    out = {}
    for p, m in MODELS.items():
        mine = [r for r in records if r["model"] == m.id]

        def running(t: float, mine=mine) -> int:
            return sum(1 for r in mine if r["t_admit"] <= t < r["t_end"])

        pj = dj = ptok = dtok = psec = 0.0
        for r in mine:
            a = r["t_admit"]
            b = a + r["prefill_seconds"]
            pj += energy_over(r["power_trace"], a, b, running)
            psec += r["prefill_seconds"]
            ptok += r["prompt_tokens"] - r["cached_tokens"]
            dj += energy_over(r["power_trace"], r["t_first"], r["t_last"], running)
            dtok += r["completion_tokens"] - 1
        out[p] = {"prefill": pj / ptok, "decode": dj / dtok, "prefill_watts": pj / psec}
        out[p]["requests"] = len(mine)
    return out


def resolved(url: str) -> list[dict] | None:
    rows = httpx.get(url + "/phasewatch/api/energy", timeout=10).json()
    by = {r["precision"]: r for r in rows}
    if set(by) < set(MODELS):
        return None
    for r in by.values():
        if "unresolved" in r["prefill"] or "unresolved" in r["decode"]:
            return None
        if r["prefill"]["requests"] < REQUESTS:  # fitted before the last one
            return None
    return rows


def test_short_prefills_energy_per_token_from_many_requests():
    sensor, path = REALISTIC["ampere-dcgm-c100"]
    sim, proxy = start(sensor, path)
    try:
        learnt(proxy)
        with concurrent.futures.ThreadPoolExecutor(len(MODELS)) as pool:
            jobs = [pool.submit(traffic, proxy.url, p, k) for k, p in enumerate(MODELS)]
            for job in jobs:
                job.result()
        rows = wait_for(lambda: resolved(proxy.url), timeout=60, what="every figure fitted")
        truth = truth_by_precision(sim.truth(at_least=REQUESTS * len(MODELS)))
        s = metric_samples(proxy.url)
        # no single prefill was short enough to be measured on its own
        single = {
            p: total(s, "phasewatch_gpu_power_watts_count", precision=p, phase="prefill")
            for p in MODELS
        }
        got = {}
        for row in rows:
            p = row["precision"]
            t = truth[p]
            pre, dec = row["prefill"], row["decode"]
            got[p] = {
                "prefill_j_per_token": [pre["joules_per_token"], t["prefill"]],
                "decode_j_per_token": [dec["joules_per_token"], t["decode"]],
                "prefill_watts": [pre["watts"], t["prefill_watts"]],
                "interval_prefill": [pre["low"], pre["high"]],
                "requests": [pre["requests"], dec["requests"], t["requests"]],
                "single_prefills_measured": single[p],
            }
        print("FIGURES", json.dumps(got))
        for row in rows:
            p = row["precision"]
            t = truth[p]
            pre, dec = row["prefill"], row["decode"]
            assert pre["requests"] == dec["requests"] == REQUESTS, row
            assert pre["low"] <= pre["joules_per_token"] <= pre["high"]
            assert pre["high"] - pre["low"] <= 0.2 * pre["joules_per_token"] + 1e-12
            assert abs(pre["joules_per_token"] / t["prefill"] - 1) <= LIMIT["prefill"], got[p]
            assert abs(dec["joules_per_token"] / t["decode"] - 1) <= LIMIT["decode"], got[p]
            assert abs(pre["watts"] / t["prefill_watts"] - 1) <= LIMIT["watts"], got[p]
            assert row["unattributed_joules"] >= 0.0
            # the gauges carry the same figures (refitted every few seconds since)
            for ph, fig in (("prefill", pre), ("decode", dec)):
                lab = {"precision": p, "phase": ph}
                g = total(s, "phasewatch_gpu_energy_per_token_joules", bound="estimate", **lab)
                assert g > 0 and abs(g / fig["joules_per_token"] - 1) < 0.3, (p, ph, g, fig)
                assert total(s, "phasewatch_gpu_energy_fit_requests", **lab) == REQUESTS
        # the status page shows each precision's prefill watts from the fit
        browser = Browser()
        try:
            page = browser.page(proxy.url + "/phasewatch/", 1400, 900)
            cells = page.wait(
                """(() => {
                  const got = [...document.querySelectorAll('tr[data-precision] td[data-col="prefillw"]')]
                    .map(c => [c.parentElement.dataset.precision, c.firstChild.textContent, c.dataset.source || ""]);
                  return got.length >= 3 && got.every(g => g[2] === "fit") && got;
                })()""",
                timeout=30,
            )
        finally:
            browser.close()
        print("PAGE", json.dumps(cells))
        for p, text, _ in cells:
            t = truth[p]["prefill_watts"]
            assert abs(float(text) / t - 1) <= LIMIT["watts"], (p, text, t)
        # and `phasewatch report --format json` the same rows, under `energy`
        out = subprocess.run(
            [sys.executable, "-m", "proxy", "report", "--from", proxy.url, "--format", "json"],
            capture_output=True,
            text=True,
            timeout=60,
            check=True,
        )
        energy = {r["precision"]: r for r in json.loads(out.stdout)["energy"]}
        assert set(energy) == set(MODELS)
        for row in rows:
            rep = energy[row["precision"]]
            for ph in ("prefill", "decode"):
                assert rep[ph]["requests"] == REQUESTS, rep
                assert abs(rep[ph]["joules_per_token"] / row[ph]["joules_per_token"] - 1) < 0.05
    finally:
        proxy.stop()
        sim.stop()


def test_the_demo_shows_prefill_watts_per_precision_soon():
    """``phasewatch demo`` as a new user starts it (the ampere sensor behind a 100 ms
    exporter, chat-length prompts mostly): within two minutes the status page shows a
    prefill W figure for every precision, the fit's where single prefills are too short."""
    port = free_port()
    proc, log = _spawn(["demo", "--port", str(port)], port, "/phasewatch/health")
    browser = Browser()
    try:
        page = browser.page(f"http://127.0.0.1:{port}/", 1400, 900)
        shown = page.wait(
            """(() => {
              const cells = [...document.querySelectorAll('tr[data-precision] td[data-col="prefillw"]')];
              const got = cells.map(c => [c.parentElement.dataset.precision, c.firstChild.textContent,
                                          c.dataset.source || "single", c.title]);
              return got.length >= 3 && got.every(g => /^[0-9]+$/.test(g[1])) && got;
            })()""",
            timeout=120,
        )
        print("DEMO", json.dumps(shown))
        assert {g[0] for g in shown} == set(MODELS)
        for _, watts, source, title in shown:
            assert 22 < float(watts) < 450  # between the simulated GPU's idle draw and TDP
            if source == "fit":
                assert title.startswith("fitted from "), title
    finally:
        browser.close()
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.unlink(missing_ok=True)
