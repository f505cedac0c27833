"""The simulator as a stand-in for what clients use: ``n`` choices and tool calls on each
simulated engine, through the real ``openai`` and ``ollama`` SDKs, directly and through
phasewatch (bytes unchanged, the tokens of every choice counted)."""

from __future__ import annotations

import json
import re

import httpx
import ollama
import openai
import pytest

from ...support.servers import start_proxy, start_sim

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string"},
                    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
                    "days": {"type": "integer"},
                },
                "required": ["city", "unit"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "get_time",
            "parameters": {"type": "object", "properties": {"zone": {"type": "string"}}},
        },
    },
]
MODELS = {
    "vllm": "meta-llama/Llama-3.1-8B-Instruct",
    "llamacpp": "qwen2.5-7b-instruct",
    "ollama": "llama3.1:8b-instruct-q4_K_M",
}
ASK = [{"role": "user", "content": "What is the weather in Paris today?"}]


@pytest.fixture(scope="module")
def sims():
    started = {e: start_sim(e, speed=20.0) for e in MODELS}
    proxy = start_proxy(*(f"{e}={s.url}" for e, s in started.items()))
    yield started, proxy
    proxy.stop()
    for s in started.values():
        s.stop()


def _client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)


def _check_call(call, names=("get_weather", "get_time")) -> dict:
    assert call.type == "function" and call.id
    assert call.function.name in names
    args = json.loads(call.function.arguments)
    if call.function.name == "get_weather":
        assert set(args) == {"city", "unit"} and args["unit"] == "celsius"
    return args


def _stream_calls(stream) -> tuple[dict, dict, dict]:
    """Tool calls rebuilt from streamed deltas, per choice; finish reasons; usage."""
    calls: dict = {}
    finish: dict = {}
    usage = {}
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage.model_dump()
        for ch in chunk.choices:
            for tc in ch.delta.tool_calls or ():
                slot = calls.setdefault((ch.index, tc.index), {"id": None, "name": "", "args": ""})
                slot["id"] = slot["id"] or tc.id
                slot["name"] += (tc.function.name or "") if tc.function else ""
                slot["args"] += (tc.function.arguments or "") if tc.function else ""
            if ch.finish_reason:
                finish[ch.index] = ch.finish_reason
    return calls, finish, usage


@pytest.mark.parametrize("engine", ["vllm", "llamacpp"])
@pytest.mark.parametrize("via", ["direct", "proxy"])
def test_n_choices_with_the_openai_sdk(sims, engine, via):
    started, proxy = sims
    client = _client(started[engine].url if via == "direct" else proxy.url)
    model = MODELS[engine]
    whole = client.chat.completions.create(
        model=model, messages=ASK, n=2, max_tokens=12, extra_body={"ignore_eos": True}
    )
    assert [c.index for c in whole.choices] == [0, 1]
    texts = [c.message.content for c in whole.choices]
    assert all(texts) and texts[0] != texts[1]
    assert all(c.finish_reason == "length" for c in whole.choices)
    # vLLM counts every choice; llama-server's merged answer keeps choice 0's usage
    assert whole.usage.completion_tokens == (24 if engine == "vllm" else 12)

    stream = client.chat.completions.create(
        model=model,
        messages=ASK,
        n=2,
        max_tokens=12,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    text = {0: "", 1: ""}
    finish, usages = {}, []
    for chunk in stream:
        if chunk.usage is not None:
            usages.append(chunk.usage.completion_tokens)
        for ch in chunk.choices:
            text[ch.index] += ch.delta.content or ""
            if ch.finish_reason:
                finish[ch.index] = ch.finish_reason
    assert text[0] and text[1] and text[0] != text[1]
    assert finish == {0: "length", 1: "length"}
    # vLLM: one usage event for both; llama-server: one per choice
    assert usages == ([24] if engine == "vllm" else [12, 12])


def test_more_choices_than_llama_server_slots_is_refused(sims):
    started, _ = sims
    with pytest.raises(
        openai.BadRequestError,
        match=r"Field 'n': Value must be between 1 <= value <= 16, but got 17",
    ):
        _client(started["llamacpp"].url).chat.completions.create(
            model=MODELS["llamacpp"], messages=ASK, n=17, max_tokens=4
        )


@pytest.mark.parametrize("engine", ["vllm", "llamacpp", "ollama"])
@pytest.mark.parametrize("via", ["direct", "proxy"])
def test_tool_calls_with_the_openai_sdk(sims, engine, via):
    started, proxy = sims
    client = _client(started[engine].url if via == "direct" else proxy.url)
    model = MODELS[engine]
    whole = client.chat.completions.create(model=model, messages=ASK, tools=TOOLS)
    choice = whole.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert not choice.message.content  # null (vLLM, llama-server) or "" (Ollama)
    assert len(choice.message.tool_calls) == 1
    _check_call(choice.message.tool_calls[0])

    forced = client.chat.completions.create(
        model=model,
        messages=ASK,
        tools=TOOLS,
        stream=True,
        stream_options={"include_usage": True},
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
    )
    calls, finish, usage = _stream_calls(forced)
    # vLLM finishes a call the request named with a plain "stop", as OpenAI does
    assert list(calls) == [(0, 0)] and finish == {0: "stop" if engine == "vllm" else "tool_calls"}
    call = calls[(0, 0)]
    assert call["id"] and call["name"] == "get_weather"
    assert json.loads(call["args"])["unit"] == "celsius"
    # every token of the call counts: tags, name, argument fragments, EOS
    assert usage["completion_tokens"] >= 5

    # the tool answered: the model replies in text
    after = client.chat.completions.create(
        model=model,
        messages=[
            *ASK,
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": call["id"],
                        "type": "function",
                        "function": {"name": "get_weather", "arguments": call["args"]},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": call["id"], "content": "18 degrees"},
        ],
        tools=TOOLS,
        max_tokens=8,
    )
    assert after.choices[0].message.content and not after.choices[0].message.tool_calls
    # tool_choice none: text
    none = client.chat.completions.create(
        model=model, messages=ASK, tools=TOOLS, tool_choice="none", max_tokens=8
    )
    assert none.choices[0].message.content and not none.choices[0].message.tool_calls


def test_n_and_tools_together_on_vllm(sims):
    started, _ = sims
    stream = _client(started["vllm"].url).chat.completions.create(
        model=MODELS["vllm"], messages=ASK, tools=TOOLS, n=3, stream=True
    )
    calls, finish, _ = _stream_calls(stream)
    assert sorted(calls) == [(0, 0), (1, 0), (2, 0)]
    assert finish == {0: "tool_calls", 1: "tool_calls", 2: "tool_calls"}
    assert len({c["id"] for c in calls.values()}) == 3


def test_ollama_has_no_n(sims):
    """Ollama's OpenAI layer has no ``n`` field: one choice, as the real one answers."""
    started, _ = sims
    out = _client(started["ollama"].url).chat.completions.create(
        model=MODELS["ollama"], messages=ASK, n=2, max_tokens=8
    )
    assert len(out.choices) == 1


@pytest.mark.parametrize("via", ["direct", "proxy"])
def test_tool_calls_with_the_ollama_sdk(sims, via):
    started, proxy = sims
    client = ollama.Client(host=started["ollama"].url if via == "direct" else proxy.url)
    out = client.chat(model=MODELS["ollama"], messages=ASK, tools=TOOLS)
    calls = out.message.tool_calls
    assert out.done_reason == "stop" and out.message.content == ""
    assert len(calls) == 1 and calls[0].function.name in ("get_weather", "get_time")
    if calls[0].function.name == "get_weather":
        assert set(calls[0].function.arguments) == {"city", "unit"}  # an object, not text
    streamed = [
        c for c in client.chat(model=MODELS["ollama"], messages=ASK, tools=TOOLS, stream=True)
    ]
    with_calls = [c for c in streamed if c.message.tool_calls]
    assert len(with_calls) == 1 and not with_calls[0].done and streamed[-1].done
    assert with_calls[0].message.tool_calls[0].function.name == calls[0].function.name
    assert streamed[-1].eval_count == out.eval_count  # every token of the call counted


@pytest.mark.parametrize(
    ("engine", "body"),
    [
        ("vllm", {"n": 2}),  # choices of their own lengths: one finishes first
        ("vllm", {"n": 2, "stream_options": {"include_usage": True}}),
        ("vllm", {"tools": TOOLS}),
        ("llamacpp", {"n": 2, "max_tokens": 10}),
        ("llamacpp", {"tools": TOOLS}),
        ("ollama", {"tools": TOOLS}),
    ],
)
def test_bytes_through_phasewatch_equal_direct(sims, engine, body):
    """The deterministic simulator answers equal requests with equal bytes: through the
    proxy (which asks vLLM for usage and strips it again, putting the fingerprint back on
    every choice's finish event) they must not change. llama-server's ``timings`` are
    measured durations: they are left out of the comparison."""
    started, proxy = sims
    req = {"model": MODELS[engine], "messages": ASK, "stream": True, **body}
    direct = httpx.post(started[engine].url + "/v1/chat/completions", json=req, timeout=30)
    via = httpx.post(proxy.url + "/v1/chat/completions", json=req, timeout=30)
    assert direct.status_code == via.status_code == 200

    def events(content: bytes) -> list[bytes]:
        return [re.sub(rb',"timings":\{[^}]*\}', b"", e) for e in content.split(b"\n\n")]

    if "n" in body:  # the choices' events interleave as the steps fall: compare each event
        assert sorted(events(via.content)) == sorted(events(direct.content))
        assert via.content.endswith(b"data: [DONE]\n\n")
    else:
        assert events(via.content) == events(direct.content)


def test_stripping_usage_keeps_every_choices_fingerprint():
    """vLLM moves ``system_fingerprint`` from each choice's finish event to the usage event
    the proxy asked for; with ``n`` = 2 another choice's tokens come between the finish
    events: stripped, every finish event gets it back and the order stays."""
    from proxy.engines.sse import SSETap
    from proxy.measure.timeline import Marks

    head = b'data: {"id":"c","object":"chat.completion.chunk","created":1,"model":"m","choices":['
    fin0 = head + b'{"index":0,"delta":{"content":"a"},"finish_reason":"stop"}]}\n\n'
    tok1 = head + b'{"index":1,"delta":{"content":"b"},"finish_reason":null}]}\n\n'
    fin1 = head + b'{"index":1,"delta":{"content":"c"},"finish_reason":"length"}]}\n\n'
    usage = (
        head + b'],"usage":{"prompt_tokens":3,"total_tokens":9,"completion_tokens":6},'
        b'"system_fingerprint":"fp-1"}\n\n'
    )
    done = b"data: [DONE]\n\n"
    tap = SSETap(Marks(t_recv=0.0, t_admit=0.0, t_sent=0.0), strip=True)
    out = b"".join(tap.feed(part, 1.0) for part in (fin0, tok1, fin1, usage, done)) + tap.flush()

    def fp(event: bytes) -> bytes:
        return event[:-3] + b',"system_fingerprint":"fp-1"}\n\n'

    assert out == fp(fin0) + tok1 + fp(fin1) + done


async def test_llama_server_tokenizer_endpoints():
    """/tokenize, /detokenize and /apply-template shaped as a real llama-server answers
    them (checked against the test tier's real build: pieces carry their spaces, no
    content gives no tokens, the BOS token detokenizes as ``<bos>`` with no space)."""
    from proxy.sim import build_app

    app = build_app("llamacpp", speed=50, ctx_size=32768)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://s") as c:
        toks = (
            await c.post("/tokenize", json={"content": "hello world", "add_special": True})
        ).json()
        assert len(toks["tokens"]) == 3 and toks["tokens"][0] == 2
        pieces = (
            await c.post("/tokenize", json={"content": "hello world", "with_pieces": True})
        ).json()
        assert [p["piece"] for p in pieces["tokens"]] == ["hello", " world"]
        assert (await c.post("/tokenize", json={})).json() == {"tokens": []}
        text = (await c.post("/detokenize", json={"tokens": toks["tokens"]})).json()
        assert text == {"content": "<bos>hello world"}
        messages = [{"role": "user", "content": "hi there"}]
        prompt = (await c.post("/apply-template", json={"messages": messages})).json()["prompt"]
        bad = await c.post("/apply-template", json={})
        assert bad.status_code == 400 and bad.json() == {
            "error": {
                "code": 400,
                "message": "'messages' is required",
                "type": "invalid_request_error",
            }
        }
        # the template's prompt, tokenized with BOS, is what a chat request is counted as
        counted = (await c.post("/tokenize", json={"content": prompt, "add_special": True})).json()
        chat = await c.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 2})
        assert chat.json()["usage"]["prompt_tokens"] == len(counted["tokens"])
        props = (await c.get("/props")).json()
        assert props["default_generation_settings"]["n_ctx"] == 32768
