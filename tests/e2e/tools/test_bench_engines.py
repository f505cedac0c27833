"""The bench's engine handling comes from the engine registry (proxy.engines): each
dialect says whether it has a tokenizer, what a /v1/models entry says of the context and
which file the engine serves, so a new engine module plus its registry line is all the
bench needs. Against scripted servers (httpx.MockTransport)."""

from __future__ import annotations

import json
from typing import ClassVar

import httpx

from proxy import engines
from proxy.engines import ENGINES, find_tokenizer, listed_context, served_file
from proxy.engines.openai import OpenAIDialect
from proxy.tools.bench import Client, Prompts


def _http(handler, seen: list | None = None) -> httpx.AsyncClient:
    def log(request: httpx.Request) -> httpx.Response:
        if seen is not None:
            seen.append(request.url.path)
        return handler(request)

    return httpx.AsyncClient(base_url="http://engine", transport=httpx.MockTransport(log))


def _vllm(request: httpx.Request) -> httpx.Response:
    if request.url.path == "/tokenize":
        body = json.loads(request.content)
        if "messages" not in body:
            return httpx.Response(400, json={"error": "messages or prompt"})
        words = len(body["messages"][0]["content"].split())
        return httpx.Response(200, json={"count": words + 5, "max_model_len": 32768})
    return httpx.Response(404)


def _llama(request: httpx.Request) -> httpx.Response:
    body = json.loads(request.content) if request.content else {}
    if request.url.path == "/tokenize":
        n = len(body.get("content", "").split()) + (1 if body.get("add_special") else 0)
        return httpx.Response(200, json={"tokens": list(range(n))})
    if request.url.path == "/apply-template":
        text = body["messages"][0]["content"]
        return httpx.Response(200, json={"prompt": f"<user> {text} <end> <assistant>"})
    if request.url.path == "/props":
        return httpx.Response(
            200,
            json={"default_generation_settings": {"n_ctx": 8192}, "model_path": "/m/x-Q4_K_M.gguf"},
        )
    return httpx.Response(404)


async def test_vllm_tokenizer_counts_the_templated_chat():
    async with _http(_vllm) as http:
        found = await find_tokenizer(http, "m")
        assert found is not None
        name, tok = found
        assert name == "vllm" and tok.max_model_len == 32768
        assert await tok.count("a b c") == 8


async def test_llama_server_tokenizer_counts_template_and_bos_and_reads_the_slot_context():
    async with _http(_llama) as http:
        found = await find_tokenizer(http, "m")
        assert found is not None
        name, tok = found
        assert name == "llamacpp" and tok.max_model_len == 8192
        assert await tok.count("a b c") == 3 + 3 + 1  # template pieces, words, BOS
        assert await served_file(http) == "/m/x-Q4_K_M.gguf"


async def test_no_tokenizer_endpoint_means_none_and_only_the_probes_are_sent():
    seen: list[str] = []
    async with _http(lambda r: httpx.Response(404, text="404 page not found"), seen) as http:
        assert await find_tokenizer(http, "m") is None
        assert await served_file(http) is None
    # vLLM's and llama-server's probes of /tokenize, llama-server's /props; Ollama and a
    # plain OpenAI server have no tokenizer and are not asked
    assert seen == ["/tokenize", "/tokenize", "/props"]


def test_context_length_of_a_model_entry():
    assert listed_context({"id": "m", "max_model_len": 4096}) == 4096  # vLLM
    assert listed_context({"id": "m", "meta": {"n_ctx": 2048}}) == 2048  # llama-server
    assert listed_context({"id": "m", "max_model_len": 0, "meta": "x"}) is None
    assert listed_context({"id": "m"}) is None


def test_every_registered_engine_answers_the_benchs_questions():
    for name, engine in ENGINES.items():
        d = engine()
        assert d.name == name
        assert isinstance(engine.busy_gauges, tuple) and isinstance(engine.generated_tokens, tuple)
        assert callable(d.tokenizer) and callable(d.listed_context) and callable(d.served_file)


class _SGLangTokenizer:
    def __init__(self, http: httpx.AsyncClient) -> None:
        self.http, self.max_model_len = http, 4096

    async def count(self, text: str) -> int:
        resp = await self.http.post("/sglang_tokenize", json={"text": text})
        return resp.json()["n"]


class _SGLang(OpenAIDialect):
    """An engine added on paper: its module's dialect and one registry line."""

    name: ClassVar[str] = "sglang"

    async def tokenizer(self, client: httpx.AsyncClient, model: str):
        resp = await client.post("/sglang_tokenize", json={"text": "hello"})
        return _SGLangTokenizer(client) if resp.status_code == 200 else None


async def test_a_new_engine_in_the_registry_gives_the_bench_exact_prompts(monkeypatch):
    monkeypatch.setitem(engines.ENGINES, "sglang", _SGLang)

    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/sglang_tokenize":
            words = len(json.loads(request.content)["text"].split())
            return httpx.Response(200, json={"n": 2 * words + 3})
        return httpx.Response(404)

    client = Client("http://engine/v1", None, 30.0, ignore_eos=True)
    client.http = _http(handler)
    prompts = Prompts(client, "m", seed=1)
    await prompts.setup()
    assert prompts.kind == "sglang" and prompts.max_model_len == 4096
    text, counted = await prompts.make(2 * 300 + 3)
    assert counted == 603 and len(text.split()) == 300
    assert prompts.method.startswith("exact")
    await client.aclose()
