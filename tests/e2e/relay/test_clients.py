"""Per-client attribution and the request-id trail, through real servers.

Named keys (``--api-key team-a=KEY``) and a bounded header (``--client-header`` with
``--clients``) label requests, tokens and attributed energy with `client`; the histograms
never get the label; ``phasewatch report --by client`` prints the chargeback table;
``--echo-request-id`` returns the id that is in the log line, the span and the exemplar.
"""

from __future__ import annotations

import concurrent.futures
import subprocess
import sys
import time

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from proxy.sim.physics import DEFAULT_MODELS, RTX_4090, power_watts

from ...support.servers import ROOT, metric_samples, sample, start_proxy, start_sim, wait_for

MODEL = "meta-llama/Llama-3.1-8B-Instruct"
KEY_A, KEY_B, KEY_BARE = "sk-alpha-0001", "sk-bravo-0002", "sk-bare-0003"


def chat(url: str, key: str | None, rid: str, headers: dict | None = None, tokens: int = 6):
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "hello " * 30}],
        "max_tokens": tokens,
        "ignore_eos": True,
        "stream": True,
    }
    h = {"x-request-id": rid, **(headers or {})}
    if key:
        h["authorization"] = f"Bearer {key}"
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, headers=h, timeout=60) as r:
        r.read()
        return r


@pytest.fixture(scope="module")
def stack():
    sim = start_sim("vllm", speed=4.0)
    proxy = start_proxy(
        f"sim={sim.url}",
        args=[
            "--api-key",
            f"team-a={KEY_A}",
            "--api-key",
            f"team-b={KEY_B}",
            "--api-key",
            KEY_BARE,
            "--client-header",
            "X-Team",
            "--clients",
            "red,blue",
            "--echo-request-id",
            "--metrics-public",
        ],
    )
    yield sim, proxy
    proxy.stop()
    sim.stop()


def test_named_keys_and_the_bounded_header_label_the_counters(stack):
    sim, proxy = stack
    sent = {
        "a-1": (KEY_A, {}),
        "a-2": (KEY_A, {"x-team": "blue"}),  # a named key wins over the header
        "b-1": (KEY_B, {}),
        "red-1": (KEY_BARE, {"x-team": "red"}),
        "blue-1": (KEY_BARE, {"x-team": "blue"}),
        "evil-1": (KEY_BARE, {"x-team": 'mallory {}="x"'}),  # not listed: other
        "evil-2": (KEY_BARE, {"x-team": "Red"}),  # names are exact
        "none-1": (KEY_BARE, {}),
    }
    for rid, (key, headers) in sent.items():
        assert chat(proxy.url, key, rid, headers).status_code == 200
    assert chat(proxy.url, "sk-wrong", "denied").status_code == 401

    expected = {
        "a-1": "team-a",
        "a-2": "team-a",
        "b-1": "team-b",
        "red-1": "red",
        "blue-1": "blue",
        "evil-1": "other",
        "evil-2": "other",
        "none-1": "unknown",
    }
    lines = wait_for(
        lambda: (lambda got: got if set(sent) <= set(got) else None)(
            {line["request_id"]: line for line in proxy.request_lines()}
        ),
        what="a log line for every request sent",
    )
    assert {rid: lines[rid]["client"] for rid in sent} == expected
    truth = wait_for(
        lambda: (lambda t: t if set(sent) <= set(t) else None)(
            {t["request_id"]: t for t in sim.truth()}
        ),
        what="the engine's record of every request sent",
    )

    s = metric_samples(proxy.url)
    for client in set(expected.values()):
        rids = [rid for rid, c in expected.items() if c == client]
        assert sample(s, "phasewatch_requests_total", client=client, outcome="ok") == len(rids)
        assert sample(s, "phasewatch_tokens_total", client=client, phase="decode") == sum(
            truth[r]["completion_tokens"] for r in rids
        )
    clients = {dict(k[1]).get("client") for k in s if k[0] == "phasewatch_requests_total"}
    assert clients == set(expected.values())  # bounded: nothing from the wire
    # never on a histogram
    text = httpx.get(proxy.url + "/metrics").text
    for fam in text_string_to_metric_families(text):
        if fam.type == "histogram":
            assert all("client" not in smp.labels for smp in fam.samples), fam.name


def test_report_by_client_prints_tokens_requests_and_energy(stack):
    sim, proxy = stack
    res = subprocess.run(
        [sys.executable, "-m", "proxy", "report", "--from", proxy.url, "--by", "client"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert res.returncode == 0, res.stderr
    rows = {
        cells[0]: cells
        for line in res.stdout.splitlines()
        if line.startswith("| ") and not line.startswith("| client")
        for cells in [[c.strip() for c in line.strip("|").split("|")]]
    }
    s = metric_samples(proxy.url)
    assert set(rows) >= {"team-a", "team-b", "red", "blue", "other", "unknown"}
    for client, cells in rows.items():
        requests = sample(s, "phasewatch_requests_total", client=client)
        decode = sample(s, "phasewatch_tokens_total", client=client, phase="decode")
        assert int(cells[1]) == requests and int(cells[7]) == decode, (client, cells)
        assert cells[8] == "n/a"  # no power sampled here, said so
    assert "Energy: n/a" in res.stdout


def test_echo_request_id_returns_the_logged_id(stack):
    _, proxy = stack
    r = chat(proxy.url, KEY_A, "echo-me")
    assert r.headers["x-request-id"] == "echo-me"
    client = openai.OpenAI(base_url=proxy.url + "/v1", api_key=KEY_A, max_retries=0)
    raw = client.chat.completions.with_raw_response.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=3
    )
    generated = raw.headers["x-request-id"]
    assert len(generated) == 32
    wait_for(
        lambda: any(line["request_id"] == generated for line in proxy.request_lines()),
        what="the generated id in the log",
    )
    # phasewatch's own answers carry it too (here: an unknown model the engine rejects)
    bad = httpx.post(
        proxy.url + "/v1/chat/completions",
        json={"model": "nope", "messages": []},
        headers={"authorization": f"Bearer {KEY_A}", "x-request-id": "bad-1"},
    )
    assert bad.status_code >= 400 and bad.headers["x-request-id"] == "bad-1"
    assert bad.headers.get_list("x-request-id") == ["bad-1"]


def test_without_echo_no_request_id_header(proxy):
    r = httpx.post(
        proxy.url + "/v1/chat/completions",
        json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
        timeout=30,
    )
    assert r.status_code == 200 and "x-request-id" not in r.headers


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--client-header", "x-team"], "--client-header needs --clients"),
        (["--clients", "a,b c!"], "--clients: client name 'c!' must be 1-64 letters"),
        (["--api-key", "a=k1", "--api-key", "a=k2"], "client name 'a' given to two keys"),
    ],
)
def test_bad_client_settings_stop_start_up(args, message):
    res = subprocess.run(
        [sys.executable, "-m", "proxy", "serve", "--upstream", "http://127.0.0.1:9", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert res.returncode == 2
    (line,) = res.stderr.strip().splitlines()
    assert line.startswith("phasewatch: error:") and message in line, line
    assert "k1" not in line and "k2" not in line  # keys never shown


def test_energy_is_attributed_per_client_from_each_requests_share():
    """Two teams share one GPU: the energy counter by client is the sum of their requests'
    shares, against the simulator's exact per-request energy."""
    sim = start_sim("vllm", speed=1.0)
    bf16 = next(m for m in DEFAULT_MODELS if m.profile.name == "bf16")
    proxy = start_proxy(
        f"sim={sim.url}",
        args=[
            "--power-source",
            "dcgm",
            "--power-dcgm-url",
            sim.url + "/metrics",
            "--power-interval",
            "0.05",
            "--power-gpu",
            f"0={bf16.id}",
            "--api-key",
            f"team-a={KEY_A}",
            "--api-key",
            f"team-b={KEY_B}",
            "--metrics-public",
        ],
    )
    try:
        deadline = time.monotonic() + 20
        while sample(metric_samples(proxy.url), "phasewatch_power_sampling_up") != 1.0:
            assert time.monotonic() < deadline, proxy.log()[-2000:]
            time.sleep(0.1)
        # the most a request's share can run past the last power sample: two sample
        # intervals (a sample's moment jitters on a busy machine) at the model's highest
        # draw on the simulator's GPU (its prefill draw)
        slack = 2 * 0.05 * power_watts(bf16, RTX_4090, "prefill")
        # idle energy that is nobody's, drawn before any request: twice that slack, so
        # that attributing it to the requests would show
        idle = wait_for(
            lambda: (lambda j: j if j is not None and j > 2 * slack else None)(
                sample(metric_samples(proxy.url), "phasewatch_gpu_energy_joules_total", gpu="0")
            ),
            what="idle energy drawn before the requests",
            timeout=60,
            interval=0.1,
        )
        jobs = {"ea-1": KEY_A, "ea-2": KEY_A, "eb-1": KEY_B}
        with concurrent.futures.ThreadPoolExecutor(3) as pool:
            futures = [
                pool.submit(chat, proxy.url, key, rid, None, 60 if key == KEY_A else 120)
                for rid, key in jobs.items()
            ]
            for f in futures:
                assert f.result().status_code == 200
        # each request's share is settled once the sensor has covered its end: all three
        # teams' requests' decode power observed (or counted too short for the sensor)
        wait_for(
            lambda: (
                (s := metric_samples(proxy.url))
                and sum(
                    sample(s, name, phase="decode")
                    for name in (
                        "phasewatch_gpu_power_watts_count",
                        "phasewatch_gpu_power_unresolved_total",
                    )
                )
                >= 3
            ),
            what="every request's energy settled",
        )
        truth = wait_for(
            lambda: (lambda t: t if set(jobs) <= set(t) else None)(
                {t["request_id"]: t for t in sim.truth()}
            ),
            what="the engine's record of every request",
        )
        s = metric_samples(proxy.url)
        total = 0.0
        for client, key in (("team-a", KEY_A), ("team-b", KEY_B)):
            rids = [r for r, k in jobs.items() if k == key]
            got = sample(s, "phasewatch_request_energy_joules_total", client=client)
            true = sum(truth[r]["energy_joules"] for r in rids)
            assert got == pytest.approx(true, rel=0.05), client
            total += got
        # idle energy is nobody's: the attributed sum stays below what the GPU drew after
        # the idle start, by the next power sample (the GPU's counter moves a sample at a
        # time; a request's share runs to its end, which may come after the last sample
        # taken), give or take the slack above. (The bound was once the idle draw's two
        # intervals, read after the requests: 2.2 J, missed by 0.7 J on a busy machine.)
        drawn = sample(s, "phasewatch_gpu_energy_joules_total", gpu="0")
        drawn = wait_for(
            lambda: (lambda now: now if now > drawn else None)(
                sample(metric_samples(proxy.url), "phasewatch_gpu_energy_joules_total", gpu="0")
            ),
            what="the next power sample",
        )
        print(f"\nattributed {total:.1f} J, drawn {drawn:.1f} J of which idle first {idle:.1f} J")
        assert total < drawn - idle + slack, (total, drawn, idle, slack)
    finally:
        proxy.stop()
        sim.stop()
