"""What every real engine gets alike through phasewatch, one test per promise,
parametrised over the engines: its info endpoints and its errors byte for byte, and the
``openai`` SDK seeing the same answer, streamed or not, direct and through the proxy.

What is particular to one engine (vLLM's usage injection and fingerprint placement,
llama-server's timings and slots) stays in that engine's own file.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import openai
import pytest

from . import test_llama_server as L
from . import test_vllm as V
from .engines import LLAMA_ALIAS, VLLM_MODEL
from .wire import capture, normalize

pytestmark = pytest.mark.real_engine


@dataclass(frozen=True)
class Engine:
    """How one real engine is asked, and what may differ between two of its runs."""

    server: str  # the session fixtures: the engine, the proxy in front of it
    proxy: str
    model: str
    prompt: str
    chat: Callable[..., dict]
    max_tokens: int
    #: Added to every SDK request (llama-server: no prefix cache between the two runs).
    extra_body: dict = field(default_factory=dict)
    sdk_timeout: float = 60
    #: One event per token on every run, so event counts compare (vLLM's API server
    #: merges tokens into one event when it falls behind its engine).
    same_events: bool = True
    #: The fingerprint on one event per stream (vLLM), not on every event.
    fingerprint_once: bool = False
    #: Greedy answers that run to max_tokens (the model never ends them early).
    runs_to_length: bool = False


ENGINES = {
    "llama": Engine(
        "llama",
        "llama_proxy",
        LLAMA_ALIAS,
        L.PROMPT,
        L.chat,
        max_tokens=12,
        extra_body={"cache_prompt": False},
        sdk_timeout=120,
        runs_to_length=True,
    ),
    "vllm": Engine(
        "vllm",
        "vllm_proxy",
        VLLM_MODEL,
        V.PROMPT,
        V.chat,
        max_tokens=8,
        same_events=False,
        fingerprint_once=True,
    ),
}


def started(request: pytest.FixtureRequest, name: str):
    """The engine's profile, the engine and the proxy in front of it."""
    e = ENGINES[name]
    return e, request.getfixturevalue(e.server), request.getfixturevalue(e.proxy)


def assert_same(direct, via, what: str) -> None:
    assert via.status == direct.status, what
    assert via.end_to_end_headers() == direct.end_to_end_headers(), what
    assert normalize(via.body) == normalize(direct.body), (
        f"{what}: body differs beyond ids, created and timing values\n"
        f"direct: {direct.body[-1500:]!r}\nvia:    {via.body[-1500:]!r}"
    )


# --- byte for byte ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "name, path",
    [
        ("llama", "/health"),
        ("llama", "/v1/models"),
        ("llama", "/props"),
        ("vllm", "/health"),
        ("vllm", "/version"),
        ("vllm", "/v1/models"),
    ],
)
def test_info_endpoints_pass_through(request, name, path):
    _, engine, proxy = started(request, name)
    direct = capture(engine.url, path, method="GET")
    via = capture(proxy.url, path, method="GET")
    assert_same(direct, via, f"GET {path}")


ERRORS = [
    ("llama", "malformed JSON", b'{"model": "gemma-3-270m", "messages": [, "stream": true}', 400),
    ("llama", "missing messages", b'{"model": "gemma-3-270m", "stream": true}', 400),
    ("llama", "prompt over the slot context", L.chat(content="red green blue " * 2000), 400),
    ("vllm", "prompt over max-model-len", V.chat(content="hello world " * 400), 400),
    ("vllm", "unknown model", {**V.chat(), "model": "nope"}, 404),
    (
        "vllm",
        "stream_options without stream",
        V.chat(stream=False, stream_options={"include_usage": True}),
        400,
    ),
    # usage is injected only into a request with messages: vLLM's validation message of an
    # invalid one counts the body's keys, and must count the client's
    ("vllm", "missing messages", {"model": VLLM_MODEL, "stream": True}, 400),
]


@pytest.mark.parametrize(
    "name, case, body, status", ERRORS, ids=[f"{n}: {c}" for n, c, *_ in ERRORS]
)
def test_errors_pass_through(request, name, case, body, status):
    _, engine, proxy = started(request, name)
    direct = capture(engine.url, "/v1/chat/completions", body)
    via = capture(proxy.url, "/v1/chat/completions", body)
    assert direct.status == status, direct.body
    assert_same(direct, via, case)


# --- the openai SDK ---------------------------------------------------------------------------


def _sdk(base: str, e: Engine) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=base + "/v1", api_key="unused", max_retries=0, timeout=e.sdk_timeout
    )


def _ask(e: Engine, **more) -> dict:
    kw = dict(
        model=e.model,
        messages=[{"role": "user", "content": e.prompt}],
        max_tokens=e.max_tokens,
        temperature=0,
        seed=42,
        **more,
    )
    if e.extra_body:
        kw["extra_body"] = e.extra_body
    return kw


@pytest.mark.parametrize("name", list(ENGINES))
def test_openai_sdk_non_stream(request, name):
    e, engine, proxy = started(request, name)
    direct = _sdk(engine.url, e).chat.completions.create(**_ask(e))
    via = _sdk(proxy.url, e).chat.completions.create(**_ask(e))
    assert via.choices[0].message.content == direct.choices[0].message.content
    assert via.choices[0].finish_reason == direct.choices[0].finish_reason
    assert via.usage.completion_tokens == direct.usage.completion_tokens == e.max_tokens
    assert via.usage.prompt_tokens == direct.usage.prompt_tokens
    assert via.system_fingerprint == direct.system_fingerprint
    assert via.model == direct.model
    if e.runs_to_length:
        assert via.choices[0].finish_reason == "length" and via.model == e.model


@pytest.mark.parametrize("usage", [False, True])
@pytest.mark.parametrize("name", list(ENGINES))
def test_openai_sdk_stream(request, name, usage):
    e, engine, proxy = started(request, name)
    kw = _ask(e, stream=True)
    if usage:
        kw["stream_options"] = {"include_usage": True}

    def run(base):
        text, finish, usage_seen, fingerprints, events = "", None, None, [], 0
        for chunk in _sdk(base, e).chat.completions.create(**kw):
            events += 1
            for c in chunk.choices:
                text += c.delta.content or ""
                finish = c.finish_reason or finish
            if chunk.usage is not None:
                usage_seen = (chunk.usage.prompt_tokens, chunk.usage.completion_tokens)
            if chunk.system_fingerprint:
                fingerprints.append(chunk.system_fingerprint)
        return text, finish, usage_seen, fingerprints, events

    direct, via = run(engine.url), run(proxy.url)
    if e.same_events:
        assert via == direct
    else:
        assert via[:4] == direct[:4]
    assert (via[2] is not None) == usage
    if e.fingerprint_once:
        assert len(via[3]) == 1  # once per stream, as the engine sends it
    if e.runs_to_length:
        assert via[1] == "length" and via[0]
