"""OpenTelemetry end to end (--otel): a real OTLP/HTTP receiver on loopback gets phasewatch's
spans and GenAI metrics, decoded with the official opentelemetry-proto messages; the trace
context reaches the engine in `traceparent`; exemplars name the trace.

Spans are compared with the proxy's own log line and the simulator's ground truth (token
counts), never with absolute times.
"""

from __future__ import annotations

import asyncio
import os
import secrets
import subprocess
import sys
import time

import httpx
import openai
import pytest
from prometheus_client.openmetrics.parser import text_string_to_metric_families

from ...support.fake_engine import SSE_HEAD, FakeEngine, Request, chunk
from ...support.otlp_receiver import Receiver
from ...support.servers import (
    ROOT,
    free_port,
    metric_samples,
    sample,
    start_proxy,
    start_sim,
    wait_for,
)

MODEL = "meta-llama/Llama-3.1-8B-Instruct"
OPENMETRICS = "application/openmetrics-text; version=1.0.0; charset=utf-8"


def otel_env(receiver: Receiver, **extra: str) -> dict:
    """Export quickly to the test's receiver (the SDK reads these itself)."""
    return {
        "OTEL_EXPORTER_OTLP_ENDPOINT": receiver.endpoint,
        "OTEL_BSP_SCHEDULE_DELAY": "50",
        "OTEL_METRIC_EXPORT_INTERVAL": "300",
        "OTEL_SERVICE_NAME": "pw-under-test",
        **extra,
    }


def traceparent() -> tuple[str, str, str]:
    trace_id, span_id = secrets.token_hex(16), secrets.token_hex(8)
    return f"00-{trace_id}-{span_id}-01", trace_id, span_id


@pytest.fixture(scope="module")
def traced():
    receiver = Receiver()
    sim = start_sim("vllm", speed=4.0)
    proxy = start_proxy(f"sim={sim.url}", args=["--otel"], env=otel_env(receiver))
    yield receiver, sim, proxy
    proxy.stop()
    sim.stop()
    receiver.stop()


def _stream_chat(proxy, headers: dict, max_tokens: int = 12, model: str = MODEL) -> str:
    client = openai.OpenAI(base_url=proxy.url + "/v1", api_key="unused", max_retries=0)
    stream = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "tell me about the two phases " * 20}],
        max_tokens=max_tokens,
        stream=True,
        extra_body={"ignore_eos": True},
        extra_headers=headers,
    )
    return "".join(c.choices[0].delta.content or "" for c in stream if c.choices)


def _line(proxy, request_id: str) -> dict:
    lines = wait_for(
        lambda: [line for line in proxy.request_lines() if line["request_id"] == request_id],
        what=f"the log line of request {request_id}",
    )
    assert len(lines) == 1, proxy.log()[-3000:]
    return lines[0]


def test_one_span_per_request_continuing_the_clients_trace(traced):
    receiver, sim, proxy = traced
    header, trace_id, parent_id = traceparent()
    rid = "trace-" + secrets.token_hex(4)
    assert _stream_chat(proxy, {"traceparent": header, "x-request-id": rid}, max_tokens=24)

    spans = receiver.wait_spans(lambda s: any(x["trace_id"] == trace_id for x in s))
    mine = [s for s in spans if s["trace_id"] == trace_id]
    assert len(mine) == 1 and mine[0]["kind"] == "SPAN_KIND_SERVER", mine  # one per request
    span = mine[0]
    # the right parent: the client's span, in the client's trace
    assert span["parent_span_id"] == parent_id
    assert span["name"] == f"chat {MODEL}"
    assert span["service"] == "pw-under-test"
    a = span["attributes"]
    truth = wait_for(
        lambda: {t["request_id"]: t for t in sim.truth()}.get(rid), what="the engine's record"
    )
    line = _line(proxy, rid)
    assert a["gen_ai.operation.name"] == "chat"
    assert a["gen_ai.provider.name"] == "vllm"
    assert a["gen_ai.request.model"] == MODEL
    assert a["gen_ai.response.model"] == MODEL
    assert a["gen_ai.response.finish_reasons"] == ("length",)
    assert a["gen_ai.usage.input_tokens"] == truth["prompt_tokens"]
    assert a["gen_ai.usage.output_tokens"] == truth["completion_tokens"] == 24
    assert a["server.address"] == "127.0.0.1"
    assert a["server.port"] == int(sim.url.rsplit(":", 1)[1])
    assert a["http.response.status_code"] == 200
    assert a["phasewatch.request_id"] == rid
    assert a["phasewatch.precision"] == "bf16"
    assert a["phasewatch.outcome"] == "ok"
    assert a["phasewatch.client"] == "unknown"
    # the span says what the log line says (a busy machine may deliver every token in one
    # read, and then neither has a decode rate)
    for attr, field in (
        ("phasewatch.ttft_seconds", "ttft_s"),
        ("phasewatch.prefill_tokens_per_second", "prefill_tps"),
        ("phasewatch.decode_tokens_per_second", "decode_tps"),
    ):
        assert (attr in a) == (field in line), (attr, a, line)
        if field in line:
            assert a[attr] == pytest.approx(float(line[field]), rel=1e-3, abs=1e-4), attr
    assert "phasewatch.ttft_seconds" in a and "phasewatch.prefill_tokens_per_second" in a
    # the log line names the trace, so logs and traces join
    assert line["trace_id"] == trace_id

    # the phases: events where each began, with its length, in order inside the span
    events = {e["name"]: e for e in span["events"]}
    assert [e["name"] for e in span["events"]] == ["queue", "prefill", "decode"]
    q, p, d = events["queue"], events["prefill"], events["decode"]
    assert span["start"] == q["time"] <= p["time"] <= d["time"] <= span["end"]
    length = {name: e["attributes"]["phasewatch.phase_seconds"] for name, e in events.items()}
    assert length["queue"] == pytest.approx(float(line["queue_s"]), abs=1e-4)
    assert length["prefill"] == pytest.approx(a["phasewatch.prefill_seconds"])
    assert length["decode"] == pytest.approx(a.get("phasewatch.decode_seconds", 0.0))
    assert d["time"] + length["decode"] * 1e9 <= span["end"]
    # times as the proxy measured them (wall nanoseconds from the monotonic marks)
    assert (d["time"] - span["start"]) / 1e9 == pytest.approx(float(line["ttft_s"]), abs=2e-4)
    assert (span["end"] - span["start"]) / 1e9 == pytest.approx(float(line["request_s"]), abs=2e-4)
    assert d["attributes"].get("phasewatch.decode_tokens_per_second") == a.get(
        "phasewatch.decode_tokens_per_second"
    )


def test_a_request_without_traceparent_starts_a_trace(traced):
    receiver, _, proxy = traced
    rid = "root-" + secrets.token_hex(4)
    assert _stream_chat(proxy, {"x-request-id": rid}, max_tokens=4)
    spans = receiver.wait_spans(
        lambda s: any(x["attributes"].get("phasewatch.request_id") == rid for x in s)
    )
    (span,) = [s for s in spans if s["attributes"].get("phasewatch.request_id") == rid]
    assert span["parent_span_id"] == ""
    assert len(span["trace_id"]) == 32 and int(span["trace_id"], 16) != 0
    assert _line(proxy, rid)["trace_id"] == span["trace_id"]


def test_an_aborted_request_says_where_it_was_cut(traced):
    receiver, _, proxy = traced
    header, trace_id, _ = traceparent()
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "a long answer please"}],
        "max_tokens": 400,
        "ignore_eos": True,
        "stream": True,
    }
    with httpx.stream(
        "POST",
        proxy.url + "/v1/chat/completions",
        json=body,
        headers={"traceparent": header},
        timeout=30,
    ) as r:
        for i, _ in enumerate(r.iter_lines()):
            if i >= 10:  # a few tokens in: hang up mid-decode
                break
    spans = receiver.wait_spans(lambda s: any(x["trace_id"] == trace_id for x in s))
    (span,) = [s for s in spans if s["trace_id"] == trace_id]
    a = span["attributes"]
    assert (a["phasewatch.outcome"], a["phasewatch.abort_phase"]) == ("aborted", "decode")
    assert "gen_ai.usage.output_tokens" not in a  # the engine never said
    decode = next(e for e in span["events"] if e["name"] == "decode")
    # the decode phase runs to where the client left
    assert decode["time"] + decode["attributes"]["phasewatch.phase_seconds"] * 1e9 == (
        pytest.approx(span["end"], abs=1000)
    )


def test_genai_metrics_over_otlp_carry_the_precision(traced):
    receiver, _, proxy = traced
    models = ("RedHatAI/Llama-3.1-8B-Instruct-FP8", "hugging-quants/Llama-3.1-8B-Instruct-AWQ-INT4")
    for model in models:
        assert _stream_chat(proxy, {}, max_tokens=4, model=model)
    names = {
        "gen_ai.server.time_to_first_token",
        "gen_ai.server.time_per_output_token",
        "gen_ai.server.request.duration",
        "gen_ai.client.token.usage",
    }

    def complete(points):
        got = {(p["name"], p["attributes"].get("phasewatch.precision")) for p in points}
        return {(n, prec) for n in names for prec in ("fp8", "int4")} <= got

    points = receiver.wait_points(complete)
    fp8 = [p for p in points if p["attributes"].get("phasewatch.precision") == "fp8"]
    ttft = [p for p in fp8 if p["name"] == "gen_ai.server.time_to_first_token"]
    assert ttft[-1]["unit"] == "s"
    assert ttft[-1]["attributes"]["gen_ai.request.model"] == models[0]
    assert ttft[-1]["attributes"]["gen_ai.operation.name"] == "chat"
    assert ttft[-1]["attributes"]["gen_ai.provider.name"] == "vllm"
    # the semantic conventions' advised buckets
    assert ttft[-1]["bounds"][:3] == (0.001, 0.005, 0.01)
    usage = [p for p in fp8 if p["name"] == "gen_ai.client.token.usage"]
    kinds = {p["attributes"]["gen_ai.token.type"] for p in usage}
    assert kinds == {"input", "output"}
    out = [p for p in usage if p["attributes"]["gen_ai.token.type"] == "output"][-1]
    assert out["count"] >= 1 and out["sum"] == 4 * out["count"]


def test_exemplars_name_the_trace(traced):
    receiver, _, proxy = traced
    header, trace_id, _ = traceparent()
    rid = "ex-" + secrets.token_hex(4)
    assert _stream_chat(proxy, {"traceparent": header, "x-request-id": rid}, max_tokens=40)
    text = httpx.get(proxy.url + "/metrics", headers={"accept": OPENMETRICS}).text
    found = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.exemplar is not None and s.exemplar.labels.get("trace_id") == trace_id:
                found[family.name] = s.exemplar
    assert set(found) == {
        "phasewatch_ttft_seconds",
        "phasewatch_decode_tokens_per_second",
        "phasewatch_request_seconds",
    }
    line = _line(proxy, rid)
    assert found["phasewatch_ttft_seconds"].labels["request_id"] == rid
    assert found["phasewatch_ttft_seconds"].value == pytest.approx(float(line["ttft_s"]), abs=1e-4)


def test_without_otel_the_proxy_adds_no_trace_header(proxy):
    """The default proxy (no --otel) passes the client's traceparent as it is and adds
    none; exemplars then carry the request id."""
    engine = _header_engine().start()
    plain = start_proxy(f"fake={engine.url}", args=["--engine", "fake=openai"])
    try:
        header, _, _ = traceparent()
        httpx.post(plain.url + "/v1/chat/completions", json=_fake_body(), timeout=10)
        httpx.post(
            plain.url + "/v1/chat/completions",
            json=_fake_body(),
            headers={"traceparent": header, "tracestate": "k=v"},
            timeout=10,
        )
        seen = _sent(engine)
        assert "traceparent" not in seen[0] and "tracestate" not in seen[0]
        assert seen[1]["traceparent"] == header
        assert seen[1]["tracestate"] == "k=v"
        plain.request_lines(at_least=2)  # both recorded: their exemplars are in /metrics
        text = httpx.get(plain.url + "/metrics", headers={"accept": OPENMETRICS}).text
        labels = [
            s.exemplar.labels
            for fam in text_string_to_metric_families(text)
            if fam.name == "phasewatch_ttft_seconds"
            for s in fam.samples
            if s.exemplar is not None
        ]
        ids = {line["request_id"] for line in plain.request_lines()}
        assert labels and all(set(lab) == {"request_id"} for lab in labels)
        assert {lab["request_id"] for lab in labels} <= ids
    finally:
        plain.stop()
        engine.stop()


# --- the engine sees the trace context ----------------------------------------------------


def _header_engine() -> FakeEngine:
    """The fake engine serving model "fake" and streaming a short answer to each generation
    request (usage included when asked); its POSTs' headers are read by :func:`_sent`."""
    head = '{"id":"c","object":"chat.completion.chunk","created":1,"model":"fake","choices":'

    async def script(req: Request, reader, writer) -> None:
        events = [head + '[{"index":0,"delta":{"role":"assistant","content":""}}]}']
        for word in ("one", " two", " three"):
            events.append(head + f'[{{"index":0,"delta":{{"content":"{word}"}}}}]}}')
        events.append(head + '[{"index":0,"delta":{},"finish_reason":"stop"}]}')
        if b'"include_usage":true' in req.body:
            events.append(
                head + '[],"usage":{"prompt_tokens":3,"completion_tokens":3,"total_tokens":6}}'
            )
        events.append("[DONE]")
        writer.write(SSE_HEAD)
        for ev in events:
            writer.write(chunk(f"data: {ev}\n\n".encode()))
            await writer.drain()
            await asyncio.sleep(0.002)
        writer.write(b"0\r\n\r\n")
        await writer.drain()

    return FakeEngine(models=["fake"], script=script)


def _sent(engine: FakeEngine) -> list[dict[str, str]]:
    """The headers of each generation request the engine was sent, names in lower case."""
    return [{k.lower(): v for k, v in r.headers} for r in engine.posts()]


def _fake_body() -> dict:
    return {
        "model": "fake",
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 3,
        "stream": True,
    }


@pytest.fixture(scope="module")
def fake_engine():
    with _header_engine() as engine:
        yield engine


def test_traceparent_reaches_the_engine_under_the_requests_span(fake_engine):
    engine = fake_engine
    receiver = Receiver()
    proxy = start_proxy(
        f"fake={engine.url}", args=["--otel", "--engine", "fake=openai"], env=otel_env(receiver)
    )
    try:
        header, trace_id, parent_id = traceparent()
        client = openai.OpenAI(base_url=proxy.url + "/v1", api_key="unused", max_retries=0)
        stream = client.chat.completions.create(
            model="fake",
            messages=[{"role": "user", "content": "hi"}],
            stream=True,
            extra_headers={"traceparent": header, "tracestate": "vendor=1"},
        )
        assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == (
            "one two three"
        )
        httpx.post(proxy.url + "/v1/chat/completions", json=_fake_body(), timeout=10)
        spans = receiver.wait_spans(lambda s: sum(x["kind"] == "SPAN_KIND_SERVER" for x in s) >= 2)
        continued, fresh = _sent(engine)[-2:]
        # continued: the engine's parent is phasewatch's span in the client's trace
        (span,) = [
            s for s in spans if s["trace_id"] == trace_id and s["kind"] == "SPAN_KIND_SERVER"
        ]
        assert span["parent_span_id"] == parent_id
        assert continued["traceparent"] == f"00-{trace_id}-{span['span_id']}-01"
        assert continued["tracestate"] == "vendor=1"
        # fresh: a new trace, still under phasewatch's span
        version, tid, sid, flags = fresh["traceparent"].split("-")
        (root,) = [s for s in spans if s["trace_id"] == tid and s["kind"] == "SPAN_KIND_SERVER"]
        assert (version, sid) == ("00", root["span_id"])
        assert int(flags, 16) & 1  # sampled (the SDK may add W3C's "random" flag)
        assert root["parent_span_id"] == ""
    finally:
        proxy.stop()
        receiver.stop()


def test_an_unsampled_request_is_not_exported_and_says_so_upstream(fake_engine):
    engine = fake_engine
    receiver = Receiver()
    proxy = start_proxy(
        f"fake={engine.url}",
        args=["--otel", "--engine", "fake=openai"],
        env=otel_env(receiver, OTEL_TRACES_SAMPLER="always_off"),
    )
    try:
        httpx.post(proxy.url + "/v1/chat/completions", json=_fake_body(), timeout=10)
        _, tid, _, flags = _sent(engine)[-1]["traceparent"].split("-")
        assert not int(flags, 16) & 1  # the engine is told not to record it either
        # the GenAI metrics still flow: wait for them, then no span may have come
        receiver.wait_points(
            lambda p: any(x["name"] == "gen_ai.server.request.duration" for x in p)
        )
        assert receiver.spans == []
        (line,) = proxy.request_lines(at_least=1)
        assert "trace_id" not in line  # no trace to link to
    finally:
        proxy.stop()
        receiver.stop()


def test_failed_span_export_is_counted_and_said_once(fake_engine):
    engine = fake_engine
    dead = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    proxy = start_proxy(
        f"fake={engine.url}",
        args=["--otel", "--engine", "fake=openai"],
        env={
            "OTEL_EXPORTER_OTLP_ENDPOINT": dead,
            "OTEL_EXPORTER_OTLP_TIMEOUT": "1",
            "OTEL_BSP_SCHEDULE_DELAY": "50",
            "OTEL_METRICS_EXPORTER": "none",
        },
    )
    try:
        for _ in range(3):
            r = httpx.post(proxy.url + "/v1/chat/completions", json=_fake_body(), timeout=10)
            assert r.status_code == 200  # the request path never waits for the export
        deadline = time.monotonic() + 30
        while True:
            dropped = sample(
                metric_samples(proxy.url),
                "phasewatch_otel_spans_dropped_total",
                reason="export_failed",
            )
            if dropped >= 3:  # one span per request
                break
            assert time.monotonic() < deadline, proxy.log()[-3000:]
            time.sleep(0.2)
        assert proxy.log().count("OpenTelemetry span export failed") == 1
    finally:
        proxy.stop()


def test_unsupported_otel_settings_stop_start_up_with_one_line():
    res = subprocess.run(
        [sys.executable, "-m", "proxy", "serve", "--upstream", "http://127.0.0.1:9", "--otel"],
        cwd=ROOT,
        env={**os.environ, "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc"},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert res.returncode == 2
    assert res.stderr.strip().splitlines() == [
        "phasewatch: error: --otel: OTEL_EXPORTER_OTLP_PROTOCOL='grpc' is not supported: "
        "phasewatch exports OTLP over HTTP (http/protobuf)"
    ]


def test_missing_sdk_is_a_clear_error(monkeypatch):
    from proxy.measure.metrics import Metrics
    from proxy.services.tracing import Tracing

    monkeypatch.setitem(sys.modules, "opentelemetry.sdk.trace", None)
    with pytest.raises(ValueError, match=r"pip install 'phasewatch\[otel\]'"):
        Tracing(Metrics(), "test")


def test_workers_each_export_their_spans_and_metrics_carry_no_exemplars(fake_engine):
    """--workers N: every worker traces its own requests; prometheus-client's multiprocess
    mode keeps no exemplars, and /metrics stays valid OpenMetrics without them."""
    engine = fake_engine
    receiver = Receiver()
    proxy = start_proxy(
        f"fake={engine.url}",
        args=["--otel", "--engine", "fake=openai", "--workers", "2"],
        env=otel_env(receiver, OTEL_METRICS_EXPORTER="none"),
    )
    try:
        for i in range(6):
            r = httpx.post(
                proxy.url + "/v1/chat/completions",
                json=_fake_body(),
                headers={"x-request-id": f"w-{i}"},
                timeout=10,
            )
            assert r.status_code == 200
        spans = receiver.wait_spans(
            lambda s: (
                {x["attributes"].get("phasewatch.request_id") for x in s}
                >= {f"w-{i}" for i in range(6)}
            )
        )
        assert all(s["service"] == "pw-under-test" for s in spans)
        text = httpx.get(proxy.url + "/metrics", headers={"accept": OPENMETRICS}).text
        families = list(text_string_to_metric_families(text))
        ok = [
            s.value
            for fam in families
            if fam.name == "phasewatch_requests"
            for s in fam.samples
            if s.labels.get("outcome") == "ok"
        ]
        assert sum(ok) == 6
        assert all(s.exemplar is None for fam in families for s in fam.samples)
    finally:
        proxy.stop()
        receiver.stop()
