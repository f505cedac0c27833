"""SGLang through phasewatch: three simulated SGLang servers (one model each, as SGLang
serves them) behind one proxy. Recognised, precision labelled, figures against the
simulator's truth, its state gauges, its stream quirks byte for byte and counted right,
the native /generate, and a hostile server_info."""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import tempfile
import threading
import time

import httpx
import openai
import pytest

from ...support.replay import ThreadServer
from ...support.servers import free_port, metric_samples, sample, start_proxy, start_sim, wait_for

BF16, FP8, INT4 = (
    "meta-llama/Llama-3.1-8B-Instruct",
    "RedHatAI/Llama-3.1-8B-Instruct-FP8",
    "hugging-quants/Llama-3.1-8B-Instruct-AWQ-INT4",
)
CHAT = "/v1/chat/completions"
#: A quarter of the simulated GPU's speed: a long prompt's prefill takes a few hundred ms,
#: so the few ms a relay adds are under 1 % of its TTFT.
SPEED = 0.25


@pytest.fixture(scope="module")
def fleet():
    model_dir = tempfile.mkdtemp(prefix="pw-sglang-models-")
    sims = {
        # bf16: no --quantization, dtype auto: its checkpoint's config.json says (metrics off)
        "bf": start_sim(
            "sglang",
            speed=SPEED,
            deterministic=True,
            jitter=0.02,
            extra=["--served-model", BF16, "--model-dir", model_dir],
        ),
        # fp8: --quantization fp8, named by /server_info; two sequences at a time
        "fp": start_sim(
            "sglang",
            speed=SPEED,
            deterministic=True,
            jitter=0.02,
            max_num_seqs=2,
            extra=["--served-model", FP8, "--enable-metrics"],
        ),
        # int4: an AWQ checkpoint with no config at hand: its name says
        "q4": start_sim(
            "sglang",
            speed=SPEED,
            deterministic=True,
            jitter=0.02,
            extra=["--served-model", INT4, "--enable-metrics"],
        ),
    }
    proxy = start_proxy(
        *(f"{name}={sim.url}" for name, sim in sims.items()),
        args=["--model-dir", model_dir, "--engine-scrape", "0.1"],
    )
    yield sims, proxy
    proxy.stop()
    for sim in sims.values():
        sim.stop()


def _chat(model: str, prompt: str, max_tokens: int, **extra) -> dict:
    body = {
        "model": model,
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": max_tokens,
        "stream": True,
    }
    body.update(extra)
    return body


def _post(url: str, body: dict, **headers) -> httpx.Response:
    return httpx.post(url, json=body, headers=headers, timeout=60)


def _delta(before, after, name, **labels) -> float:
    return sample(after, name, **labels) - sample(before, name, **labels)


def test_recognised_with_each_precision(fleet):
    sims, proxy = fleet
    ready = httpx.get(proxy.url + "/phasewatch/ready").json()
    assert {u["name"]: u["engine"] for u in ready["upstreams"]} == {
        "bf": "sglang",
        "fp": "sglang",
        "q4": "sglang",
    }
    s = metric_samples(proxy.url)
    for model, precision in ((BF16, "bf16"), (FP8, "fp8"), (INT4, "int4")):
        assert sample(s, "phasewatch_model_info", model=model, precision=precision) == 1, model
    # the fp8 one is named by the server itself, the bf16 one by its checkpoint
    assert sample(s, "phasewatch_model_info", model=FP8, quant="FP8", precision_source="engine")
    assert sample(s, "phasewatch_model_info", model=BF16, quant="BFLOAT16")
    # the new names were asked: the deprecated ones (a warning each on SGLang) never
    for sim in sims.values():
        calls = httpx.get(sim.url + "/sim/calls").json()
        assert calls["get_model_info"] == calls["get_server_info"] == 0


def test_idle_health_probe_never_asks_health(fleet):
    """SGLang's /health may generate a token on an idle server: the probe of an idle
    upstream (every second) asks its model list instead."""
    sims, proxy = fleet
    sim = sims["q4"]
    before = httpx.get(sim.url + "/sim/calls").json()
    wait_for(
        lambda: httpx.get(sim.url + "/sim/calls").json()["models"] >= before["models"] + 3,
        what="three idle health probes",
    )
    assert httpx.get(sim.url + "/sim/calls").json()["health"] == before["health"]


def test_figures_match_simulator_truth(fleet):
    sims, proxy = fleet
    client = openai.OpenAI(base_url=proxy.url + "/v1", api_key="unused", max_retries=0)
    client_ttft, ids = [], []
    # prompts of 2500 to 3000 tokens: TTFT is mostly the engine's prefill
    for i, model in enumerate((BF16, FP8, INT4) * 2):
        rid = f"sg-truth-{i}"
        t0 = time.monotonic()
        ttft = None
        stream = client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": " ".join(["word"] * (2500 + 100 * i))}],
            max_tokens=50,
            stream=True,
            extra_body={"ignore_eos": True},
            extra_headers={"x-request-id": rid},
        )
        for chunk in stream:
            if ttft is None and chunk.choices and chunk.choices[0].delta.content:
                ttft = time.monotonic() - t0
        client_ttft.append(ttft)
        ids.append(rid)
    lines = {
        line["request_id"]: line
        for line in wait_for(
            lambda: (lambda got: got if len(got) == 6 else None)(
                [ln for ln in proxy.request_lines() if ln["request_id"].startswith("sg-truth-")]
            ),
            what="six request lines",
        )
    }
    truth = {}
    for sim in sims.values():
        truth.update({t["request_id"]: t for t in sim.truth() if t["request_id"] in lines})
    assert set(truth) == set(ids)
    errors, ttft_errors = [], []
    for rid, c_ttft in zip(ids, client_ttft):
        line, t = lines[rid], truth[rid]
        assert line["outcome"] == "ok"
        assert int(line["completion_tokens"]) == t["completion_tokens"] == 50
        assert int(line["prompt_tokens"]) == t["prompt_tokens"]
        # the engine had the request after the proxy and wrote the token before it passed
        assert t["ttft_seconds"] <= float(line["ttft_s"]) <= c_ttft
        ttft_errors.append(float(line["ttft_s"]) / t["ttft_seconds"] - 1)
        errors.append(abs(float(line["decode_tps"]) / t["decode_tokens_per_second"] - 1))
    # within 1 % of the truth at the median; a single request on a loaded, shared box may
    # see one late chunk, so each one alone is held to 10 %
    assert statistics.median(errors) < 0.01, errors
    assert max(errors) < 0.10, errors
    assert statistics.median(ttft_errors) < 0.01, ttft_errors
    assert max(ttft_errors) < 0.10, ttft_errors


def test_running_and_waiting_from_its_metrics(fleet):
    sims, proxy = fleet
    url = proxy.url + CHAT
    # four long generations on a server that runs two at a time: two run, two wait
    threads = [
        threading.Thread(
            target=_post,
            args=(url, _chat(FP8, f"hold {i}", 150, ignore_eos=True)),
            daemon=True,
        )
        for i in range(4)
    ]
    for t in threads:
        t.start()

    def counts():
        s = metric_samples(proxy.url)
        return (
            sample(s, "phasewatch_engine_requests_running", upstream="fp", model=FP8),
            sample(s, "phasewatch_engine_requests_waiting", upstream="fp", model=FP8),
        )

    wait_for(lambda: counts() == (2, 2), what="two running and two waiting on the fp8 server")
    for t in threads:
        t.join(60)
    wait_for(lambda: counts() == (0, 0), what="the fp8 server idle again")


def test_metrics_off_is_said_once(fleet):
    sims, proxy = fleet
    s = metric_samples(proxy.url)
    assert sample(s, "phasewatch_engine_scrape_up", upstream="bf") == 0
    assert sample(s, "phasewatch_engine_scrape_up", upstream="fp") == 1
    # scraped every 0.1 s since the start: many refusals, one line
    wait_for(lambda: "serves no /metrics" in proxy.log(), what="the metrics-off line")
    assert proxy.log().count("serves no /metrics") == 1


@pytest.mark.parametrize(
    "path,body",
    [
        (CHAT, _chat(INT4, "bytes", 12)),
        (CHAT, _chat(INT4, "usage bytes", 12, stream_options={"include_usage": True})),
        (
            CHAT,
            _chat(
                INT4,
                "continuous",
                12,
                stream_options={"include_usage": True, "continuous_usage_stats": True},
            ),
        ),
        (CHAT, _chat(INT4, "sglext", 12, return_cached_tokens_details=True)),
        (CHAT, {**_chat(INT4, "whole", 12), "stream": False}),
        ("/v1/completions", {"model": INT4, "prompt": "complete", "max_tokens": 9, "stream": True}),
    ],
)
def test_bytes_equal_direct(fleet, path, body):
    sims, proxy = fleet
    direct = _post(sims["q4"].url + path, body)
    via = _post(proxy.url + path, body)
    assert via.status_code == direct.status_code == 200
    assert via.headers["content-type"] == direct.headers["content-type"]
    assert via.content == direct.content
    if body.get("return_cached_tokens_details"):
        assert b'"sglext":{"cached_tokens_details"' in via.content


def test_openai_sdk_reads_the_relayed_stream(fleet):
    sims, proxy = fleet
    body = _chat(BF16, "sdk", 10, stream_options={"include_usage": True})
    direct = _post(sims["bf"].url + CHAT, body).content
    text = "".join(
        json.loads(ev[6:])["choices"][0]["delta"]["content"] or ""
        for ev in direct.decode().split("\n\n")
        if ev.startswith("data: {") and json.loads(ev[6:])["choices"]
    )
    client = openai.OpenAI(base_url=proxy.url + "/v1", api_key="k", max_retries=0)
    got, usage = [], None
    for chunk in client.chat.completions.create(**{k: v for k, v in body.items()}):
        if chunk.choices:
            got.append(chunk.choices[0].delta.content or "")
        if chunk.usage is not None:
            usage = chunk.usage
    assert "".join(got) == text and text
    assert usage is not None and usage.completion_tokens == 10


def test_continuous_usage_is_replaced_not_added(fleet):
    sims, proxy = fleet
    before = metric_samples(proxy.url)
    body = _chat(
        FP8,
        "continuous usage",
        15,
        ignore_eos=True,
        stream_options={"include_usage": True, "continuous_usage_stats": True},
    )
    resp = _post(proxy.url + CHAT, body, **{"x-request-id": "sg-continuous"})
    assert resp.content.count(b'"usage":{') >= 15  # every chunk says the tokens so far
    line = wait_for(
        lambda: next(
            (ln for ln in proxy.request_lines() if ln["request_id"] == "sg-continuous"), None
        ),
        what="the request's line",
    )
    assert line["completion_tokens"] == "15" and line["outcome"] == "ok"
    after = metric_samples(proxy.url)
    assert _delta(before, after, "phasewatch_tokens_total", model=FP8, phase="decode") == 15


def test_abort_reaches_the_client_and_counts_as_an_error(fleet):
    sims, proxy = fleet
    before = metric_samples(proxy.url)
    body = _chat(INT4, "abort me", 2000, ignore_eos=True, rid="sg-abort-1")
    got = []
    with httpx.stream("POST", proxy.url + CHAT, json=body, timeout=60) as resp:
        assert resp.status_code == 200
        for chunk in resp.iter_bytes():
            got.append(chunk)
            if len(got) == 3:  # generating: the operator aborts it on the engine itself
                assert httpx.post(sims["q4"].url + "/abort_request", json={"rid": "sg-abort-1"})
    raw = b"".join(got)
    events = [e for e in raw.split(b"\n\n") if e]
    finish = json.loads(events[-2][6:])
    assert finish["choices"][0]["finish_reason"] == "abort"
    assert events[-1] == b"data: [DONE]" and raw.endswith(b"\n\n")
    assert b"upstream_error" not in raw  # relayed as the engine sent it, nothing added
    line = wait_for(
        lambda: next(
            (ln for ln in proxy.request_lines() if ln["model"] == INT4 and ln.get("error")), None
        ),
        what="the aborted request's line",
    )
    assert line["outcome"] == "error" and line["error"] == "midstream"
    after = metric_samples(proxy.url)
    assert _delta(before, after, "phasewatch_requests_total", model=INT4, outcome="error") == 1
    assert _delta(before, after, "phasewatch_errors_total", model=INT4, kind="midstream") == 1


def test_in_stream_error_relayed_and_counted(fleet):
    sims, proxy = fleet
    long_prompt = " ".join(["token"] * 33000)  # past the 32768-token context
    body = _chat(BF16, long_prompt, 10)
    direct = _post(sims["bf"].url + CHAT, body)
    before = metric_samples(proxy.url)
    via = _post(proxy.url + CHAT, body)
    assert via.status_code == direct.status_code == 200
    assert via.content == direct.content
    assert via.content.startswith(b'data: {"error": {"object": "error", "message": "The input (')
    assert via.content.endswith(b"data: [DONE]\n\n")
    after = metric_samples(proxy.url)
    assert _delta(before, after, "phasewatch_requests_total", model=BF16, outcome="error") == 1
    assert _delta(before, after, "phasewatch_errors_total", model=BF16, kind="midstream") == 1


def test_native_generate_is_measured(fleet):
    sims, proxy = fleet
    body = {
        "text": "the native endpoint",
        "sampling_params": {"max_new_tokens": 7, "ignore_eos": True},
        "stream": True,
    }
    resp = _post(proxy.url + "/generate", body, **{"x-request-id": "sg-native"})
    events = [e for e in resp.content.split(b"\n\n") if e]
    assert events[-1] == b"data: [DONE]"
    meta = json.loads(events[-2][6:])["meta_info"]
    assert meta["completion_tokens"] == 7
    line = wait_for(
        lambda: next((ln for ln in proxy.request_lines() if ln["request_id"] == "sg-native"), None),
        what="the native request's line",
    )
    assert line["endpoint"] == "sglang_generate" and line["outcome"] == "ok"
    assert int(line["completion_tokens"]) == 7
    assert int(line["prompt_tokens"]) == meta["prompt_tokens"]
    assert float(line["ttft_s"]) > 0
    # the whole answer too
    whole = _post(proxy.url + "/generate", {**body, "stream": False}).json()
    assert whole["meta_info"]["completion_tokens"] == 7


def test_admin_paths_refused(fleet):
    """Its route table's engine-management paths are guarded by --admin-api."""
    sims, _ = fleet
    proxy = start_proxy(f"q4={sims['q4'].url}", args=["--admin-api", "deny"])
    try:
        for path in ("/flush_cache", "/update_weights_from_disk", "/abort_request"):
            resp = httpx.post(proxy.url + path, json={})
            assert resp.status_code == 403, (path, resp.text)
        s = metric_samples(proxy.url)
        assert sample(s, "phasewatch_rejected_total", reason="admin_api") == 3
        # generation is not management
        assert _post(proxy.url + CHAT, {**_chat(INT4, "still served", 3), "stream": False})
    finally:
        proxy.stop()


# --- a hostile SGLang ------------------------------------------------------------------------

SECRET = "sk-sglang-secret-0123456789"


def _hostile(info: object):
    async def app(scope, receive, send):
        if scope["type"] != "http":
            return
        path = scope["path"]
        if path == "/model_info":
            body = json.dumps({"model_path": "org/Plain-Model", "is_generation": True}).encode()
        elif path == "/server_info":
            body = json.dumps(info).encode()
        elif path == "/v1/models":
            body = json.dumps(
                {"object": "list", "data": [{"id": "org/Plain-Model", "owned_by": "sglang"}]}
            ).encode()
        elif path == "/metrics":
            body = b'sglang:num_running_reqs{model_name="x" 1 not prometheus\n'
        else:
            body, path = b'{"detail":"Not Found"}', ""
        await send(
            {
                "type": "http.response.start",
                "status": 200 if path else 404,
                "headers": [(b"content-type", b"application/json")],
            }
        )
        await send({"type": "http.response.body", "body": body})

    return app


@pytest.mark.parametrize(
    "info",
    [
        {"api_key": SECRET, "quantization": "fp8", "dtype": "auto"},
        {"api_key": SECRET, "quantization": ["not", "a", "name"], "dtype": {"x": 1}},
        [SECRET],
        {"api_key": SECRET, "quantization": "x" * 100000},
    ],
)
def test_hostile_server_info_never_leaks_its_key(info):
    server = ThreadServer(_hostile(info), free_port()).start()
    proxy = start_proxy(f"h={server.url}", args=["--engine-scrape", "0.1"])
    try:
        ready = wait_for(
            lambda: (lambda r: r if r["upstreams"][0]["engine"] == "sglang" else None)(
                httpx.get(proxy.url + "/phasewatch/ready").json()
            ),
            what="the hostile SGLang recognised",
        )
        assert ready["upstreams"][0]["up"]
        s = metric_samples(proxy.url)
        expected = (
            "fp8" if isinstance(info, dict) and info.get("quantization") == "fp8" else "unknown"
        )
        assert sample(s, "phasewatch_model_info", model="org/Plain-Model", precision=expected) == 1
        wait_for(
            lambda: (
                sample(metric_samples(proxy.url), "phasewatch_engine_scrape_up", upstream="h") == 0
            ),
            what="the broken /metrics scraped",
        )
        pages = [
            httpx.get(proxy.url + p).text
            for p in ("/metrics", "/phasewatch/ready", "/phasewatch/api/status")
        ]
        assert all(SECRET not in page for page in pages)
        assert SECRET not in proxy.log()
    finally:
        proxy.stop()
        server.stop()


def test_report_and_advise_name_the_engine(fleet):
    sims, proxy = fleet
    client = openai.OpenAI(base_url=proxy.url + "/v1", api_key="k", max_retries=0)
    for _ in client.chat.completions.create(**_chat(FP8, "for the report", 20)):
        pass
    wait_for(
        lambda: sample(
            metric_samples(proxy.url), "phasewatch_decode_tokens_per_second_count", model=FP8
        ),
        what="a measured decode",
    )
    run = [sys.executable, "-m", "proxy"]
    rep = subprocess.run(
        [*run, "report", "--from", proxy.url, "--format", "json"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert rep.returncode == 0, rep.stderr
    rows = json.loads(rep.stdout)["rows"]
    assert {r["engine"] for r in rows if r["upstream"] in ("fp", "q4")} == {"sglang"}
    text = subprocess.run(
        [*run, "report", "--from", proxy.url], capture_output=True, text=True, timeout=120
    ).stdout
    note = next(line for line in text.splitlines() if line.startswith("- engines: "))
    assert "fp = sglang" in note
    advice = subprocess.run(
        [*run, "advise", "--from", proxy.url], capture_output=True, text=True, timeout=120
    ).stdout
    assert "### fp (sglang) / RedHatAI/Llama-3.1-8B-Instruct-FP8" in advice
