"""One phasewatch in front of a vLLM, an Ollama and a llama-server (all simulated), with no
configuration: engines detected, requests routed by model, model lists merged, precision
per engine, and the engines' own gauges re-exported under phasewatch names."""

from __future__ import annotations

import time

import httpx
import ollama
import openai
import pytest

from ...support.servers import (
    Server,
    _spawn,
    free_port,
    metric_samples,
    sample,
    start_proxy,
    start_sim,
    wait_for,
)

VLLM = {
    "meta-llama/Llama-3.1-8B-Instruct": "bf16",
    "RedHatAI/Llama-3.1-8B-Instruct-FP8": "fp8",
    "hugging-quants/Llama-3.1-8B-Instruct-AWQ-INT4": "int4",
}
OLLAMA = {
    "llama3.1:8b-instruct-fp16": "fp16",
    "llama3.1:8b-instruct-q8_0": "int8",
    "llama3.1:8b-instruct-q4_K_M": "int4",
}
LLAMA = {"qwen2.5-7b-instruct": "int4"}


@pytest.fixture(scope="module")
def three():
    sims = {e: start_sim(e, speed=8.0, deterministic=True) for e in ("vllm", "ollama", "llamacpp")}
    proxy = start_proxy(*(f"{e}={s.url}" for e, s in sims.items()), args=["--engine-scrape", "0.3"])
    yield sims, proxy
    proxy.stop()
    for s in sims.values():
        s.stop()


def test_engines_detected_without_configuration(three):
    sims, proxy = three
    s = metric_samples(proxy.url)
    for engine in sims:
        assert sample(s, "phasewatch_upstream_up", upstream=engine, engine=engine) == 1
    for models, upstream in ((VLLM, "vllm"), (OLLAMA, "ollama"), (LLAMA, "llamacpp")):
        for model, precision in models.items():
            assert (
                sample(
                    s, "phasewatch_model_info", upstream=upstream, model=model, precision=precision
                )
                == 1
            ), (model, precision)


def test_requests_routed_by_model(three):
    sims, proxy = three
    client = openai.OpenAI(base_url=proxy.url + "/v1", api_key="k", max_retries=0)
    for models in (VLLM, OLLAMA, LLAMA):
        for model in models:
            stream = client.chat.completions.create(
                model=model,
                messages=[{"role": "user", "content": "compare precisions"}],
                max_tokens=20,
                stream=True,
            )
            chunks = list(stream)
            assert chunks[0].model == model
            assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    # Ollama's own API and short names reach the Ollama upstream too
    r = ollama.Client(host=proxy.url).chat(
        model="llama3.1:8b-instruct-q8_0", messages=[{"role": "user", "content": "hi"}]
    )
    assert r.eval_count and r.done_reason
    expected = len(VLLM) + len(OLLAMA) + len(LLAMA) + 1
    wait_for(lambda: len(proxy.request_lines()) >= expected, what="every request recorded")
    s = metric_samples(proxy.url)
    for models, upstream in ((VLLM, "vllm"), (OLLAMA, "ollama"), (LLAMA, "llamacpp")):
        for model, precision in models.items():
            assert (
                sample(
                    s,
                    "phasewatch_requests_total",
                    upstream=upstream,
                    model=model,
                    precision=precision,
                    outcome="ok",
                )
                >= 1
            )
            assert (
                sample(
                    s,
                    "phasewatch_decode_tokens_per_second_count",
                    upstream=upstream,
                    model=model,
                    source="proxy",
                )
                >= 1
            )
    # the engines that report their own phases have source="engine" figures beside ours
    assert (
        sample(s, "phasewatch_decode_tokens_per_second_count", upstream="llamacpp", source="engine")
        >= 1
    )
    assert sample(s, "phasewatch_prefill_seconds_count", upstream="ollama", source="engine") >= 1
    assert sample(s, "phasewatch_prefill_seconds_count", upstream="vllm", source="engine") == 0


def test_model_lists_are_merged(three):
    sims, proxy = three
    ids = [m["id"] for m in httpx.get(proxy.url + "/v1/models").json()["data"]]
    assert sorted(ids) == sorted([*VLLM, *OLLAMA, *LLAMA])
    listed = openai.OpenAI(base_url=proxy.url + "/v1", api_key="k").models.list()
    assert {m.id for m in listed} == set(ids)
    # an Ollama client is offered the models it can use: the Ollama upstream's, as written
    tags = ollama.Client(host=proxy.url).list().models
    by_name = {m.model: m.details.quantization_level for m in tags}
    assert set(by_name) == set(OLLAMA)
    assert by_name["llama3.1:8b-instruct-q8_0"] == "Q8_0"
    # a model's own card goes to the upstream serving it
    card = httpx.get(proxy.url + "/v1/models/qwen2.5-7b-instruct")
    assert card.status_code == 404  # llama-server has no per-model card: its own answer


def test_engine_gauges(three):
    sims, proxy = three
    client = openai.OpenAI(base_url=proxy.url + "/v1", api_key="k", max_retries=0)
    client.chat.completions.create(
        model="llama3.1:8b-instruct-q4_K_M",
        max_tokens=3,
        messages=[{"role": "user", "content": "x"}],
    )
    deadline = time.monotonic() + 10
    while True:
        s = metric_samples(proxy.url)
        ok = (
            sample(s, "phasewatch_engine_model_loaded", upstream="ollama", precision="int4") >= 1
            and any(
                n == "phasewatch_engine_requests_running" and dict(k).get("upstream") == "vllm"
                for n, k in s
            )
            and any(
                n == "phasewatch_engine_kv_cache_usage_ratio"
                and dict(k).get("upstream") == "llamacpp"
                for n, k in s
            )
        )
        if ok or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert ok
    for engine in ("vllm", "ollama", "llamacpp"):
        assert sample(s, "phasewatch_engine_scrape_up", upstream=engine, engine=engine) == 1
    assert (
        sample(
            s,
            "phasewatch_engine_requests_waiting",
            upstream="vllm",
            model="meta-llama/Llama-3.1-8B-Instruct",
            precision="bf16",
        )
        == 0
    )
    assert (
        sample(
            s,
            "phasewatch_engine_requests_running",
            upstream="llamacpp",
            model="qwen2.5-7b-instruct",
            precision="int4",
        )
        == 0
    )


def test_engine_redetected_when_the_upstream_comes_back():
    port = free_port()
    proxy = start_proxy(f"late=http://127.0.0.1:{port}", args=["--model-refresh", "0.3"])
    sim = None
    try:

        def wait_engine(engine: str) -> None:
            deadline = time.monotonic() + 20
            while time.monotonic() < deadline:
                if sample(metric_samples(proxy.url), "phasewatch_upstream_up", engine=engine) == 1:
                    return
                time.sleep(0.2)
            raise AssertionError(f"not detected as {engine}: {metric_samples(proxy.url)}")

        for engine, ready in (("ollama", "/api/version"), ("llamacpp", "/health")):
            proc, log = _spawn(
                ["simulate", "--engine", engine, "--port", str(port), "--speed", "8"], port, ready
            )
            sim = Server(proc, f"http://127.0.0.1:{port}", log)
            wait_engine(engine)
            s = metric_samples(proxy.url)
            assert sum(v for (n, k), v in s.items() if n == "phasewatch_upstream_up") == 1
            sim.stop()
            sim = None
    finally:
        if sim is not None:
            sim.stop()
        proxy.stop()


def test_one_model_name_at_two_precisions_on_two_upstreams():
    """The same model name served by two engines keeps each engine's precision."""
    from proxy.app import ProxyApp
    from proxy.measure.precision import Precision
    from proxy.settings import Settings

    app = ProxyApp(
        Settings(
            upstream=["gguf=http://127.0.0.1:9", "hf=http://127.0.0.1:10"], precision=["pinned=fp8"]
        )
    )
    gguf, hf = app.upstreams.all
    gguf.precision.set_engine("qwen2.5-7b", Precision("int4", "Q4_K_M", "engine"))
    hf.precision.set_engine("qwen2.5-7b", Precision("bf16", "BF16", "engine"))
    assert gguf.precision.get("qwen2.5-7b").precision == "int4"
    assert hf.precision.get("qwen2.5-7b").precision == "bf16"
    assert gguf.precision.get("pinned").precision == hf.precision.get("pinned").precision == "fp8"
