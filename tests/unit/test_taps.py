"""The SSE tap on real vLLM bytes: marks, usage, errors, and exact stripping for any split."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from proxy.engines.sse import SSETap
from proxy.engines.vllm import VLLMDialect
from proxy.measure.timeline import Marks

from ..support.replay import VLLM_REAL, pin_ids
from ..support.streams import run, splits

WORDS = VLLM_REAL / "raw-words"
BYTES = VLLM_REAL / "raw"


def body(folder, name: str) -> bytes:
    return pin_ids((folder / f"{name}.body").read_bytes())


def events(data: bytes) -> list[bytes]:
    return [e + b"\n\n" for e in data.split(b"\n\n") if e]


def test_role_event_is_not_the_first_token():
    data = body(WORDS, "chat_stream")
    marks = Marks(t_recv=0.0)
    tap = SSETap(marks)
    run(tap, events(data))
    # event 0 is the role chunk (content ""), event 1 carries " request."
    assert marks.t_first == 100.01
    # 8 token events: the last rides on the finish chunk
    assert marks.output_events == 8
    assert marks.t_last == 100.0 + 8 * 0.01
    assert tap.done and tap.finish_seen and tap.error_payload is None


def test_empty_deltas_are_not_output():
    """Byte-level model: partial UTF-8 tokens arrive as "content":"" events."""
    data = body(BYTES, "chat_stream")
    marks = Marks(t_recv=0.0)
    tap = SSETap(marks)
    run(tap, events(data))
    # role, "", "\ufffdrefi" -> first output is the third event
    assert marks.t_first == 100.02


def test_usage_is_captured_and_parsed():
    marks = Marks(t_recv=0.0)
    tap = SSETap(marks)
    run(tap, events(body(WORDS, "chat_stream_usage")))
    out = VLLMDialect().outcome(tap, None, 200)
    assert (out.usage.prompt_tokens, out.usage.completion_tokens) == (6, 8)
    assert out.finished and out.error_kind is None


def test_continuous_usage_keeps_the_last():
    tap = SSETap(Marks(t_recv=0.0))
    run(tap, events(body(WORDS, "chat_stream_usage_continuous")))
    out = VLLMDialect().outcome(tap, None, 200)
    assert out.usage.completion_tokens == 8


def test_missing_done_is_truncated():
    data = body(WORDS, "chat_stream").replace(b"data: [DONE]\n\n", b"")
    tap = SSETap(Marks(t_recv=0.0))
    run(tap, [data])
    out = VLLMDialect().outcome(tap, None, 200)
    assert out.error_kind == "truncated" and not out.finished


def test_midstream_error_event():
    err = (
        b'data: {"error": {"object": "error", "message": "engine died", "type": '
        b'"InternalServerError", "param": null, "code": 500}}\n\ndata: [DONE]\n\n'
    )
    data = body(WORDS, "chat_stream").split(b"data: [DONE]")[0] + err
    tap = SSETap(Marks(t_recv=0.0))
    run(tap, [data])
    out = VLLMDialect().outcome(tap, None, 200)
    assert out.error_kind == "midstream" and out.error_message == "engine died"


def test_keepalive_comments_are_ignored():
    data = b": keep-alive\n\n" + body(WORDS, "chat_stream")
    marks = Marks(t_recv=0.0)
    tap = SSETap(marks)
    run(tap, events(data))
    assert marks.t_first == 100.02  # keep-alive, role, then the first token


def test_crlf_framing():
    data = body(WORDS, "chat_stream").replace(b"\n", b"\r\n")
    marks = Marks(t_recv=0.0)
    tap = SSETap(marks)
    assert run(tap, [data]) == data
    assert marks.output_events == 8 and tap.done


@settings(max_examples=150, deadline=None)
@given(
    st.lists(st.integers(min_value=0, max_value=10**6), max_size=40),
    st.sampled_from(
        [
            ("raw-words", "chat_stream"),
            ("raw", "chat_stream"),
            ("raw-words", "completions_stream"),
            ("raw", "completions_stream"),
            ("raw", "chat_stream_long_ignore_eos"),
        ]
    ),
)
def test_strip_is_exact_for_any_split(cuts, case):
    """Stripping the injected usage event gives the plain capture, however TCP splits it."""
    folder = VLLM_REAL / case[0]
    plain = body(folder, case[1])
    usage_name = case[1] + "_usage" if case[1] != "chat_stream_long_ignore_eos" else case[1]
    with_usage = body(folder, usage_name)
    tap = SSETap(Marks(t_recv=0.0), strip=True)
    out = run(tap, splits(with_usage, cuts))
    if usage_name == case[1]:  # this capture already had usage: compare by dropping it
        plain = b"".join(e for e in events(with_usage) if b'"choices":[]' not in e)
        plain = plain.replace(
            b'"finish_reason":"length","stop_reason":null,"token_ids":null}]}',
            b'"finish_reason":"length","stop_reason":null,"token_ids":null}],'
            b'"system_fingerprint":"vllm-0.32.0-94c9243e"}',
        )
    assert out == plain
    assert VLLMDialect().outcome(tap, None, 200).usage.completion_tokens is not None


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(min_value=0, max_value=10**6), max_size=40))
def test_inspect_mode_forwards_every_byte(cuts):
    data = body(BYTES, "chat_stream_usage")
    marks = Marks(t_recv=0.0)
    tap = SSETap(marks)
    assert run(tap, splits(data, cuts)) == data
    assert marks.output_events == _expected_outputs(data)


def _expected_outputs(data: bytes) -> int:
    """Events with non-empty generated text or a finish reason, by parsing every event."""
    import json

    n = 0
    for ev in events(data):
        payload = ev[len(b"data: ") :].strip()
        if payload == b"[DONE]":
            continue
        for choice in json.loads(payload)["choices"]:
            text = choice.get("delta", {}).get("content") or choice.get("text")
            if text or choice.get("finish_reason"):
                n += 1
    return n


@given(
    st.binary(max_size=2000),
    st.lists(st.integers(min_value=0, max_value=4000), max_size=20),
    st.booleans(),
)
@settings(max_examples=300, deadline=None)
def test_garbage_never_crashes_and_inspect_is_lossless(data, cuts, strip):
    tap = SSETap(Marks(t_recv=0.0), strip=strip)
    out = run(tap, splits(data, cuts))
    if not strip:
        assert out == data
    VLLMDialect().outcome(tap, None, 200)  # never raises
