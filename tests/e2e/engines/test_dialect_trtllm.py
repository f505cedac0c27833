"""TensorRT-LLM (``trtllm-serve``) through phasewatch: three simulated servers (one model
each) behind one proxy. Recognised (not mistaken for vLLM, which also answers /version),
precision from ``trtllm_model_config_info``, figures against the simulator's truth, its
state from ``/prometheus/metrics``, byte-exact relay through the openai SDK, hostile
metrics pages."""

from __future__ import annotations

import json
import statistics
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
    sims = {
        name: start_sim(
            "trtllm",
            speed=SPEED,
            deterministic=True,
            jitter=0.02,
            max_num_seqs=2 if name == "fp" else 16,
            # the fp8 server runs its energy monitor (/energy_metrics)
            extra=["--served-model", model] + (["--enable-metrics"] if name == "fp" else []),
        )
        for name, model in (("bf", BF16), ("fp", FP8), ("q4", INT4))
    }
    proxy = start_proxy(
        *(f"{name}={sim.url}" for name, sim in sims.items()), args=["--engine-scrape", "0.1"]
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


def test_recognised_with_each_precision(fleet):
    sims, proxy = fleet
    ready = httpx.get(proxy.url + "/phasewatch/ready").json()
    assert {u["name"]: u["engine"] for u in ready["upstreams"]} == {
        "bf": "trtllm",
        "fp": "trtllm",
        "q4": "trtllm",
    }
    s = metric_samples(proxy.url)
    for model, precision, quant in (
        (BF16, "bf16", "BFLOAT16"),
        (FP8, "fp8", "FP8"),
        (INT4, "int4", "W4A16_AWQ"),
    ):
        assert (
            sample(
                s,
                "phasewatch_model_info",
                model=model,
                precision=precision,
                quant=quant,
                precision_source="engine",
            )
            == 1
        ), model


def test_figures_match_simulator_truth(fleet):
    sims, proxy = fleet
    client = openai.OpenAI(base_url=proxy.url + "/v1", api_key="unused", max_retries=0)
    client_ttft, ids = [], []
    for i, model in enumerate((BF16, FP8, INT4) * 2):
        rid = f"trt-truth-{i}"
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
        ln["request_id"]: ln
        for ln in wait_for(
            lambda: (lambda got: got if len(got) == 6 else None)(
                [ln for ln in proxy.request_lines() if ln["request_id"].startswith("trt-truth-")]
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
        assert line["outcome"] == "ok" and line["precision"] in ("bf16", "fp8", "int4")
        assert int(line["completion_tokens"]) == t["completion_tokens"] == 50
        assert int(line["prompt_tokens"]) == t["prompt_tokens"]
        assert t["ttft_seconds"] <= float(line["ttft_s"]) <= c_ttft
        ttft_errors.append(float(line["ttft_s"]) / t["ttft_seconds"] - 1)
        errors.append(abs(float(line["decode_tps"]) / t["decode_tokens_per_second"] - 1))
    assert statistics.median(errors) < 0.01, errors
    assert max(errors) < 0.10, errors
    assert statistics.median(ttft_errors) < 0.01, ttft_errors
    assert max(ttft_errors) < 0.10, ttft_errors


def test_its_energy_is_re_exported_beside_ours(fleet):
    """/energy_metrics, where the server has an energy monitor, as the engine says it."""
    sims, proxy = fleet

    def nvml_joules() -> float:
        return httpx.get(sims["fp"].url + "/sim/nvml").json()["gpus"][0]["energy_mj"] / 1000

    def said() -> float:
        s = metric_samples(proxy.url)
        return sample(s, "phasewatch_engine_energy_joules_total", upstream="fp", model=FP8)

    before = nvml_joules()
    wait_for(lambda: said() >= before, what="a scrape after the GPU's reading")
    value = said()
    assert before <= value <= nvml_joules() + 1e-3  # the counter as the GPU kept it
    # without a monitor (503) nothing is re-exported
    series = [
        dict(labels)
        for name, labels in metric_samples(proxy.url)
        if name == "phasewatch_engine_energy_joules_total"
    ]
    assert [s["upstream"] for s in series] == ["fp"]


def test_running_and_waiting_from_its_prometheus_page(fleet):
    sims, proxy = fleet
    threads = [
        threading.Thread(
            target=_post,
            args=(proxy.url + CHAT, _chat(FP8, f"hold {i}", 150, ignore_eos=True)),
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
    s = metric_samples(proxy.url)
    # its KV cache's size: max blocks × tokens per block
    assert sample(s, "phasewatch_engine_kv_cache_capacity_tokens", upstream="fp") == 262144
    for t in threads:
        t.join(60)
    wait_for(lambda: counts() == (0, 0), what="the fp8 server idle again")


@pytest.mark.parametrize(
    "path,body",
    [
        (CHAT, _chat(INT4, "bytes", 12)),
        (CHAT, _chat(INT4, "usage", 12, stream_options={"include_usage": True})),
        (
            CHAT,
            _chat(
                INT4,
                "continuous",
                12,
                stream_options={"include_usage": True, "continuous_usage_stats": True},
            ),
        ),
        (CHAT, {**_chat(INT4, "whole", 12), "stream": False}),
        ("/v1/completions", {"model": INT4, "prompt": "complete", "max_tokens": 9, "stream": True}),
        (CHAT, _chat(INT4, " ".join(["long"] * 33000), 5)),  # a 400 before any stream
    ],
)
def test_bytes_equal_direct(fleet, path, body):
    sims, proxy = fleet
    direct = _post(sims["q4"].url + path, body)
    via = _post(proxy.url + path, body)
    assert via.status_code == direct.status_code
    assert via.headers["content-type"] == direct.headers["content-type"]
    assert via.content == direct.content


def test_openai_sdk_reads_the_relayed_stream(fleet):
    sims, proxy = fleet
    body = _chat(BF16, "sdk", 10, stream_options={"include_usage": True})
    direct = _post(sims["bf"].url + CHAT, body).content
    text = "".join(
        json.loads(ev[6:])["choices"][0]["delta"].get("content") or ""
        for ev in direct.decode().split("\n\n")
        if ev.startswith("data: {") and json.loads(ev[6:])["choices"]
    )
    client = openai.OpenAI(base_url=proxy.url + "/v1", api_key="k", max_retries=0)
    got, usage = [], None
    for chunk in client.chat.completions.create(**body):
        if chunk.choices:
            got.append(chunk.choices[0].delta.content or "")
        if chunk.usage is not None:
            usage = chunk.usage
    assert "".join(got) == text and text
    assert usage is not None and usage.completion_tokens == 10


def test_admin_paths_refused(fleet):
    sims, _ = fleet
    proxy = start_proxy(f"q4={sims['q4'].url}", args=["--admin-api", "deny"])
    try:
        for path in ("/update_weights", "/release_memory", "/resume_memory"):
            assert httpx.post(proxy.url + path, json={}).status_code == 403, path
    finally:
        proxy.stop()


# --- a hostile trtllm-serve -------------------------------------------------------------------


def _hostile(metrics: bytes):
    async def app(scope, receive, send):
        if scope["type"] != "http":
            return
        path, status = scope["path"], 200
        if path == "/v1/models":
            body = json.dumps(
                {"object": "list", "data": [{"id": "org/Plain-Model", "owned_by": "tensorrt_llm"}]}
            ).encode()
        elif path == "/version":
            body = b'{"version":"1.2.0"}'
        elif path == "/prometheus/metrics":
            body = metrics
        else:
            body, status = b'{"detail":"Not Found"}', 404
        await send(
            {
                "type": "http.response.start",
                "status": status,
                "headers": [(b"content-type", b"text/plain")],
            }
        )
        await send({"type": "http.response.body", "body": body})

    return app


@pytest.mark.parametrize(
    "metrics",
    [
        b'trtllm_num_requests_running{model_name="org/Plain-Model" 3 broken\n',
        b"\xff\xfe" * 5000,
        b'trtllm_model_config_info{model_name="org/Plain-Model",dtype="'
        + b"x" * 5000
        + b'",quantization="\\u0000"} 1\n',
        b"# TYPE trtllm_num_requests_running gauge\ntrtllm_num_requests_running NaN\n",
    ],
)
def test_hostile_metrics_page(metrics):
    server = ThreadServer(_hostile(metrics), free_port()).start()
    proxy = start_proxy(f"h={server.url}", args=["--engine-scrape", "0.1"])
    try:
        wait_for(
            lambda: (
                httpx.get(proxy.url + "/phasewatch/ready").json()["upstreams"][0]["engine"]
                == "trtllm"
            ),
            what="the hostile server recognised as trtllm",
        )
        s = wait_for(
            lambda: (
                lambda got: got if any(n == "phasewatch_engine_scrape_up" for n, _ in got) else None
            )(metric_samples(proxy.url)),
            what="the metrics page scraped",
        )
        assert sample(s, "phasewatch_model_info", model="org/Plain-Model", precision="unknown") == 1
        running = [v for (name, _), v in s.items() if name == "phasewatch_engine_requests_running"]
        assert all(v == v and abs(v) != float("inf") for v in running)  # no NaN, no Inf
        # the proxy still relays and answers its own pages
        assert httpx.get(proxy.url + "/metrics").status_code == 200
        assert httpx.get(proxy.url + "/v1/models").json()["data"][0]["id"] == "org/Plain-Model"
    finally:
        proxy.stop()
        server.stop()
