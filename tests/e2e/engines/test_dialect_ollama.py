"""Ollama through phasewatch: the wire fixtures byte for byte (injected usage stripped on
/v1, both layouts, the completions zero-usage quirk), the done line's figures exactly,
the ollama SDK's results equal to direct, and the proxy's figures against the engine's."""

from __future__ import annotations

import concurrent.futures
import json
import time

import httpx
import ollama
import openai
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from proxy.engines.base import Prepared
from proxy.engines.ollama import NDJSONTap, OllamaDialect, OllamaSSETap
from proxy.measure.timeline import Marks, figures

from ...support.replay import ThreadServer
from ...support.replay_wire import WIRE, WireReplay, fixture_body, manifest
from ...support.servers import free_port, metric_samples, sample, start_proxy, start_sim, wait_for
from ...support.streams import run, splits

CHAT = (WIRE / "ollama-api-chat-stream.ndjson").read_bytes()
DONE = json.loads(CHAT.splitlines()[-1])


def lines(data: bytes) -> list[bytes]:
    return [ln + b"\n" for ln in data.split(b"\n") if ln]


# --- the native tap -----------------------------------------------------------------------------


def test_done_line_figures_exactly():
    marks = Marks(t_recv=99.0, t_admit=99.0, t_sent=99.5)
    tap = NDJSONTap(marks)
    assert run(tap, lines(CHAT)) == CHAT
    assert marks.t_first == 100.0
    assert marks.output_events == 16  # 15 text lines + the done line (the EOS token)
    out = OllamaDialect().outcome(tap, None, 200)
    assert out.finished and out.error_kind is None
    assert (out.usage.prompt_tokens, out.usage.completion_tokens) == (37, 16)
    e = out.engine
    assert e.prefill_seconds == 84519000 / 1e9 and e.prefill_tokens == 37
    assert e.decode_seconds == 246112000 / 1e9
    assert e.decode_tokens_per_second == 16 / (246112000 / 1e9)
    assert e.load_seconds == 11262750 / 1e9
    # the engine-side wait: total - load - prompt_eval - eval
    assert e.queue_seconds == (351396125 - 11262750 - 84519000 - 246112000) / 1e9
    marks.t_end = 100.3
    f = figures(marks, out.usage, e)
    assert f.prefill_seconds["engine"] == 0.084519 and f.load_seconds == 0.01126275
    assert f.queue_upstream == e.queue_seconds
    assert f.decode_tps["proxy"] == pytest.approx(15 / 0.15)  # 16 tokens, 15 gaps


def test_missing_metric_keys_are_zero():
    line = b'{"model":"m","created_at":"x","message":{"role":"assistant","content":""},"done":true,"done_reason":"stop","eval_count":1}\n'
    tap = NDJSONTap(Marks(t_recv=0.0))
    run(tap, [line])
    out = OllamaDialect().outcome(tap, None, 200)
    assert out.usage.prompt_tokens == 0 and out.usage.completion_tokens == 1
    assert out.engine.load_seconds == 0.0 and out.engine.prefill_seconds == 0.0
    assert out.engine.decode_tokens_per_second is None  # one token: no rate


def test_generate_stream_and_nonstream():
    data = (WIRE / "ollama-api-generate-stream.ndjson").read_bytes()
    tap = NDJSONTap(Marks(t_recv=0.0))
    run(tap, lines(data))
    out = OllamaDialect().outcome(tap, None, 200)
    assert out.usage.completion_tokens == 16 and out.finished
    body = (WIRE / "ollama-api-chat-nonstream.json").read_bytes()
    out = OllamaDialect().outcome(None, body, 200)
    assert out.usage.prompt_tokens == 37 and out.engine.decode_seconds == 0.246112


def test_midstream_error_and_truncation():
    data = (WIRE / "ollama-api-chat-stream-midstream-error.ndjson").read_bytes()
    tap = NDJSONTap(Marks(t_recv=0.0))
    run(tap, lines(data))
    out = OllamaDialect().outcome(tap, None, 200)
    assert out.error_kind == "midstream" and out.error_message.startswith("model runner has")
    tap = NDJSONTap(Marks(t_recv=0.0))
    run(tap, lines(CHAT)[:-1])
    out = OllamaDialect().outcome(tap, None, 200)
    assert out.error_kind == "truncated" and not out.finished


def test_load_requests_are_not_generations():
    d = OllamaDialect()
    assert d.prepare("ollama_chat", b'{"model":"llama3.2","messages":[]}', True) is None
    assert d.prepare("ollama_generate", b'{"model":"llama3.2"}', True) is None
    p = d.prepare(
        "ollama_chat", b'{"model":"llama3.2","messages":[{"role":"user","content":"x"}]}', True
    )
    assert p.stream and p.body.endswith(b"}]}")  # stream defaults to true; body untouched
    load = b'{"model":"m","created_at":"x","message":{"role":"assistant","content":""},"done":true,"done_reason":"load"}\n'
    tap = NDJSONTap(Marks(t_recv=0.0))
    run(tap, [load])
    assert tap.marks.t_first is None


@settings(max_examples=120, deadline=None)
@given(
    st.lists(st.integers(min_value=0, max_value=10**5), max_size=30),
    st.sampled_from(
        [
            "ollama-api-chat-stream.ndjson",
            "ollama-api-generate-stream.ndjson",
            "ollama-api-chat-stream-midstream-error.ndjson",
        ]
    ),
)
def test_native_any_split(cuts, name):
    data = (WIRE / name).read_bytes()
    tap, whole = NDJSONTap(Marks(t_recv=0.0)), NDJSONTap(Marks(t_recv=0.0))
    assert run(tap, splits(data, cuts)) == data
    run(whole, [data])
    a, b = OllamaDialect().outcome(tap, None, 200), OllamaDialect().outcome(whole, None, 200)
    assert (a.usage, a.engine, a.error_kind) == (b.usage, b.engine, b.error_kind)
    assert tap.marks.output_events == whole.marks.output_events


# --- /v1: strip what injecting usage added, byte for byte -------------------------------------------


@settings(max_examples=120, deadline=None)
@given(
    st.lists(st.integers(min_value=0, max_value=10**5), max_size=30),
    st.sampled_from(
        [
            ("ollama-v1-chat-stream-usage.sse", "ollama-v1-chat-stream.sse", "chat"),
            ("ollama-v1-chat-stream-usage-legacy.sse", "ollama-v1-chat-stream-legacy.sse", "chat"),
            (
                "ollama-v1-completions-stream-usage.sse",
                "ollama-v1-completions-stream.sse",
                "completions",
            ),
        ]
    ),
)
def test_v1_strip_is_exact_for_any_split(cuts, case):
    with_usage, plain, endpoint = (WIRE / case[0]).read_bytes(), fixture_body(case[1]), case[2]
    prepared = Prepared(endpoint, "llama3.2", True, b"", strip_usage=True)
    tap = OllamaDialect().tap("text/event-stream", Marks(t_recv=0.0), prepared)
    assert isinstance(tap, OllamaSSETap)
    assert run(tap, splits(with_usage, cuts)) == plain
    out = OllamaDialect().outcome(tap, None, 200)
    assert out.usage.completion_tokens == 16 and out.finished
    assert tap.marks.output_events == 16  # 15 text events + the finish event


def test_v1_inject_only_when_the_client_did_not_ask():
    d = OllamaDialect()
    p = d.prepare("chat", b'{"model":"m","stream":true,"messages":[]}', True)
    assert p.strip_usage
    assert bytes(p.body) + p.tail == (
        b'{"model":"m","stream":true,"messages":[],"stream_options":{"include_usage":true}}'
    )
    # {} means include_usage=false on Ollama (unlike vLLM): inject, strip again
    assert (
        d.prepare("chat", b'{"model":"m","stream":true,"stream_options":{}}', True).body
        == b'{"model":"m","stream":true,"stream_options":{}}'
    )
    p = d.prepare(
        "chat", b'{"model":"m","stream":true,"stream_options":{"include_usage":true}}', True
    )
    assert not p.strip_usage
    assert not d.prepare("chat", b'{"model":"m","messages":[]}', True).strip_usage  # not a stream


# --- the fixtures through the proxy ---------------------------------------------------------------


@pytest.fixture(scope="module")
def wire():
    app = WireReplay("ollama")
    server = ThreadServer(app, free_port()).start()
    # detected as Ollama from /api/version; no state scrapes in between the replays
    proxy = start_proxy(f"wire={server.url}", args=["--engine-scrape", "0"])
    yield app, server, proxy
    proxy.stop()
    server.stop()


CASES = [
    # (fixture the client asks for, path, request body, fixture the engine must have served)
    (
        "ollama-api-chat-stream.ndjson",
        "/api/chat",
        {"model": "llama3.2", "messages": [{"role": "user", "content": "q"}]},
        None,
    ),
    (
        "ollama-api-chat-nonstream.json",
        "/api/chat",
        {"model": "llama3.2", "stream": False, "messages": [{"role": "user", "content": "q"}]},
        None,
    ),
    (
        "ollama-api-generate-stream.ndjson",
        "/api/generate",
        {"model": "llama3.2", "prompt": "q"},
        None,
    ),
    (
        "ollama-api-chat-stream-midstream-error.ndjson",
        "/api/chat",
        {"model": "llama3.2", "messages": [{"role": "user", "content": "q"}]},
        None,
    ),
    (
        "ollama-api-error-model-not-found.json",
        "/api/chat",
        {"model": "llama9", "messages": [{"role": "user", "content": "q"}]},
        None,
    ),
    (
        "ollama-api-error-queue-full.json",
        "/api/generate",
        {"model": "llama3.2", "prompt": "q"},
        None,
    ),
    (
        "ollama-v1-chat-stream.sse",
        "/v1/chat/completions",
        {"model": "llama3.2", "stream": True, "messages": [{"role": "user", "content": "q"}]},
        "ollama-v1-chat-stream-usage.sse",
    ),
    (
        "ollama-v1-chat-stream-usage.sse",
        "/v1/chat/completions",
        {
            "model": "llama3.2",
            "stream": True,
            "stream_options": {"include_usage": True},
            "messages": [{"role": "user", "content": "q"}],
        },
        None,
    ),
    (
        "ollama-v1-chat-stream-legacy.sse",
        "/v1/chat/completions",
        {"model": "llama3.2", "stream": True, "messages": [{"role": "user", "content": "q"}]},
        "ollama-v1-chat-stream-usage-legacy.sse",
    ),
    (
        "ollama-v1-completions-stream.sse",
        "/v1/completions",
        {"model": "llama3.2", "prompt": "q", "stream": True},
        "ollama-v1-completions-stream-usage.sse",
    ),
    (
        "ollama-v1-completions-stream-usage.sse",
        "/v1/completions",
        {
            "model": "llama3.2",
            "prompt": "q",
            "stream": True,
            "stream_options": {"include_usage": True},
        },
        None,
    ),
    (
        "ollama-v1-chat-nonstream.json",
        "/v1/chat/completions",
        {"model": "llama3.2", "messages": [{"role": "user", "content": "q"}]},
        None,
    ),
    (
        "ollama-v1-error-model-not-found.json",
        "/v1/chat/completions",
        {"model": "llama9", "messages": [{"role": "user", "content": "q"}]},
        None,
    ),
    ("ollama-tags.json", "/api/tags", None, None),
    ("ollama-show.json", "/api/show", {"model": "llama3.2"}, None),
    ("ollama-ps.json", "/api/ps", None, None),
    ("ollama-v1-models.json", "/v1/models", None, None),
]


def _headers(resp):
    return [(k, v) for k, v in resp.headers.multi_items() if k not in ("date", "server")]


@pytest.mark.parametrize("name,path,body,served", CASES, ids=[c[0] for c in CASES])
def test_fixture_bytes_equal_direct(wire, name, path, body, served):
    app, server, proxy = wire
    method = "POST" if body is not None else "GET"
    hdrs = {"x-fixture": name}
    direct = httpx.request(method, server.url + path, json=body, headers=hdrs)
    n = len(app.served)
    via = httpx.request(method, proxy.url + path, json=body, headers=hdrs)
    assert app.served[n:] == [served or name]
    assert via.status_code == direct.status_code == manifest().get(name, {}).get("status", 200)
    assert _headers(via) == _headers(direct)
    assert via.content == direct.content == fixture_body(name)


def test_fixture_figures_are_the_done_line(wire):
    app, server, proxy = wire
    before = metric_samples(proxy.url)
    httpx.post(
        proxy.url + "/api/chat",
        json={"model": "llama3.2", "messages": [{"role": "user", "content": "q"}]},
        headers={"x-fixture": "ollama-api-chat-stream.ndjson"},
    )
    time.sleep(0.2)
    after = metric_samples(proxy.url)

    def delta(metric, **labels):
        return sample(after, metric, **labels) - sample(before, metric, **labels)

    assert (
        delta(
            "phasewatch_requests_total",
            outcome="ok",
            endpoint="ollama_chat",
            model="llama3.2:latest",
            precision="int4",
        )
        == 1
    )
    assert delta("phasewatch_prefill_seconds_sum", source="engine") == pytest.approx(
        DONE["prompt_eval_duration"] / 1e9, rel=1e-9
    )
    assert delta("phasewatch_decode_seconds_sum", source="engine") == pytest.approx(
        DONE["eval_duration"] / 1e9, rel=1e-9
    )
    assert delta("phasewatch_decode_tokens_per_second_sum", source="engine") == pytest.approx(
        DONE["eval_count"] / (DONE["eval_duration"] / 1e9), rel=1e-12
    )
    assert delta("phasewatch_load_seconds_sum") == pytest.approx(
        DONE["load_duration"] / 1e9, rel=1e-9
    )
    wait = (
        DONE["total_duration"]
        - DONE["load_duration"]
        - DONE["prompt_eval_duration"]
        - DONE["eval_duration"]
    ) / 1e9
    assert delta("phasewatch_queue_seconds_sum", where="upstream") == pytest.approx(wait, rel=1e-12)
    assert delta("phasewatch_tokens_total", phase="decode") == 16
    assert delta("phasewatch_tokens_total", phase="prefill") == 37
    # the injected usage of a /v1 stream feeds the counters too, though stripped
    httpx.post(
        proxy.url + "/v1/completions",
        json={"model": "llama3.2", "prompt": "q", "stream": True},
        headers={"x-fixture": "ollama-v1-completions-stream.sse"},
    )
    time.sleep(0.2)
    assert (
        sample(metric_samples(proxy.url), "phasewatch_tokens_total", phase="prefill")
        - sample(after, "phasewatch_tokens_total", phase="prefill")
        == 31
    )
    # errors: the mid-stream error line is counted, the stream is not extended
    s0 = sample(after, "phasewatch_errors_total", kind="midstream")
    r = httpx.post(
        proxy.url + "/api/chat",
        json={"model": "llama3.2", "messages": [{"role": "user", "content": "q"}]},
        headers={"x-fixture": "ollama-api-chat-stream-midstream-error.ndjson"},
    )
    time.sleep(0.2)
    assert r.content == (WIRE / "ollama-api-chat-stream-midstream-error.ndjson").read_bytes()
    assert sample(metric_samples(proxy.url), "phasewatch_errors_total", kind="midstream") == s0 + 1


def test_proxy_errors_in_ollamas_shape():
    dead = f"http://127.0.0.1:{free_port()}"
    proxy = start_proxy(f"dead={dead}", args=["--engine", "dead=ollama"])
    try:
        r = httpx.post(
            proxy.url + "/api/chat",
            json={"model": "m", "messages": [{"role": "user", "content": "x"}]},
        )
        assert (
            r.status_code == 502
            and set(r.json()) == {"error"}
            and "unreachable" in r.json()["error"]
        )
        with pytest.raises(ollama.ResponseError) as info:
            ollama.Client(host=proxy.url).chat(
                model="m", messages=[{"role": "user", "content": "x"}]
            )
        assert info.value.status_code == 502 and "unreachable" in info.value.error
        assert set(httpx.get(proxy.url + "/api/tags").json()) == {"error"}
        r = httpx.post(proxy.url + "/v1/chat/completions", json={"model": "m", "messages": []})
        assert r.json()["error"]["type"] == "connect"  # /v1 keeps OpenAI's shape
    finally:
        proxy.stop()


# --- against the simulated Ollama -----------------------------------------------------------------

MODELS = ("llama3.1:8b-instruct-fp16", "llama3.1:8b-instruct-q8_0", "llama3.1:8b-instruct-q4_K_M")


@pytest.fixture(scope="module")
def stack():
    sim = start_sim("ollama", speed=2.0, deterministic=True, max_num_seqs=1)
    proxy = start_proxy(sim.url, args=["--engine-scrape", "0.5"])
    yield sim, proxy
    proxy.stop()
    sim.stop()


def _strip(resp) -> dict:
    d = resp.model_dump() if hasattr(resp, "model_dump") else dict(resp)
    for k in (
        "created_at",
        "total_duration",
        "load_duration",
        "prompt_eval_duration",
        "eval_duration",
    ):
        d.pop(k, None)
    return d


def test_sdk_results_equal_direct(stack):
    sim, proxy = stack
    direct, via = ollama.Client(host=sim.url), ollama.Client(host=proxy.url)
    msgs = [{"role": "user", "content": "why is decode <memory> bound & slow?"}]
    for model in MODELS:
        for client_pair in ((direct, via),):
            got = []
            for c in client_pair:
                r = [
                    _strip(c.chat(model=model, messages=msgs, options={"num_predict": 24})),
                    [
                        _strip(x)
                        for x in c.chat(
                            model=model, messages=msgs, stream=True, options={"num_predict": 24}
                        )
                    ],
                    _strip(c.generate(model=model, prompt="tell me about prefill")),
                    [
                        _strip(x)
                        for x in c.generate(
                            model=model, prompt="tell me about prefill", stream=True
                        )
                    ],
                ]
                got.append(r)
            assert got[0] == got[1]
            whole, chunks = got[0][0], got[0][1]
            assert whole["message"]["content"] == "".join(c["message"]["content"] for c in chunks)
            assert whole["eval_count"] == 24 and whole["done_reason"] == "length"
    # /v1 through the openai SDK: same text, usage only when asked (stripped otherwise)
    oa_direct = openai.OpenAI(base_url=sim.url + "/v1", api_key="k", max_retries=0)
    oa_via = openai.OpenAI(base_url=proxy.url + "/v1", api_key="k", max_retries=0)
    for kw in ({}, {"stream_options": {"include_usage": True}}):
        a = [
            c.model_dump()
            for c in oa_direct.chat.completions.create(
                model=MODELS[2], messages=msgs, stream=True, max_tokens=9, **kw
            )
        ]
        b = [
            c.model_dump()
            for c in oa_via.chat.completions.create(
                model=MODELS[2], messages=msgs, stream=True, max_tokens=9, **kw
            )
        ]
        assert a == b
        assert (a[-1]["usage"] is not None) == bool(kw)
    s = metric_samples(proxy.url)
    for model, precision, n in zip(MODELS, ("fp16", "int8", "int4"), (4, 4, 6)):
        assert (
            sample(s, "phasewatch_requests_total", model=model, precision=precision, outcome="ok")
            == n
        )


def test_engine_and_proxy_figures(stack):
    sim, proxy = stack
    before = metric_samples(proxy.url)
    n0 = len(proxy.request_lines())
    done_lines = []

    def chat(i):
        r = httpx.post(
            proxy.url + "/api/chat",
            timeout=60,
            headers={"x-request-id": f"ollama-{i}"},
            json={
                "model": MODELS[2],
                "options": {"num_predict": 300},
                "messages": [
                    {"role": "user", "content": " ".join(f"t{i}w{j}" for j in range(300))}
                ],
            },
        )
        done_lines.append(json.loads(r.content.splitlines()[-1]))

    # num_parallel is 1: the second request waits for the runner inside the engine
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        list(pool.map(chat, (1, 2)))
    wait_for(lambda: len(proxy.request_lines()) >= n0 + 2, what="both requests recorded")
    after = metric_samples(proxy.url)

    def delta(metric, **labels):
        return sample(after, metric, **labels) - sample(before, metric, **labels)

    ns = lambda key: sum(d.get(key, 0) for d in done_lines)  # noqa: E731
    assert delta("phasewatch_prefill_seconds_sum", source="engine") == pytest.approx(
        ns("prompt_eval_duration") / 1e9, rel=1e-9
    )
    assert delta("phasewatch_decode_seconds_sum", source="engine") == pytest.approx(
        ns("eval_duration") / 1e9, rel=1e-9
    )
    assert delta("phasewatch_load_seconds_sum") == pytest.approx(
        ns("load_duration") / 1e9, rel=1e-9
    )
    waits = sorted(
        (
            d["total_duration"]
            - d.get("load_duration", 0)
            - d.get("prompt_eval_duration", 0)
            - d["eval_duration"]
        )
        / 1e9
        for d in done_lines
    )
    assert delta("phasewatch_queue_seconds_sum", where="upstream") == pytest.approx(
        sum(waits), rel=1e-9
    )
    truth = wait_for(
        lambda: (lambda t: t if {"ollama-1", "ollama-2"} <= set(t) else None)(
            {t["request_id"]: t for t in sim.truth()}
        ),
        what="the engine's records of both requests",
    )
    lines = proxy.request_lines()[n0:]
    assert len(lines) == 2
    for line in lines:
        t = truth[line["request_id"]]
        engine_tps = t["reported"]["eval_count"] / (t["reported"]["eval_duration"] / 1e9)
        assert float(line["engine_decode_tps"]) == pytest.approx(
            engine_tps, rel=1e-4
        )  # logged rounded
        # proxy: (n-1)/(t_last-t_first); engine: n/eval_duration -> 299/300 apart, plus noise
        assert float(line["decode_tps"]) == pytest.approx(engine_tps * 299 / 300, rel=0.05)
        assert float(line["upstream_queue_s"]) == pytest.approx(t["engine_wait_seconds"], abs=0.02)
    # the queued one waited (each wait equals the engine's truth, checked above); the first
    # hardly did
    assert waits[0] < 0.05 * waits[1], waits


def test_load_request_passes_unmeasured(stack):
    sim, proxy = stack
    before = sample(metric_samples(proxy.url), "phasewatch_requests_total")
    r = httpx.post(proxy.url + "/api/chat", json={"model": MODELS[0], "messages": []})
    assert r.status_code == 200 and r.json()["done_reason"] == "load"
    time.sleep(0.2)
    assert sample(metric_samples(proxy.url), "phasewatch_requests_total") == before


def test_engine_gauges_from_api_ps(stack):
    sim, proxy = stack
    httpx.post(
        proxy.url + "/api/generate", json={"model": MODELS[1], "prompt": "hello", "stream": False}
    )
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        s = metric_samples(proxy.url)
        if sample(s, "phasewatch_engine_model_loaded", model=MODELS[1], precision="int8") == 1:
            break
        time.sleep(0.3)
    assert sample(s, "phasewatch_engine_model_vram_bytes", model=MODELS[1]) > 8e9
    assert 200 < sample(s, "phasewatch_engine_model_expiry_seconds", model=MODELS[1]) <= 300
    assert sample(s, "phasewatch_engine_scrape_up", engine="ollama") == 1


def test_native_stream_cut_without_done_line_gets_an_error_line():
    """The engine closed the stream cleanly but never sent its done line: the client gets
    Ollama's own error line (the ollama SDK raises it), and the request is an error."""
    cut = b"".join(lines(CHAT)[:5])

    class Cut(WireReplay):
        async def __call__(self, scope, receive, send):
            if scope["type"] == "http" and scope["path"] == "/api/chat":
                while (await receive()).get("more_body"):
                    pass
                await send(
                    {
                        "type": "http.response.start",
                        "status": 200,
                        "headers": [(b"content-type", b"application/x-ndjson")],
                    }
                )
                await send({"type": "http.response.body", "body": cut, "more_body": False})
                return
            await super().__call__(scope, receive, send)

    server = ThreadServer(Cut("ollama"), free_port()).start()
    proxy = start_proxy(f"cut={server.url}")
    try:
        r = httpx.post(
            proxy.url + "/api/chat",
            json={"model": "llama3.2", "messages": [{"role": "user", "content": "q"}]},
        )
        assert r.content.startswith(cut)
        tail = json.loads(r.content[len(cut) :])
        assert set(tail) == {"error"} and "without its terminator" in tail["error"]
        with pytest.raises(ollama.ResponseError):
            for _ in ollama.Client(host=proxy.url).chat(
                model="llama3.2", stream=True, messages=[{"role": "user", "content": "q"}]
            ):
                pass
        time.sleep(0.2)
        assert sample(metric_samples(proxy.url), "phasewatch_errors_total", kind="truncated") == 2
    finally:
        proxy.stop()
        server.stop()


def test_client_hangup_stops_the_engine(stack):
    sim, proxy = stack
    n = len(sim.truth())
    body = {
        "model": MODELS[2],
        "options": {"num_predict": 3000},
        "messages": [{"role": "user", "content": "a long answer please"}],
    }
    with httpx.stream("POST", proxy.url + "/api/chat", json=body, timeout=30) as r:
        for _ in r.iter_lines():
            break  # hang up after the first line
    deadline = time.monotonic() + 10
    while len(sim.truth()) == n and time.monotonic() < deadline:
        time.sleep(0.05)
    t = sim.truth()[n]
    assert t["aborted"] and t["completion_tokens"] < 3000
    time.sleep(0.2)
    assert sample(metric_samples(proxy.url), "phasewatch_aborts_total", model=MODELS[2]) >= 1


def test_v1_stream_that_loses_its_error(stack):
    """Ollama's /v1 layer turns a runner failure into an empty chunk and ends without
    [DONE]: phasewatch counts it and ends the stream with an error event the SDK raises."""
    sim, proxy = stack
    client = openai.OpenAI(base_url=proxy.url + "/v1", api_key="k", max_retries=0)
    before = sample(metric_samples(proxy.url), "phasewatch_errors_total", kind="truncated")
    with pytest.raises(openai.APIError):
        for _ in client.chat.completions.create(
            model=MODELS[2],
            messages=[{"role": "user", "content": "x"}],
            stream=True,
            max_tokens=40,
            extra_body={"options": {"sim_error_after": 3}},
        ):
            pass
    time.sleep(0.2)
    assert (
        sample(metric_samples(proxy.url), "phasewatch_errors_total", kind="truncated") == before + 1
    )
