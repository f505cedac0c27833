"""The pieces of client attribution and of the span's response fields, without servers:
named keys, the client label, the chargeback rows, the response model and finish reasons."""

from __future__ import annotations

import base64

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from proxy.core.access import Access
from proxy.core.clients import Clients
from proxy.engines.base import Outcome, read_response
from proxy.measure.attribution import by_client
from proxy.measure.metrics import Metrics
from proxy.measure.summary import Samples
from proxy.settings import Settings, split_named_key


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("team-a=sk-123", ("team-a", "sk-123")),
        ("sk-123", (None, "sk-123")),
        ("c2stMTIz", (None, "c2stMTIz")),
        ("c2stMTI=", (None, "c2stMTI=")),  # base64 padding: bare
        ("c2stMT==", (None, "c2stMT==")),
        ("a b=c", (None, "a b=c")),  # not a client name: bare
        ("t.1=k=v", ("t.1", "k=v")),
    ],
)
def test_named_keys_parse(text, expected):
    assert split_named_key(text) == expected


def test_settings_keep_names_apart_from_keys():
    s = Settings(api_key=["team-a=ka", "kb", "team-c=kc"])
    assert s.api_keys == ["ka", "kb", "kc"]
    assert s.key_clients == {"ka": "team-a", "kc": "team-c"}
    assert Settings(clients=["a,b", "c"]).clients == ["a", "b", "c"]


def test_access_names_the_client_of_the_key():
    a = Access(["ka", "kb"], {}, {"ka": "team-a"})
    assert a.client([(b"authorization", b"Bearer ka")]) == "team-a"
    assert a.client([(b"x-api-key", b"ka")]) == "team-a"
    assert a.client([(b"authorization", b"Bearer kb")]) == ""  # bare key: nobody named
    assert a.client([(b"authorization", b"Bearer nope")]) is None
    assert a.client([]) is None
    basic = b"Basic " + base64.b64encode(b"user:ka")
    assert a.client([(b"authorization", basic)]) is None  # Basic only where asked for
    assert a.client([(b"authorization", basic)], basic=True) == "team-a"
    assert a.allowed([(b"x-api-key", b"kb")]) and not a.allowed([(b"x-api-key", b"kc")])
    # neither key reaches the engine
    headers = [(b"authorization", b"Bearer ka"), (b"x-api-key", b"kb"), (b"accept", b"*/*")]
    assert a.upstream_headers(headers, "u") == [(b"accept", b"*/*")]
    assert Access([], {}).client([]) == ""  # no keys: everyone, nobody named


def test_client_label_is_bounded():
    c = Clients("X-Team", ["red", "blue"])
    assert c.label([(b"x-team", b"red")]) == "red"
    assert c.label([(b"x-team", b" blue ")]) == "blue"
    assert c.label([(b"x-team", b"RED")]) == "other"
    assert c.label([(b"x-team", "é".encode())]) == "other"
    assert c.label([(b"x-team", b"x" * 10_000)]) == "other"
    assert c.label([]) == "unknown"
    assert c.label([(b"x-team", b"red")], key_client="team-a") == "team-a"
    assert Clients().label([(b"x-team", b"red")]) == "unknown"


def test_chargeback_rows_from_the_counters():
    m = Metrics(CollectorRegistry())
    base = ("u", "m", "bf16")
    m.requests_total.labels(*base, "chat", "ok", "team-a").inc(3)
    m.requests_total.labels(*base, "chat", "error", "team-a").inc()
    m.requests_total.labels(*base, "chat", "rejected", "team-b").inc()
    m.requests_total.labels(*base, "chat", "aborted", "team-b").inc(2)
    m.tokens_total.labels(*base, "prefill", "team-a").inc(100)
    m.tokens_total.labels(*base, "cached", "team-a").inc(20)
    m.tokens_total.labels(*base, "decode", "team-a").inc(50)
    m.tokens_total.labels(*base, "decode", "team-b").inc(5)
    m.request_energy_joules_total.labels(*base, "team-a").inc(25.0)
    rows = by_client(Samples.from_text(generate_latest(m.registry).decode()))
    a, b = rows
    assert (a.client, a.requests, a.ok, a.errors, a.aborted) == ("team-a", 4, 3, 1, 0)
    assert (a.prompt_tokens, a.cached_tokens, a.completion_tokens) == (120, 20, 50)
    assert a.energy_joules == 25.0 and a.joules_per_token == 0.5
    assert (b.client, b.requests, b.errors, b.aborted, b.completion_tokens) == (
        "team-b",
        3,
        1,
        2,
        5,
    )
    assert b.energy_joules is None and b.joules_per_token is None


def test_response_model_and_finish_reasons_from_each_engine():
    out = Outcome()
    read_response(
        {
            "model": "m",
            "choices": [{"finish_reason": "stop"}, {"finish_reason": "length"}, {"x": 1}, "bad"],
        },
        out,
    )
    assert (out.response_model, out.finish_reasons) == ("m", ("stop", "length"))
    ollama = Outcome()
    read_response({"model": "llama3", "done": True, "done_reason": "stop"}, ollama)
    assert (ollama.response_model, ollama.finish_reasons) == ("llama3", ("stop",))
    llama = Outcome()
    read_response({"model": "gguf", "stop_type": "limit"}, llama)
    assert llama.finish_reasons == ("limit",)
    hostile = Outcome()
    read_response({"model": 3, "choices": [{"finish_reason": "x" * 999}] * 100}, hostile)
    assert hostile.response_model is None
    assert len(hostile.finish_reasons) == 16 and len(hostile.finish_reasons[0]) == 256
