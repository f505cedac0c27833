"""Ollama clients through a proxy with several upstreams are offered only what they can
use: Ollama's own API (``/api/…``) is served by Ollama upstreams alone, so ``/api/tags``
lists their models, and a native request for a model that only an engine without
Ollama's API serves gets Ollama's own "not found" rather than that engine's unrelated
404. The OpenAI API still reaches every upstream."""

from __future__ import annotations

import httpx
import ollama
import openai
import pytest

from ...support.servers import start_proxy, start_sim

VLLM_MODEL = "RedHatAI/Llama-3.1-8B-Instruct-FP8"
OLLAMA_MODELS = {
    "llama3.1:8b-instruct-fp16",
    "llama3.1:8b-instruct-q8_0",
    "llama3.1:8b-instruct-q4_K_M",
}


@pytest.fixture(scope="module")
def two():
    vllm, oll = start_sim("vllm", speed=8.0), start_sim("ollama", speed=8.0)
    # vLLM first: a model no upstream lists would go there by the OpenAI routing rule
    proxy = start_proxy(f"vllm={vllm.url}", f"ollama={oll.url}")
    yield vllm, oll, proxy
    proxy.stop()
    vllm.stop()
    oll.stop()


def test_tags_list_only_the_models_an_ollama_client_can_use(two):
    vllm, oll, proxy = two
    via = ollama.Client(host=proxy.url).list().models
    direct = ollama.Client(host=oll.url).list().models
    assert {m.model for m in via} == OLLAMA_MODELS == {m.model for m in direct}
    assert [m.model_dump() for m in via] == [m.model_dump() for m in direct]  # as Ollama wrote them
    # the OpenAI listing still has every upstream's models
    ids = {m.id for m in openai.OpenAI(base_url=proxy.url + "/v1", api_key="k").models.list()}
    assert VLLM_MODEL in ids and ids >= OLLAMA_MODELS


def test_native_request_for_a_model_only_vllm_serves_is_ollamas_not_found(two):
    vllm, oll, proxy = two
    client = ollama.Client(host=proxy.url)
    with pytest.raises(ollama.ResponseError) as err:
        client.chat(model=VLLM_MODEL, messages=[{"role": "user", "content": "hi"}])
    assert err.value.status_code == 404
    assert err.value.error == f"model '{VLLM_MODEL}' not found"
    # byte for byte the shape Ollama itself gives for a model it does not have
    own = httpx.post(oll.url + "/api/chat", json={"model": "nosuch", "messages": []})
    for path in ("/api/chat", "/api/generate", "/api/show"):
        r = httpx.post(proxy.url + path, json={"model": VLLM_MODEL, "stream": False})
        assert r.status_code == own.status_code == 404, path
        assert r.headers["content-type"] == own.headers["content-type"]
        assert r.json() == {"error": f"model '{VLLM_MODEL}' not found"}
        assert "detail" not in r.text  # not the vLLM engine's {"detail":"Not Found"}
    # the same model through the OpenAI API reaches vLLM as before
    answer = openai.OpenAI(base_url=proxy.url + "/v1", api_key="k").chat.completions.create(
        model=VLLM_MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=3
    )
    assert answer.model == VLLM_MODEL


def test_native_requests_reach_the_ollama_upstream(two):
    vllm, oll, proxy = two
    client = ollama.Client(host=proxy.url)
    r = client.chat(
        model="llama3.1:8b-instruct-q4_K_M", messages=[{"role": "user", "content": "hi"}]
    )
    assert r.done and r.eval_count
    # a model nobody lists goes to Ollama (not to vLLM, the first upstream): Ollama's answer
    body = {"model": "llama9", "messages": [{"role": "user", "content": "hi"}]}
    via = httpx.post(proxy.url + "/api/chat", json=body)
    direct = httpx.post(oll.url + "/api/chat", json=body)
    assert (via.status_code, via.content) == (direct.status_code, direct.content)
    with pytest.raises(ollama.ResponseError) as err:
        client.show("llama9")
    assert err.value.status_code == 404
    assert client.show("llama3.1:8b-instruct-q8_0").details.quantization_level == "Q8_0"
