"""KV-cache figures, vLLM's own histograms and embeddings on the real engines.

Hand computations: Gemma 3 270M (llama-server): 18 layers of which 15 slide over a
512-token window, 1 KV head of 256, f16 cache: 2 x 18 x 1 x 256 x 2 = 18,432 bytes per
token while the context fits the window; a request of T tokens holds
2 x 1 x 256 x 2 x (3 T + 15 min(T, 512)). The tiny vLLM model: 8 layers, 8 KV heads of
64, fp32: 2 x 8 x 8 x 64 x 4 = 32,768 bytes per token, which times vLLM's own
kv_cache_size_tokens must be vLLM's kv_cache_memory_bytes.
"""

from __future__ import annotations

from pathlib import Path

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from ..support.servers import metric_samples, sample, start_proxy, wait_for
from . import engines as E

pytestmark = pytest.mark.real_engine


def gemma_bytes(tokens: int) -> int:
    return 2 * 1 * 256 * 2 * (3 * tokens + 15 * min(tokens, 512))


# --- llama-server --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def llama_physics(llama):
    proxy = start_proxy(f"llama={llama.url}", args=["--engine-scrape", "0.5"])
    yield proxy
    proxy.stop()


def test_gemma3_kv_from_its_gguf_by_hand(llama, llama_physics):
    proxy = llama_physics
    s = wait_for(
        lambda: (lambda x: x if sample(x, "phasewatch_engine_kv_cache_capacity_tokens") else None)(
            metric_samples(proxy.url)
        ),
        what="llama-server's slots scraped",
    )
    per_token = sample(s, "phasewatch_model_kv_bytes_per_token", kv_dtype="fp16")
    assert per_token == 2 * 18 * 1 * 256 * 2 == 18432
    assert sample(s, "phasewatch_engine_kv_cache_capacity_tokens") == 4 * 4096  # -c 16384 -np 4
    client = openai.OpenAI(base_url=proxy.url + "/v1", api_key="x", max_retries=0)
    words = " ".join(["the quick brown fox jumps over the lazy dog"] * 80)  # beyond the window
    client.chat.completions.create(
        model=E.LLAMA_ALIAS,
        messages=[{"role": "user", "content": words}],
        max_tokens=8,
        temperature=0,
    )
    line = wait_for(proxy.request_lines, what="the request's log line")[-1]
    tokens = int(line["prompt_tokens"]) + int(line["completion_tokens"])
    assert tokens > 512
    s = metric_samples(proxy.url)
    assert sample(s, "phasewatch_kv_cache_bytes_count") == 1
    assert sample(s, "phasewatch_kv_cache_bytes_sum") == gemma_bytes(tokens)


@pytest.fixture(scope="module")
def llama_embeddings(engines_manifest):
    server = E.start_llama_server(
        engines_manifest, ctx=2048, parallel=1, extra=["--embeddings", "--pooling", "mean"]
    )
    proxy = start_proxy(f"emb={server.url}")
    yield server, proxy
    proxy.stop()
    server.stop()


def test_llama_server_embeddings_counted_and_byte_exact(llama_embeddings):
    server, proxy = llama_embeddings
    client = openai.OpenAI(base_url=proxy.url + "/v1", api_key="x", max_retries=0)
    got = client.embeddings.create(model=E.LLAMA_ALIAS, input=["hello world", "a second text"])
    assert len(got.data) == 2 and len(got.data[0].embedding) == 640  # Gemma 3 270M's width
    body = {"model": E.LLAMA_ALIAS, "input": "the same bytes both ways"}
    direct = httpx.post(server.url + "/v1/embeddings", json=body, timeout=60)
    via = httpx.post(proxy.url + "/v1/embeddings", json=body, timeout=60)
    assert via.status_code == 200 and via.content == direct.content
    s = metric_samples(proxy.url)
    assert sample(s, "phasewatch_requests_total", endpoint="embeddings", outcome="ok") == 2
    assert sample(s, "phasewatch_request_seconds_count", endpoint="embeddings") == 2
    expected = got.usage.prompt_tokens + direct.json()["usage"]["prompt_tokens"]
    assert sample(s, "phasewatch_prompt_tokens_sum") == expected
    assert sample(s, "phasewatch_kv_cache_bytes_count") == 0  # nothing generated


# --- vLLM ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def vllm_physics(vllm):
    model_dir = str(Path(vllm.info["model_dir"]).parent)
    proxy = start_proxy(
        f"vllm={vllm.url}", args=["--model-dir", model_dir, "--engine-scrape", "0.5"]
    )
    yield proxy
    proxy.stop()


def _cache_config(url: str) -> dict:
    text = httpx.get(url + "/metrics", timeout=10).text
    for fam in text_string_to_metric_families(text):
        if fam.name == "vllm:cache_config_info":
            return dict(fam.samples[0].labels)
    raise AssertionError("vLLM exports no cache_config_info")


def test_vllm_tiny_kv_by_hand_and_against_vllm(vllm, vllm_physics):
    proxy = vllm_physics
    info = _cache_config(vllm.url)
    s = wait_for(
        lambda: (lambda x: x if sample(x, "phasewatch_engine_kv_cache_capacity_tokens") else None)(
            metric_samples(proxy.url)
        ),
        what="vLLM's cache_config_info scraped",
    )
    per_token = sample(
        s, "phasewatch_model_kv_bytes_per_token", model=E.VLLM_MODEL, kv_dtype="fp32"
    )
    assert per_token == 2 * 8 * 8 * 64 * 4 == 32768
    assert per_token * int(info["kv_cache_size_tokens"]) == int(info["kv_cache_memory_bytes"])
    capacity = int(info["num_gpu_blocks"]) * int(info["block_size"])
    assert sample(s, "phasewatch_engine_kv_cache_capacity_tokens") == capacity
    client = openai.OpenAI(base_url=proxy.url + "/v1", api_key="x", max_retries=0)
    for _ in client.chat.completions.create(
        model=E.VLLM_MODEL,
        messages=[{"role": "user", "content": "hello there, how is the weather"}],
        max_tokens=16,
        temperature=0,
        stream=True,
    ):
        pass
    line = wait_for(proxy.request_lines, what="the request's log line")[-1]
    tokens = int(line["prompt_tokens"]) + int(line["completion_tokens"])
    s = metric_samples(proxy.url)
    assert sample(s, "phasewatch_kv_cache_bytes_sum", model=E.VLLM_MODEL) == tokens * 32768
    assert sample(s, "phasewatch_time_per_output_token_seconds_count", source="proxy") >= 1

    # vLLM's own TTFT histogram is re-exported bucket for bucket
    def same():
        text = httpx.get(vllm.url + "/metrics", timeout=10).text
        theirs = {
            x.labels["le"]: x.value
            for fam in text_string_to_metric_families(text)
            for x in fam.samples
            if x.name == "vllm:time_to_first_token_seconds_bucket"
        }
        ours = {
            dict(k[1])["le"]: v
            for k, v in metric_samples(proxy.url).items()
            if k[0] == "phasewatch_engine_ttft_seconds_bucket"
        }
        mine = {le: v for le, v in ours.items()}
        return theirs and all(mine.get(_le(le)) == v for le, v in theirs.items())

    wait_for(same, what="vLLM's TTFT histogram re-exported unchanged")


def _le(le: str) -> str:
    return le if le == "+Inf" else repr(float(le))


@pytest.fixture(scope="module")
def vllm_pooling(engines_manifest):
    server = E.start_vllm(
        engines_manifest, max_num_seqs=2, extra=["--runner", "pooling", "--convert", "embed"]
    )
    proxy = start_proxy(f"pool={server.url}")
    yield server, proxy
    proxy.stop()
    server.stop()


def test_vllm_embeddings_counted_and_byte_exact(vllm_pooling):
    server, proxy = vllm_pooling
    client = openai.OpenAI(base_url=proxy.url + "/v1", api_key="x", max_retries=0)
    got = client.embeddings.create(model=E.VLLM_MODEL, input=["hello world", "quick brown fox"])
    assert len(got.data) == 2 and got.usage.prompt_tokens > 0
    s = metric_samples(proxy.url)
    base = {"model": E.VLLM_MODEL, "endpoint": "embeddings"}
    assert sample(s, "phasewatch_requests_total", **base, outcome="ok") == 1
    assert sample(s, "phasewatch_request_seconds_count", **base, outcome="ok") == 1
    assert sample(s, "phasewatch_prompt_tokens_sum", model=E.VLLM_MODEL) == got.usage.prompt_tokens
    assert sample(s, "phasewatch_completion_tokens_count", model=E.VLLM_MODEL) == 0
    body = {"model": E.VLLM_MODEL, "input": "the same bytes both ways"}
    direct = httpx.post(server.url + "/v1/embeddings", json=body, timeout=60).json()
    via = httpx.post(proxy.url + "/v1/embeddings", json=body, timeout=60).json()
    # vLLM makes a new id and created time per answer: the rest is identical
    for d in (direct, via):
        d.pop("id"), d.pop("created")
    assert via == direct
