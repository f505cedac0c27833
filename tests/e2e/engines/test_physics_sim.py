"""The memory side of the physics and the vLLM-parity figures, end to end on the
simulator: each simulated engine behind a real phasewatch, driven by the real SDKs.

Every KV figure is checked against a hand computation of 2 x layers x kv_heads x head_dim x
bytes per element from the simulated models' published shapes (Llama 3.1 8B: 32 layers,
8 KV heads of 128; Qwen2.5 7B: 28 layers, 4 KV heads of 128), and per request against the
simulator's ground-truth token counts.
"""

from __future__ import annotations

import subprocess
import sys
import tempfile

import httpx
import ollama
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from ...support.servers import ROOT, metric_samples, sample, start_proxy, start_sim, wait_for

LLAMA_BF16 = "meta-llama/Llama-3.1-8B-Instruct"
LLAMA_FP8 = "RedHatAI/Llama-3.1-8B-Instruct-FP8"
LLAMA_AWQ = "hugging-quants/Llama-3.1-8B-Instruct-AWQ-INT4"


@pytest.fixture(scope="module")
def vllm():
    model_dir = tempfile.mkdtemp(prefix="pw-ckpt-")
    sim = start_sim("vllm", speed=20.0, extra=["--model-dir", model_dir])
    proxy = start_proxy(f"sim={sim.url}", args=["--model-dir", model_dir, "--engine-scrape", "0.2"])
    yield sim, proxy
    proxy.stop()
    sim.stop()


@pytest.fixture(scope="module")
def ollama_pair():
    sim = start_sim("ollama", speed=20.0)
    proxy = start_proxy(
        f"sim={sim.url}",
        args=["--kv-cache-dtype", "llama3.1:8b-instruct-q4_K_M=q8_0", "--engine-scrape", "0.2"],
    )
    yield sim, proxy
    proxy.stop()
    sim.stop()


@pytest.fixture(scope="module")
def llama():
    sim = start_sim("llamacpp", speed=20.0, max_num_seqs=4)
    proxy = start_proxy(f"sim={sim.url}", args=["--engine-scrape", "0.2"])
    yield sim, proxy
    proxy.stop()
    sim.stop()


def kv_per_token(samples) -> dict[str, tuple[str, float]]:
    return {
        dict(k[1])["model"]: (dict(k[1])["kv_dtype"], v)
        for k, v in samples.items()
        if k[0] == "phasewatch_model_kv_bytes_per_token"
    }


# --- vLLM -------------------------------------------------------------------------------------


def test_vllm_kv_bytes_per_token_by_hand(vllm):
    _, proxy = vllm
    # the cache's element type is vLLM's word (cache_config_info): unknown until scraped
    got = wait_for(
        lambda: (
            lambda g: g if len(g) == 3 and all(d != "unknown" for d, _ in g.values()) else None
        )(kv_per_token(metric_samples(proxy.url))),
        what="vLLM's cache_config_info scraped",
    )
    per_token = 2 * 32 * 8 * 128  # elements: K and V of 32 layers, 8 KV heads of 128
    assert got[LLAMA_BF16] == ("bf16", per_token * 2)  # cache "auto": the config's bf16
    assert got[LLAMA_FP8] == ("fp8", per_token * 1)  # --kv-cache-dtype fp8_e4m3: halved
    assert got[LLAMA_AWQ] == ("fp16", per_token * 2)  # AWQ checkpoints run in fp16


def test_vllm_capacity_requests_tpot_and_engine_histograms(vllm):
    sim, proxy = vllm
    client = openai.OpenAI(base_url=proxy.url + "/v1", api_key="x", max_retries=0)
    for n in (8, 20):
        stream = client.chat.completions.create(
            model=LLAMA_BF16,
            messages=[{"role": "user", "content": " ".join(["word"] * n)}],
            max_tokens=n,
            stream=True,
        )
        for _ in stream:
            pass
    truth = wait_for(
        lambda: (lambda t: t if len(t) >= 2 else None)(
            [t for t in sim.truth() if t["model"] == LLAMA_BF16]
        ),
        what="the engine's records of both streams",
    )
    assert len(truth) == 2

    def scraped():
        s = metric_samples(proxy.url)
        ok = sample(s, "phasewatch_engine_ttft_seconds_count", model=LLAMA_BF16) == 2
        return s if ok else None

    s = wait_for(scraped, what="the engine's histograms re-exported")
    base = {"model": LLAMA_BF16, "precision": "bf16"}
    # KV bytes per request: (prompt + completion tokens) x 131072, from the engine's truth
    tokens = [t["prompt_tokens"] + t["completion_tokens"] for t in truth]
    assert sample(s, "phasewatch_kv_cache_bytes_count", **base) == 2
    assert sample(s, "phasewatch_kv_cache_bytes_sum", **base) == sum(tokens) * 131072
    # capacity: (24 GB x 0.9 - 8.03e9 params x 2 bytes) / (131072 x 16-token blocks)
    blocks = int((24e9 * 0.9 - 8.03e9 * 2) // (131072 * 16))
    assert sample(s, "phasewatch_engine_kv_cache_capacity_tokens", **base) == blocks * 16
    # time per output token = decode seconds / (completion - 1), one per stream
    assert sample(s, "phasewatch_time_per_output_token_seconds_count", **base, source="proxy") == 2
    tpot_sum = sample(s, "phasewatch_time_per_output_token_seconds_sum", **base, source="proxy")
    rates = [
        float(line["decode_tps"])
        for line in proxy.request_lines()
        if line["model"] == LLAMA_BF16 and "decode_tps" in line
    ]
    assert len(rates) == 2
    assert tpot_sum == pytest.approx(sum(1 / r for r in rates), rel=1e-3)
    # vLLM's own histograms come through as the engine exported them, bucket for bucket
    engine = {}
    text = httpx.get(sim.url + "/metrics", timeout=10).text
    for fam in text_string_to_metric_families(text):
        for x in fam.samples:
            if x.labels.get("model_name") == LLAMA_BF16:
                engine[(x.name, x.labels.get("le"))] = x.value
    pairs = {
        "vllm:time_to_first_token_seconds": "phasewatch_engine_ttft_seconds",
        "vllm:e2e_request_latency_seconds": "phasewatch_engine_e2e_request_seconds",
        "vllm:request_time_per_output_token_seconds": (
            "phasewatch_engine_time_per_output_token_seconds"
        ),
    }
    for theirs, ours in pairs.items():
        for (name, le), value in engine.items():
            if name == theirs + "_bucket":
                le_ours = "+Inf" if le == "+Inf" else repr(float(le))
                assert s[(ours + "_bucket", _key(base, le_ours))] == value, (ours, le)
            elif name in (theirs + "_sum", theirs + "_count"):
                suffix = name[len(theirs) :]
                assert s[(ours + suffix, _key(base))] == pytest.approx(value), name
    assert sample(s, "phasewatch_engine_preemptions_total", **base) == 0
    prompt_tokens = sum(t["prompt_tokens"] for t in truth)
    assert sample(s, "phasewatch_engine_prefix_cache_queries_total", **base) == prompt_tokens


def test_vllm_status_page_and_report_rows(vllm):
    """The status page's JSON and `phasewatch report` carry TPOT and the KV figures (after
    the streams of the test above)."""
    _, proxy = vllm
    rows = httpx.get(proxy.url + "/phasewatch/api/summary", timeout=10).json()["rows"]
    row = next(r for r in rows if r["model"] == LLAMA_BF16)
    assert row["kv_bytes_per_token"] == 131072 and row["kv_dtype"] == "bf16"
    assert row["tpot_ms"] > 0 and row["kv_request_bytes"] > 0
    blocks = int((24e9 * 0.9 - 8.03e9 * 2) // (131072 * 16))
    assert row["kv_capacity_tokens"] == blocks * 16
    assert row["kv_fit_requests"] == pytest.approx(blocks * 16 * 131072 / row["kv_request_bytes"])
    out = subprocess.run(
        [sys.executable, "-m", "proxy", "report", "--from", proxy.url],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
    ).stdout
    assert "| TPOT ms | KV B/tok |" in out and "131,072 (bf16)" in out


def _key(base: dict, le: str | None = None) -> tuple:
    labels = {**base, "upstream": "sim"}
    if le is not None:
        labels["le"] = le
    return tuple(sorted(labels.items()))


def test_vllm_embeddings_measured_and_byte_exact(vllm):
    sim, proxy = vllm
    client = openai.OpenAI(base_url=proxy.url + "/v1", api_key="x", max_retries=0)
    got = client.embeddings.create(model=LLAMA_FP8, input=["the quick brown fox", "jumps"])
    assert len(got.data) == 2 and got.usage.prompt_tokens == 5
    body = {"model": LLAMA_FP8, "input": "one two three"}
    direct = httpx.post(sim.url + "/v1/embeddings", json=body, timeout=10)
    proxied = httpx.post(proxy.url + "/v1/embeddings", json=body, timeout=10)
    assert proxied.content == direct.content and proxied.status_code == 200
    s = metric_samples(proxy.url)
    base = {"model": LLAMA_FP8, "endpoint": "embeddings"}
    assert sample(s, "phasewatch_requests_total", **base, outcome="ok") == 2
    assert sample(s, "phasewatch_request_seconds_count", **base, outcome="ok") == 2
    assert sample(s, "phasewatch_prompt_tokens_sum", model=LLAMA_FP8) == 5 + 3
    assert sample(s, "phasewatch_tokens_total", model=LLAMA_FP8, phase="prefill") == 8
    # nothing generated: no completion tokens, no KV held, no TTFT
    assert sample(s, "phasewatch_completion_tokens_count", model=LLAMA_FP8) == 0
    assert sample(s, "phasewatch_kv_cache_bytes_count", model=LLAMA_FP8) == 0
    assert sample(s, "phasewatch_ttft_seconds_count", model=LLAMA_FP8) == 0
    # an engine's refusal is counted as an error, its bytes passed on
    bad = httpx.post(proxy.url + "/v1/embeddings", json={"model": LLAMA_FP8}, timeout=10)
    assert bad.status_code == 400
    s = metric_samples(proxy.url)
    assert sample(s, "phasewatch_requests_total", **base, outcome="error") == 1


# --- Ollama -----------------------------------------------------------------------------------


def test_ollama_kv_from_api_show_by_hand(ollama_pair):
    _, proxy = ollama_pair
    got = kv_per_token(metric_samples(proxy.url))
    per_token = 2 * 32 * 8 * 128
    # the weights' quantisation does not change the cache: f16 (Ollama's default) for all,
    # but the q4_K_M model was said to run with OLLAMA_KV_CACHE_TYPE=q8_0 (34 B per 32)
    assert got["llama3.1:8b-instruct-fp16"] == ("fp16", per_token * 2)
    assert got["llama3.1:8b-instruct-q8_0"] == ("fp16", per_token * 2)
    assert got["llama3.1:8b-instruct-q4_K_M"] == ("q8_0", per_token * 34 / 32)


def test_ollama_embeddings_every_endpoint(ollama_pair):
    sim, proxy = ollama_pair
    model = "llama3.1:8b-instruct-q8_0"
    c = ollama.Client(host=proxy.url)
    got = c.embed(model=model, input=["hello there world", "two words"])
    assert len(got.embeddings) == 2 and got.prompt_eval_count == 5
    legacy = c.embeddings(model=model, prompt="just one")
    assert len(legacy.embedding) == 8
    oa = openai.OpenAI(base_url=proxy.url + "/v1", api_key="x", max_retries=0)
    v1 = oa.embeddings.create(model=model, input="a b c d")
    assert v1.usage.prompt_tokens == 4
    body = {"model": model, "input": "same bytes"}
    direct = httpx.post(sim.url + "/v1/embeddings", json=body, timeout=10)
    proxied = httpx.post(proxy.url + "/v1/embeddings", json=body, timeout=10)
    assert proxied.content == direct.content
    s = metric_samples(proxy.url)
    for endpoint, n in (("ollama_embed", 1), ("ollama_embeddings", 1), ("embeddings", 2)):
        assert sample(s, "phasewatch_requests_total", model=model, endpoint=endpoint) == n
        assert sample(s, "phasewatch_request_seconds_count", model=model, endpoint=endpoint) == n
    # /api/embed and /v1 count their input; the older /api/embeddings says nothing
    assert sample(s, "phasewatch_prompt_tokens_sum", model=model) == 5 + 4 + 2
    assert sample(s, "phasewatch_prompt_tokens_count", model=model) == 3
    assert sample(s, "phasewatch_load_seconds_count", model=model) == 1  # /api/embed's


# --- llama-server -------------------------------------------------------------------------------


def test_llamacpp_kv_from_the_gguf_file_by_hand(llama):
    sim, proxy = llama
    props = httpx.get(sim.url + "/props", timeout=10).json()
    assert props["model_path"].endswith("qwen2.5-7b-instruct-q4_k_m.gguf")
    s = metric_samples(proxy.url)
    # Qwen2.5 7B: 28 layers, 4 KV heads of 128, f16 cache (llama.cpp's default)
    assert kv_per_token(s)["qwen2.5-7b-instruct"] == ("fp16", 2 * 28 * 4 * 128 * 2)
    # capacity: 4 slots of 4096 tokens
    cap = wait_for(
        lambda: sample(metric_samples(proxy.url), "phasewatch_engine_kv_cache_capacity_tokens"),
        what="the slots' capacity",
    )
    assert cap == 4 * 4096
    client = openai.OpenAI(base_url=proxy.url + "/v1", api_key="x", max_retries=0)
    n_before = len(sim.truth())
    for _ in client.chat.completions.create(
        model="qwen2.5-7b-instruct",
        messages=[{"role": "user", "content": "tell me about the physics of decode"}],
        max_tokens=12,
        stream=True,
    ):
        pass
    truth = sim.truth(at_least=n_before + 1)[-1]
    s = metric_samples(proxy.url)
    tokens = truth["prompt_tokens"] + truth["completion_tokens"]
    assert sample(s, "phasewatch_kv_cache_bytes_sum") == tokens * 57344
    # the engine's own time per output token: predicted_ms / (predicted_n - 1)
    t = truth["reported"]
    engine_tpot = sample(s, "phasewatch_time_per_output_token_seconds_sum", source="engine")
    assert engine_tpot == pytest.approx(t["predicted_ms"] / 1000 / (t["predicted_n"] - 1))


def test_llamacpp_embeddings(llama):
    sim, proxy = llama
    oa = openai.OpenAI(base_url=proxy.url + "/v1", api_key="x", max_retries=0)
    got = oa.embeddings.create(model="qwen2.5-7b-instruct", input=["one two", "three"])
    assert got.usage.prompt_tokens == 3
    native = httpx.post(proxy.url + "/embedding", json={"content": "four five six"}, timeout=10)
    direct = httpx.post(sim.url + "/embedding", json={"content": "four five six"}, timeout=10)
    assert native.content == direct.content
    s = metric_samples(proxy.url)
    assert sample(s, "phasewatch_requests_total", endpoint="embeddings", outcome="ok") == 1
    assert sample(s, "phasewatch_requests_total", endpoint="llamacpp_embedding", outcome="ok") == 1
    assert sample(s, "phasewatch_prompt_tokens_sum", model="qwen2.5-7b-instruct") >= 3
