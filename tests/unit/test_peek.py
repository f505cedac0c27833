"""A large request body's reduction (proxy.core.peek) reads as the body itself does for
everything routing and ``prepare`` look at: the model, the affinity prefix, the flags.
Random JSON bodies, made large by long strings and long lists, each compared with a
plain ``json.loads`` of the whole body."""

from __future__ import annotations

import asyncio
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from proxy.core import peek
from proxy.core.routing import peek_model
from proxy.engines.openai import OpenAIDialect
from proxy.fleet.balance import prefix_key

scalars = st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text()
values = st.recursive(
    scalars,
    lambda inner: st.lists(inner, max_size=6) | st.dictionaries(st.text(max_size=8), inner),
    max_leaves=30,
)
big_text = st.builds(
    lambda piece, n: piece * n,
    st.text(min_size=1, max_size=12),
    st.integers(min_value=20_000, max_value=120_000),
)
message = st.fixed_dictionaries(
    {"role": st.sampled_from(["user", "system", "assistant"]), "content": st.text() | big_text}
)
bodies = st.fixed_dictionaries(
    {"messages": st.lists(message, min_size=1, max_size=5), "model": st.text(max_size=40)},
    optional={
        "stream": st.booleans(),
        "tools": st.lists(values, max_size=5),
        "stream_options": st.dictionaries(st.sampled_from(["include_usage", "x"]), values),
        "padding": st.lists(st.integers(), min_size=0, max_size=30_000),
    },
)


def reduce(body: bytes) -> bytes:
    return asyncio.run(peek.reduced(body))


@pytest.fixture(autouse=True)
def small_large(monkeypatch):
    monkeypatch.setattr(peek, "LARGE", 0)  # every body is reduced


@settings(max_examples=60, deadline=None)
@given(bodies, st.booleans())
def test_a_reduction_reads_as_the_whole_body(obj, ascii_only):
    body = json.dumps(obj, ensure_ascii=ascii_only).encode()
    view = reduce(body)
    assert len(view) <= max(len(body), peek.MOST)
    assert peek_model(view) == peek_model(body) == obj["model"]
    assert prefix_key(view) == prefix_key(body)
    d = OpenAIDialect()
    whole = d.prepare("chat", body, True)
    part = d.prepare("chat", body, True, view)
    assert whole is not None and part is not None
    assert (part.model, part.stream) == (whole.model, whole.stream)
    if part.strip_usage or "stream_options" not in obj:
        sent = bytes(part.body) + part.tail
        assert (sent, part.strip_usage) == (bytes(whole.body) + whole.tail, whole.strip_usage)
        if part.strip_usage:
            assert json.loads(sent) == {**obj, "stream_options": {"include_usage": True}}


@pytest.mark.parametrize(
    "body",
    [b'{"a":', b'{"a":1}x', b"[1,2", b'"str"', b'{"a":tru}', b"12", b'{"a":"x\\', b"{" * 300],
)
def test_what_is_not_a_json_object_reduces_to_nothing_readable(body):
    view = reduce(body)
    try:
        obj = json.loads(view)
    except ValueError:
        return
    assert not isinstance(obj, dict) or obj == json.loads(body)


def test_a_reduction_is_bounded_and_yields():
    body = json.dumps(
        {"messages": [{"role": "user", "content": f"q{i}"} for i in range(200_000)], "model": "m"}
    ).encode()
    r = peek._Reducer(body)
    steps = 1
    while not r.step():
        steps += 1
    assert steps > 10  # it went back to the loop many times
    assert json.loads(r.result())["model"] == "m" and len(r.result()) < 2 * peek.KEEP
    top = b'{"model":"m",' + b",".join(b'"k%d":0' % i for i in range(600_000)) + b"}"
    assert reduce(top) == b""  # a reduction that would be large: unreadable


@pytest.mark.parametrize("trailing", [b"", b" \n"])
def test_usage_is_added_to_a_large_body_without_copying_it(trailing):
    """A copy of a body of many MiB would hold the event loop: the prepared body is a view
    of the client's own bytes and the added field is a tail written after it."""
    obj = {"model": "m", "messages": [{"role": "user", "content": "x" * (8 << 20)}]}
    body = json.dumps({**obj, "stream": True}).encode() + trailing
    prepared = OpenAIDialect().prepare("chat", body, True, reduce(body))
    assert prepared is not None and prepared.strip_usage
    assert isinstance(prepared.body, memoryview) and prepared.body.obj is body
    assert len(prepared.tail) < 64
    sent = json.loads(bytes(prepared.body) + prepared.tail)
    assert sent == {**obj, "stream": True, "stream_options": {"include_usage": True}}
