"""An engine's lies never crash the measurement (issue 23.3).

Whatever JSON an engine puts in its usage and timings (negative counts, ``10**400``,
``1e308``, NaN, strings, booleans), every dialect's reading of it never raises, the
recorder never raises, every request still gets its access line, every counter stays
finite and non-negative, and what was plausible is kept exactly. Property-based over each
dialect's fields (hypothesis), then end to end: a raw-socket fake engine that lies, the
real proxy on loopback, its log lines and its /metrics.
"""

from __future__ import annotations

import json
import logging
import math
from dataclasses import dataclass, field

import httpx
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from proxy.engines import get_dialect
from proxy.engines.base import Outcome, Prepared
from proxy.measure.metrics import Metrics
from proxy.measure.recorder import Recorder
from proxy.measure.sanity import MAX_TOKENS
from proxy.measure.timeline import EngineTimings, Marks, Usage
from proxy.services.status import RECENT_SECONDS

from ...support.fake_engine import FakeEngine, Reply, Request, response
from ...support.servers import metric_samples, sample, start_proxy

# --- what an engine may send ------------------------------------------------------------

#: Any JSON value an engine could put where a number belongs.
WIRE = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**40), max_value=2**40),
    st.integers(min_value=-(10**600), max_value=10**600),
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([-1, 0, 1, 10**400, 1e308, -1e308, 2**31, 2**31 + 1, 0.5, 12.0, -0.0]),
    st.text(max_size=4),
    st.sampled_from([[], {}, [1], {"a": 1}]),
)


def fields(*names: str):
    """A JSON object holding any subset of `names`, each with any value."""
    return st.fixed_dictionaries({}, optional=dict.fromkeys(names, WIRE))


def plausible_count(value: object) -> bool:
    if type(value) is int:
        return 0 <= value <= MAX_TOKENS
    if type(value) is float:
        return math.isfinite(value) and value.is_integer() and 0 <= value <= MAX_TOKENS
    return False


def present(value: object) -> bool:
    return value is not None


# --- the recorder's side: a finished request with the dialect's outcome ------------------


@dataclass
class Done:
    """A finished streamed request as the recorder reads it (proxy.measure.recorder)."""

    usage: Usage
    engine_timings: EngineTimings
    dropped: list[str]
    marks: Marks = field(
        default_factory=lambda: Marks(0.0, 0.001, 0.002, 0.01, 0.1, 0.5, 0.6, output_events=8)
    )
    request_id: str = "lie-1"
    client: str = "unknown"
    trace_id: str | None = None
    model_label: str = "m"
    precision: str = "bf16"
    status: int = 200
    outcome: str = "ok"
    error_kind: str | None = None
    error_message: str | None = None
    abort_phase: str | None = None
    upstream_name: str = "eng"
    endpoint: str = "chat"
    stream: bool = True
    streamed: bool = True
    gaps: tuple[list[int], float] | None = None
    kv: None = None
    side_errors: list[str] = field(default_factory=list)
    batch: int = 1


class Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


METRICS = Metrics()
RECORDER = Recorder(METRICS)
ACCESS = Lines()
logging.getLogger("proxy.access").addHandler(ACCESS)
logging.getLogger("proxy.access").setLevel(logging.INFO)


def record(out: Outcome) -> dict:
    """Record `out` as a finished request; the access line's fields."""
    before = len(ACCESS.records)
    RECORDER.record(Done(out.usage, out.engine, out.dropped))  # never raises
    assert len(ACCESS.records) == before + 1, "the request lost its access line"
    return ACCESS.records[-1].fields  # type: ignore[attr-defined]


def assert_counters_sane() -> None:
    """Every phasewatch sample (counters, histogram buckets, sums) finite and >= 0."""
    for family in METRICS.registry.collect():
        if not family.name.startswith("phasewatch_"):
            continue
        for s in family.samples:
            assert math.isfinite(s.value) and s.value >= 0, (s.name, s.labels, s.value)


PROPERTY = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])

# --- one property per dialect's fields ---------------------------------------------------


@PROPERTY
@given(
    usage=fields("prompt_tokens", "completion_tokens", "total_tokens"),
    details=fields("cached_tokens"),
    engine=st.sampled_from(["openai", "vllm"]),
)
def test_openai_usage_of_any_value_is_measured_or_dropped_never_raised(usage, details, engine):
    usage = {**usage, "prompt_tokens_details": details}
    body = json.dumps({"choices": [{"message": {"content": "hi"}}], "usage": usage}).encode()
    out = get_dialect(engine).outcome(None, body, 200)
    assert out.finished
    # a pooling answer (vLLM's rerank) counts only total_tokens, all of them input
    pooling = usage.get("prompt_tokens") is None and usage.get("completion_tokens") is None
    for key, got in (
        ("prompt_tokens", out.usage.prompt_tokens),
        ("completion_tokens", out.usage.completion_tokens),
    ):
        source = "total_tokens" if pooling and key == "prompt_tokens" else key
        value = usage.get(source)
        if plausible_count(value):
            assert got == int(value)  # type: ignore[arg-type]
        else:
            assert got is None
            assert (source in out.dropped) == present(value)
    cached = details.get("cached_tokens")
    assert out.usage.cached_tokens == (int(cached) if plausible_count(cached) else None)
    line = record(out)
    assert_counters_sane()
    for key in ("prompt_tokens", "completion_tokens", "cached_tokens"):
        assert line.get(key) is None or 0 <= line[key] <= MAX_TOKENS


@PROPERTY
@given(usage=fields("prompt_tokens", "completion_tokens"), details=fields("cached_tokens"))
def test_a_streamed_usage_event_of_any_value_is_measured_or_dropped(usage, details):
    dialect = get_dialect("vllm")
    usage = {**usage, "prompt_tokens_details": details}
    marks = Marks(0.0)
    tap = dialect.tap("text/event-stream", marks, Prepared("chat", "m", True, b""))
    assert tap is not None
    events = [
        {"choices": [{"index": 0, "delta": {"content": "a"}, "finish_reason": None}]},
        {"choices": [{"index": 0, "delta": {"content": "b"}, "finish_reason": "stop"}]},
        {"choices": [], "usage": usage},
    ]
    wire = b"".join(b"data: " + json.dumps(e).encode() + b"\n\n" for e in events)
    tap.feed(wire + b"data: [DONE]\n\n", 1.0)
    tap.end(1.1)
    out = dialect.outcome(tap, None, 200)
    assert out.finished
    value = usage.get("completion_tokens")
    assert out.usage.completion_tokens == (int(value) if plausible_count(value) else None)
    record(out)
    assert_counters_sane()


@PROPERTY
@given(
    line=fields(
        "prompt_eval_count",
        "eval_count",
        "total_duration",
        "load_duration",
        "prompt_eval_duration",
        "eval_duration",
    )
)
def test_an_ollama_done_line_of_any_value_is_measured_or_dropped(line):
    body = json.dumps({"model": "m", "done": True, "response": "", **line}).encode()
    out = get_dialect("ollama").outcome(None, body, 200)
    assert out.finished
    for key, got in (
        ("prompt_eval_count", out.usage.prompt_tokens),
        ("eval_count", out.usage.completion_tokens),
    ):
        value = line.get(key, 0)
        value = 0 if value is None else value  # Ollama leaves out what is zero
        assert got == (int(value) if plausible_count(value) else None)
    e = out.engine
    for x in (e.prefill_seconds, e.decode_seconds, e.load_seconds, e.total_seconds):
        assert x is None or 0 <= x <= 86400
    assert e.decode_tokens_per_second is None or 0 <= e.decode_tokens_per_second <= 1e9
    record(out)
    assert_counters_sane()


@PROPERTY
@given(line=fields("prompt_eval_count", "total_duration", "load_duration"))
def test_an_ollama_embed_answer_of_any_value_is_measured_or_dropped(line):
    body = json.dumps({"model": "m", "embeddings": [[0.1, 0.2]], **line}).encode()
    out = get_dialect("ollama").outcome(None, body, 200)
    value = line.get("prompt_eval_count")
    assert out.usage.prompt_tokens == (int(value) if plausible_count(value) else None)
    record(out)
    assert_counters_sane()


@PROPERTY
@given(
    timings=fields(
        "prompt_n", "cache_n", "prompt_ms", "predicted_n", "predicted_ms", "predicted_per_second"
    ),
    usage=st.one_of(st.none(), fields("prompt_tokens", "completion_tokens")),
)
def test_llama_server_timings_of_any_value_are_measured_or_dropped(timings, usage):
    obj: dict = {"content": "hi", "stop": True, "timings": timings}
    if usage is not None:
        obj["usage"] = usage
    out = get_dialect("llamacpp").outcome(None, json.dumps(obj).encode(), 200)
    assert out.finished
    e = out.engine
    value = timings.get("prompt_n")
    assert e.prefill_tokens == (int(value) if plausible_count(value) else None)
    for x in (e.prefill_seconds, e.decode_seconds):
        assert x is None or 0 <= x <= 86400
    line = record(out)
    assert_counters_sane()
    assert line.get("engine_decode_tps") is None or 0 <= line["engine_decode_tps"] <= 1e9


def test_the_recorder_drops_what_a_dialect_let_through():
    """The recorder's own guard: values no dialect should hand over (a negative count, a
    cached count over the prompt, an infinite duration) are dropped and counted there."""
    metrics = Metrics()
    rec = Recorder(metrics, access_lines=False)
    usage = Usage(prompt_tokens=10, completion_tokens=-4, cached_tokens=50)
    timings = EngineTimings(prefill_seconds=math.inf, decode_seconds=-1.0, decode_tokens=3)
    rec.record(Done(usage, timings, ["prompt_tokens"]))  # one dropped by the dialect already
    got = {
        s.labels["field"]: s.value
        for f in metrics.registry.collect()
        if f.name == "phasewatch_engine_values_dropped"
        for s in f.samples
        if s.name.endswith("_total")
    }
    assert got == {
        "prompt_tokens": 1,
        "completion_tokens": 1,
        "cached_tokens": 1,
        "prefill_seconds": 1,
        "decode_seconds": 1,
    }
    tokens = metrics.tokens_total.labels("eng", "m", "bf16", "prefill", "unknown")
    assert tokens._value.get() == 10  # the valid prompt count is still measured


# --- end to end: a lying engine behind the real proxy -------------------------------------

#: Sample suffixes of counters and histograms (a gauge may be NaN by design).
COUNTED = ("_total", "_sum", "_count", "_bucket")
CHAT = {"model": "fake-model", "messages": [{"role": "user", "content": "hi"}]}

#: (usage the engine reports, what stays measurable) per request, in order.
LIES = [
    ({"prompt_tokens": -5, "completion_tokens": 10**400, "total_tokens": 3}, {}),
    ({"prompt_tokens": 1e308, "completion_tokens": 7}, {"completion_tokens": 7}),
    (
        {
            "prompt_tokens": 9,
            "completion_tokens": "many",
            "prompt_tokens_details": {"cached_tokens": -2},
        },
        {"prompt_tokens": 9},
    ),
    ({"prompt_tokens": True, "completion_tokens": 4}, {"completion_tokens": 4}),
]


def lying_engine():
    count = {"n": 0}

    def answer(req: Request) -> Reply | None:
        if req.method == "POST" and req.target == "/v1/chat/completions":
            usage = LIES[count["n"] % len(LIES)][0]
            count["n"] += 1
            stream = json.loads(req.body).get("stream") is True
            if not stream:
                body = json.dumps(
                    {
                        "model": "fake-model",
                        "choices": [
                            {"index": 0, "message": {"content": "hi"}, "finish_reason": "stop"}
                        ],
                        "usage": usage,
                    }
                ).encode()
                return Reply(response(200, body, [("Content-Type", "application/json")]))
            events = [
                {"choices": [{"index": 0, "delta": {"content": "h"}, "finish_reason": None}]},
                {"choices": [{"index": 0, "delta": {"content": "i"}, "finish_reason": "stop"}]},
                {"choices": [], "usage": usage},
            ]
            sse = b"".join(b"data: " + json.dumps(e).encode() + b"\n\n" for e in events)
            sse += b"data: [DONE]\n\n"
            return Reply(response(200, sse, [("Content-Type", "text/event-stream")], chunked=True))
        return None  # the engine's standard answer

    return answer


def test_a_lying_engine_behind_the_proxy_costs_no_request_its_line_or_counters():
    with FakeEngine(lying_engine()) as engine:
        proxy = start_proxy(f"eng={engine.url}", args=["--engine", "eng=openai"])
        try:
            for i in range(len(LIES)):
                body = {**CHAT, "stream": i % 2 == 1, "stream_options": {"include_usage": True}}
                if not body["stream"]:
                    del body["stream_options"]
                resp = httpx.post(proxy.url + "/v1/chat/completions", json=body, timeout=10)
                assert resp.status_code == 200
            lines = proxy.request_lines(at_least=len(LIES))
            assert len(lines) == len(LIES)
            for line, (_, kept) in zip(lines, LIES, strict=True):
                assert line["outcome"] == "ok" and line["status"] == "200"
                for key in ("prompt_tokens", "completion_tokens", "cached_tokens"):
                    want = kept.get(key)
                    assert line.get(key) == (None if want is None else str(want)), (key, line)
            samples = metric_samples(proxy.url)
            assert sample(samples, "phasewatch_requests_total", outcome="ok") == len(LIES)
            for (name, _), value in samples.items():
                if name.startswith("phasewatch_") and name.endswith(COUNTED):
                    assert math.isfinite(value) and value >= 0, name
            assert sample(samples, "phasewatch_tokens_total", phase="decode") == 7 + 4
            assert sample(samples, "phasewatch_tokens_total", phase="prefill") == 9
            dropped = "phasewatch_engine_values_dropped_total"
            assert sample(samples, dropped, upstream="eng", field="prompt_tokens") == 3
            assert sample(samples, dropped, upstream="eng", field="completion_tokens") == 2
            assert sample(samples, dropped, upstream="eng", field="cached_tokens") == 1
            # the status page's table counted every request
            summary = httpx.get(proxy.url + "/phasewatch/api/summary", timeout=10).json()
            (row,) = [r for r in summary["rows"] if r["model"] == "fake-model"]
            assert row["recent"]["requests_per_min"] == len(LIES) * 60.0 / RECENT_SECONDS
            # said once (then at most every 10 s), never the values themselves
            said = [x for x in proxy.log().splitlines() if "reported implausible" in x]
            assert len(said) == 1, said
            assert "1e+308" not in proxy.log() and "many" not in said[0]
            assert "Traceback" not in proxy.log()
        finally:
            proxy.stop()
