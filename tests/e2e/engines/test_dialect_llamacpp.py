"""llama-server through phasewatch: real captures byte for byte, its timings read exactly,
the proxy's own figures against them, and the tap on real bytes for any split."""

from __future__ import annotations

import json
import re
import statistics
import time

import httpx
import openai
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from proxy.engines.llamacpp import LlamaCppDialect, LlamaTap
from proxy.measure.timeline import Marks

from ...support.replay import ThreadServer
from ...support.replay_wire import WIRE, CaptureReplay, llama_captures
from ...support.servers import free_port, metric_samples, sample, start_proxy, start_sim, wait_for
from ...support.streams import run, splits

CAPTURES = llama_captures()
# one capture per distinct request (a replay answers a request with the first one)
# (GET /metrics is phasewatch's own page: the engine's is scraped, not relayed)
UNIQUE = sorted(
    {CaptureReplay().by_key[c.key()].name for c in CAPTURES.values() if c.path != "/metrics"}
)


@pytest.fixture(scope="module")
def replay():
    app = CaptureReplay()
    server = ThreadServer(app, free_port()).start()
    # no --engine: detected from the captured /props; no gauge scrapes in between
    proxy = start_proxy(f"llama={server.url}", args=["--engine-scrape", "0"])
    yield app, server, proxy
    proxy.stop()
    server.stop()


def _headers(resp: httpx.Response) -> list[tuple[str, str]]:
    return [(k, v) for k, v in resp.headers.multi_items() if k not in ("date", "server")]


@pytest.mark.parametrize("name", UNIQUE)
def test_capture_bytes_equal_direct(replay, name):
    app, server, proxy = replay
    cap = CAPTURES[name]
    headers = {"content-type": "application/json"} if cap.request_body else {}
    n = len(app.served)
    direct = httpx.request(
        cap.method, server.url + cap.path, content=cap.request_body, headers=headers
    )
    via = httpx.request(cap.method, proxy.url + cap.path, content=cap.request_body, headers=headers)
    assert via.status_code == direct.status_code == cap.status
    assert _headers(via) == _headers(direct)
    assert via.content == direct.content == cap.body
    assert app.served[n:].count(name) == 2  # (phasewatch's own model-list probes may interleave)


def _timings(body: bytes) -> dict:
    """The last `timings` object of a captured response, parsed the slow way."""
    last = None
    for ev in body.split(b"\n\n") if body.startswith((b"data:", b":")) else [b"data: " + body]:
        ev = ev.strip()
        if ev.startswith(b"data: {"):
            obj = json.loads(ev[6:])
            last = obj.get("timings", last)
    return last


@pytest.mark.parametrize(
    "name,endpoint",
    [
        ("chat_stream", "chat"),
        ("completions_stream", "completions"),
        ("native_completion_stream", "llamacpp_completion"),
        ("chat_stream_stop_word", "chat"),
        ("chat_nonstream", "chat"),
    ],
)
def test_engine_figures_equal_the_response(replay, name, endpoint):
    """source="engine" figures are the capture's own timings, exactly."""
    app, server, proxy = replay
    cap = CAPTURES[name]
    t = _timings(cap.body)
    before = metric_samples(proxy.url)
    resp = httpx.post(
        proxy.url + cap.path, content=cap.request_body, headers={"content-type": "application/json"}
    )
    assert resp.content == cap.body
    time.sleep(0.2)
    after = metric_samples(proxy.url)

    def delta(metric, **labels):
        return sample(after, metric, **labels) - sample(before, metric, **labels)

    assert delta("phasewatch_requests_total", outcome="ok", endpoint=endpoint) == 1
    assert delta("phasewatch_prefill_seconds_sum", source="engine") == pytest.approx(
        t["prompt_ms"] / 1000, rel=1e-12
    )
    assert delta("phasewatch_decode_seconds_sum", source="engine") == pytest.approx(
        t["predicted_ms"] / 1000, rel=1e-12
    )
    assert delta("phasewatch_decode_tokens_per_second_sum", source="engine") == pytest.approx(
        t["predicted_per_second"], rel=1e-12
    )
    # prefill rate over the tokens actually evaluated (cache hits excluded)
    assert delta("phasewatch_prefill_tokens_per_second_sum", source="engine") == pytest.approx(
        t["prompt_per_second"], rel=1e-9
    )
    assert delta("phasewatch_tokens_total", phase="prefill") == t["prompt_n"]
    assert delta("phasewatch_tokens_total", phase="cached") == t["cache_n"]
    assert delta("phasewatch_tokens_total", phase="decode") == t["predicted_n"]
    if cap.content_type().startswith("text/event-stream"):  # the proxy saw the tokens pass
        assert delta("phasewatch_ttft_seconds_count") == 1
        assert delta("phasewatch_queue_seconds_count", where="upstream") == 1
    else:  # a whole body: no first-token mark, no proxy phase figures
        assert delta("phasewatch_ttft_seconds_count") == 0
        assert delta("phasewatch_decode_seconds_count", source="proxy") == 0


def test_precision_and_engine_detected_from_real_props(replay):
    app, server, proxy = replay
    s = metric_samples(proxy.url)
    assert sample(s, "phasewatch_upstream_up", upstream="llama", engine="llamacpp") == 1
    assert (
        sample(
            s,
            "phasewatch_model_info",
            model="gemma-3-270m",
            precision="int4",
            quant="Q4_K_M",
            precision_source="engine",
        )
        == 1
    )
    # llama-server answers any model name with its one model: labelled as that model
    cap = CAPTURES["err_unknown_model"]
    n_before = len(proxy.request_lines())
    httpx.post(
        proxy.url + cap.path, content=cap.request_body, headers={"content-type": "application/json"}
    )
    line = proxy.request_lines(at_least=n_before + 1)[-1]
    assert line["model"] == "gemma-3-270m" and line["precision"] == "int4"


def test_openai_sdk_parses_the_relayed_stream(replay):
    app, server, proxy = replay
    cap = CAPTURES["chat_stream"]
    req = json.loads(cap.request_body)
    client = openai.OpenAI(base_url=proxy.url + "/v1", api_key="k", max_retries=0)
    text = "".join(
        c.choices[0].delta.content or "" for c in client.chat.completions.create(**req) if c.choices
    )
    assert text.startswith("Name three colours")


# --- the tap on real bytes -----------------------------------------------------------------


def _tap(name: str, endpoint: str = "chat"):
    marks = Marks(t_recv=0.0)
    return LlamaTap(marks, native=endpoint == "llamacpp_completion"), marks


def test_role_event_is_not_a_token():
    cap = CAPTURES["chat_stream"]
    tap, marks = _tap("chat_stream")
    run(tap, cap.parts)
    # part 0 holds the role event (content null) and the first token, in one write
    assert marks.t_first == 100.0
    # 16 content events plus the finish event (the last token's end)
    assert marks.output_events == 17
    out = LlamaCppDialect().outcome(tap, None, 200)
    assert out.finished and out.usage.completion_tokens == 16 and out.usage.prompt_tokens == 30


def test_keepalive_comments_before_the_first_token():
    cap = CAPTURES["sse_ping_stream"]
    tap, marks = _tap("sse_ping_stream", "llamacpp_completion")
    run(tap, cap.parts)
    assert marks.t_first == 100.0 + 23 * 0.01  # 23 ":" comments came first
    out = LlamaCppDialect().outcome(tap, None, 200)
    assert out.finished and tap.done  # the native stream has no [DONE]
    assert out.engine.prefill_seconds == pytest.approx(31.617931)
    assert out.usage.completion_tokens == 60


def test_stop_word_timings_last_one_wins_and_progress_is_not_output():
    cap = CAPTURES["chat_stream_stop_word"]
    tap, marks = _tap("x")
    run(tap, cap.parts)
    out = LlamaCppDialect().outcome(tap, None, 200)
    assert out.usage.completion_tokens == 12 and out.usage.cached_tokens == 25
    assert out.engine.prefill_tokens == 5
    cap = CAPTURES["native_completion_stream_progress"]
    tap, marks = _tap("x", "llamacpp_completion")
    run(tap, cap.parts)
    first_content = next(
        i for i, p in enumerate(cap.parts) if b'"content":"' in p and b'"content":""' not in p
    )
    assert marks.t_first == pytest.approx(100.0 + first_content * 0.01)
    assert LlamaCppDialect().outcome(tap, None, 200).engine.decode_tokens == 16


def test_midstream_error_without_done():
    cap = CAPTURES["chat_stream"]
    body = (
        b"".join(cap.parts[:5])
        + b'data: {"error":{"code":500,"message":"boom","type":"server_error"}}\n\n'
    )
    tap, marks = _tap("x")
    run(tap, [body])
    out = LlamaCppDialect().outcome(tap, None, 200)
    assert out.error_kind == "midstream" and out.error_message == "boom"
    tap, marks = _tap("x")
    run(tap, [b"".join(cap.parts[:5])])
    assert LlamaCppDialect().outcome(tap, None, 200).error_kind == "truncated"


def test_usage_is_never_injected():
    d = LlamaCppDialect()
    raw = b'{"messages":[{"role":"user","content":"x"}],"stream":true}'
    p = d.prepare("chat", raw, inject_usage=True)
    assert p.body == raw and not p.strip_usage and p.stream


@settings(max_examples=120, deadline=None)
@given(
    st.lists(st.integers(min_value=0, max_value=10**6), max_size=30),
    st.sampled_from(
        [
            "chat_stream",
            "chat_stream_include_usage",
            "completions_stream",
            "native_completion_stream",
            "chat_stream_stop_word",
            "sse_ping_stream",
        ]
    ),
)
def test_any_split_forwards_every_byte_and_reads_the_same(cuts, name):
    cap = CAPTURES[name]
    native = cap.path == "/completion"
    tap = LlamaTap(Marks(t_recv=0.0), native=native)
    assert run(tap, splits(cap.body, cuts)) == cap.body
    whole = LlamaTap(Marks(t_recv=0.0), native=native)
    run(whole, [cap.body])
    a, b = LlamaCppDialect().outcome(tap, None, 200), LlamaCppDialect().outcome(whole, None, 200)
    assert (a.usage, a.engine, a.finished) == (b.usage, b.engine, b.finished)
    assert tap.marks.output_events == whole.marks.output_events


def test_wire_fixtures_read():
    for name, cached in (("llamacpp-chat-stream.sse", 0), ("llamacpp-chat-stream-usage.sse", 0)):
        tap = LlamaTap(Marks(t_recv=0.0), native=False)
        data = (WIRE / name).read_bytes()
        assert run(tap, [data]) == data
        out = LlamaCppDialect().outcome(tap, None, 200)
        assert (out.usage.prompt_tokens, out.usage.completion_tokens, out.usage.cached_tokens) == (
            36,
            16,
            cached,
        )
        assert out.engine.decode_tokens_per_second == 120.47104177333372


# --- against the simulated llama-server ------------------------------------------------------


def test_proxy_figures_within_a_few_percent_of_the_engines():
    sim = start_sim("llamacpp", speed=1.0, deterministic=False)
    proxy = start_proxy(sim.url)
    try:
        client = openai.OpenAI(base_url=proxy.url + "/v1", api_key="k", max_retries=0)
        for i in range(4):
            prompt = " ".join(f"w{i}x{j}" for j in range(400 + 600 * i))
            stream = client.chat.completions.create(
                model="qwen2.5-7b-instruct",
                messages=[{"role": "user", "content": prompt}],
                max_tokens=160,
                stream=True,
                extra_body={"ignore_eos": True},
                extra_headers={"x-request-id": f"llama-{i}"},
            )
            assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
        lines = wait_for(
            lambda: (lambda ok: ok if len(ok) >= 4 else None)(
                [r for r in proxy.request_lines() if r["outcome"] == "ok"]
            ),
            what="four request log lines",
        )
        assert len(lines) == 4
        truth = wait_for(
            lambda: (lambda t: t if all(r["request_id"] in t for r in lines) else None)(
                {t["request_id"]: t for t in sim.truth()}
            ),
            what="the engine's truth for the four requests",
        )
        decode_err, waits = [], []
        for line in lines:
            t = truth[line["request_id"]]
            rep = t["reported"]
            assert int(line["completion_tokens"]) == rep["predicted_n"] == 160
            assert float(line["engine_decode_tps"]) == pytest.approx(
                rep["predicted_per_second"], rel=1e-3
            )
            # the proxy's decode rate: same definition, its own clock
            decode_err.append(abs(float(line["decode_tps"]) / rep["predicted_per_second"] - 1))
            # prefill: proxy's window = engine wait + prompt_ms + the first write
            proxy_prefill = float(line["ttft_s"]) - float(line["queue_s"])
            assert proxy_prefill == pytest.approx(rep["prompt_ms"] / 1000, rel=0.25, abs=0.02)
            waits.append(float(line["upstream_queue_s"]) / (rep["predicted_ms"] / 1000))
        # within a few percent (a busy 2-core machine delays single writes now and then)
        assert statistics.median(decode_err) < 0.03 and max(decode_err) < 0.08, decode_err
        # nothing queued: the upstream wait (network, the first write) is a sliver of the
        # request's own decode time
        assert statistics.median(waits) < 0.05, waits
        s = metric_samples(proxy.url)
        assert (
            sample(
                s,
                "phasewatch_model_info",
                model="qwen2.5-7b-instruct",
                precision="int4",
                quant="Q4_K_M",
            )
            == 1
        )
    finally:
        proxy.stop()
        sim.stop()


def test_sim_bytes_through_proxy_equal_direct():
    sim = start_sim("llamacpp", speed=8.0, deterministic=True)
    proxy = start_proxy(sim.url)
    try:
        for path, body in (
            (
                "/v1/chat/completions",
                {
                    "messages": [{"role": "user", "content": "a b c"}],
                    "max_tokens": 12,
                    "stream": True,
                },
            ),
            (
                "/v1/chat/completions",
                {
                    "messages": [{"role": "user", "content": "a b c"}],
                    "max_tokens": 12,
                    "stream": True,
                    "stream_options": {"include_usage": True},
                },
            ),
            ("/v1/completions", {"prompt": "x y", "max_tokens": 9, "stream": True}),
            ("/completion", {"prompt": "x y", "n_predict": 9, "stream": True}),
            ("/completion", {"prompt": "x y z", "n_predict": 9}),
        ):
            direct = httpx.post(sim.url + path, json=body)
            via = httpx.post(proxy.url + path, json=body)
            assert via.status_code == direct.status_code == 200

            def strip(b):  # timings and cache hits differ run to run; the rest is equal
                b = re.sub(rb'"timings":\{[^}]*\}', b"T", b)
                return re.sub(rb'"cached_tokens":\d+', b"C", b)

            assert strip(via.content) == strip(direct.content)
        s = metric_samples(proxy.url)
        assert sample(s, "phasewatch_requests_total", outcome="ok") == 5
        assert sample(s, "phasewatch_requests_total", endpoint="llamacpp_completion") == 2
        # a stream cut by an engine error: the error event passes, the request is an error
        resp = httpx.post(
            proxy.url + "/v1/chat/completions",
            json={
                "messages": [{"role": "user", "content": "q"}],
                "max_tokens": 30,
                "stream": True,
                "sim_error_after": 4,
            },
        )
        assert (
            resp.content.endswith(b'"type":"server_error"}}\n\n') and b"[DONE]" not in resp.content
        )
        time.sleep(0.2)
        assert sample(metric_samples(proxy.url), "phasewatch_errors_total", kind="midstream") == 1
    finally:
        proxy.stop()
        sim.stop()


def test_client_hangup_frees_the_slot():
    sim = start_sim("llamacpp", speed=1.0, deterministic=True)
    proxy = start_proxy(sim.url)
    try:
        body = {"prompt": "go on", "n_predict": 3000, "stream": True}
        with httpx.stream("POST", proxy.url + "/completion", json=body, timeout=30) as r:
            for _ in r.iter_lines():
                break
        deadline = time.monotonic() + 10
        while not sim.truth() and time.monotonic() < deadline:
            time.sleep(0.05)
        t = sim.truth()[0]
        assert t["aborted"] and t["completion_tokens"] < 3000
        slots = httpx.get(sim.url + "/slots").json()
        assert not any(s["is_processing"] for s in slots)
        time.sleep(0.2)
        assert sample(metric_samples(proxy.url), "phasewatch_aborts_total") == 1
    finally:
        proxy.stop()
        sim.stop()
