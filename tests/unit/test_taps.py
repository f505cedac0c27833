"""The SSE tap on real vLLM bytes: marks, usage, errors, and exact stripping for any split."""

from __future__ import annotations

import json
from pathlib import Path

from hypothesis import given, settings
from hypothesis import strategies as st

from proxy.engines.base import Prepared
from proxy.engines.sglang import GENERATE, SGLangDialect
from proxy.engines.sse import SSETap
from proxy.engines.trtllm import TRTLLMDialect
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


# --- SGLang and TensorRT-LLM, on their source-derived bytes (tests/fixtures/wire/*/README.md) --

SGLANG = Path(__file__).parents[1] / "fixtures" / "wire" / "sglang"
TRTLLM = Path(__file__).parents[1] / "fixtures" / "wire" / "trtllm"


def _sglang(name: str, cuts: list[int] | None = None, strip: bool = False):
    data = (SGLANG / name).read_bytes()
    dialect = SGLangDialect()
    endpoint = GENERATE if name.startswith("generate") else "chat"
    prepared = Prepared(endpoint, None, True, b"", strip_usage=strip)
    marks = Marks(t_recv=0.0)
    tap = dialect.tap("text/event-stream; charset=utf-8", marks, prepared)
    out = run(tap, splits(data, cuts or []))
    return data, out, marks, dialect.outcome(tap, None, 200)


def _tokens(data: bytes) -> int:
    """Content chunks (the role chunk's empty content is none)."""
    return sum(1 for e in events(data) if b'"content":"' in e and b'"content":""' not in e)


@settings(max_examples=60, deadline=None)
@given(cuts=st.lists(st.integers(min_value=0, max_value=5000), max_size=8))
def test_sglang_chat_any_split(cuts):
    data, out, marks, outcome = _sglang("chat-stream-usage.sse", cuts)
    assert out == data  # the client asked for usage: nothing changes
    assert outcome.finished and outcome.error_kind is None
    assert outcome.usage.completion_tokens == 6 and outcome.usage.prompt_tokens == 6
    # each content chunk, and the finish reason's own chunk (the last token's end)
    assert marks.output_events == _tokens(data) + 1
    assert outcome.finish_reasons == ("length",)


def test_sglang_injected_usage_is_stripped_exactly():
    plain = (SGLANG / "chat-stream.sse").read_bytes()
    with_usage = (SGLANG / "chat-stream-usage.sse").read_bytes()
    _, out, _, outcome = _sglang("chat-stream-usage.sse", strip=True)
    assert out == plain != with_usage
    assert outcome.usage.completion_tokens == 6


def test_sglang_continuous_usage_is_the_last_not_the_sum():
    data, out, _, outcome = _sglang("chat-stream-continuous-usage.sse", [17, 900, 2000])
    assert out == data
    assert data.count(b'"completion_tokens":') == 8  # the usage so far on every chunk
    assert outcome.usage.completion_tokens == 6 and outcome.usage.prompt_tokens == 6


def test_sglang_sglext_passes_and_counts_as_a_plain_finish():
    data, out, marks, outcome = _sglang("chat-stream-sglext.sse", [1, 333])
    assert out == data and b'"sglext":{' in data
    assert outcome.finished and outcome.usage.completion_tokens is None  # none was asked
    assert marks.output_events == _tokens(data) + 1


def test_sglang_abort_is_an_error_and_relayed_as_is():
    data, out, marks, outcome = _sglang("chat-stream-abort.sse", [50, 51, 700])
    assert out == data
    assert not outcome.finished and outcome.error_kind == "midstream"
    assert "abort" in (outcome.error_message or "")
    assert outcome.finish_reasons == ("abort",)
    assert outcome.usage.completion_tokens == 2


def test_sglang_in_stream_error_is_midstream():
    data, out, marks, outcome = _sglang("chat-stream-midstream-error.sse", [9])
    assert out == data
    assert outcome.error_kind == "midstream" and "context length" in outcome.error_message
    assert marks.t_first is None  # no token came


@settings(max_examples=60, deadline=None)
@given(cuts=st.lists(st.integers(min_value=0, max_value=1200), max_size=6))
def test_sglang_native_generate_any_split(cuts):
    data, out, marks, outcome = _sglang("generate-stream.sse", cuts)
    assert out == data
    assert outcome.finished and outcome.error_kind is None
    assert (outcome.usage.prompt_tokens, outcome.usage.completion_tokens) == (2, 4)
    assert outcome.usage.cached_tokens == 0
    assert marks.output_events == 4 and outcome.finish_reasons == ("length",)


def test_sglang_native_generate_whole_and_batch_bodies():
    dialect = SGLangDialect()
    one = {
        "text": "x",
        "meta_info": {"prompt_tokens": 3, "completion_tokens": 5, "cached_tokens": 1},
    }
    out = dialect.outcome(None, json.dumps(one).encode(), 200)
    assert out.finished and (out.usage.prompt_tokens, out.usage.completion_tokens) == (3, 5)
    batch = json.dumps([one, one]).encode()
    out = dialect.outcome(None, batch, 200)
    assert (out.usage.prompt_tokens, out.usage.completion_tokens, out.usage.cached_tokens) == (
        6,
        10,
        2,
    )
    # /v1/rerank answers a list of scores (meta_info null): finished, nothing generated
    rerank = b'[{"score":0.9,"document":"a","index":0,"meta_info":null}]'
    out = dialect.outcome(None, rerank, 200)
    assert out.finished and out.error_kind is None and out.usage.completion_tokens is None
    lie = {"text": "x", "meta_info": {"prompt_tokens": -4, "completion_tokens": "many"}}
    out = dialect.outcome(None, json.dumps(lie).encode(), 200)
    assert out.usage.completion_tokens == 0 and set(out.dropped) == {
        "prompt_tokens",
        "completion_tokens",
    }


def test_sglang_native_generate_cut_short_is_truncated():
    data = (SGLANG / "generate-stream.sse").read_bytes()
    cut = data[: data.rfind(b"data: [DONE]")]
    marks = Marks(t_recv=0.0)
    dialect = SGLangDialect()
    tap = dialect.tap("text/event-stream", marks, Prepared(GENERATE, None, True, b""))
    run(tap, [cut])
    out = dialect.outcome(tap, None, 200)
    assert out.error_kind == "truncated" and out.usage.completion_tokens == 4


@settings(max_examples=60, deadline=None)
@given(cuts=st.lists(st.integers(min_value=0, max_value=3000), max_size=8))
def test_trtllm_chat_any_split(cuts):
    dialect = TRTLLMDialect()
    for name, usage in (("chat-stream-usage.sse", 6), ("chat-stream-continuous-usage.sse", 6)):
        data = (TRTLLM / name).read_bytes()
        marks = Marks(t_recv=0.0)
        tap = dialect.tap("text/event-stream", marks, Prepared("chat", None, True, b""))
        assert run(tap, splits(data, cuts)) == data
        out = dialect.outcome(tap, None, 200)
        assert out.finished and out.usage.completion_tokens == usage
        assert marks.output_events == 6  # the finish rides on the last token
    plain = (TRTLLM / "chat-stream.sse").read_bytes()
    marks = Marks(t_recv=0.0)
    tap = dialect.tap(
        "text/event-stream", marks, Prepared("chat", None, True, b"", strip_usage=True)
    )
    assert run(tap, splits((TRTLLM / "chat-stream-usage.sse").read_bytes(), cuts)) == plain


@settings(max_examples=200, deadline=None)
@given(
    data=st.one_of(
        st.binary(max_size=2000),
        st.lists(
            st.sampled_from(
                [
                    b'data: {"text":"a","meta_info":{"completion_tokens":1}}\n\n',
                    b'data: {"text":"ab","meta_info":{"completion_tokens":"x","prompt_tokens":-1}}\n\n',
                    b'data: {"meta_info":[]}\n\n',
                    b'data: {"meta_info":{"finish_reason":{"type":7}}}\n\n',
                    b'data: {"error": {"message": "boom"}}\n\n',
                    b"data: [DONE]\n\n",
                    b": ping\n\n",
                    b"data: {\n\n",
                    b"\r\n\r\n",
                ]
            ),
            max_size=12,
        ).map(b"".join),
    ),
    cuts=st.lists(st.integers(min_value=0, max_value=2000), max_size=6),
)
def test_sglang_native_garbage_never_crashes_and_is_relayed_whole(data, cuts):
    """A hostile /generate stream: every byte forwarded, the outcome read without raising,
    no implausible count kept."""
    dialect = SGLangDialect()
    tap = dialect.tap("text/event-stream", Marks(t_recv=0.0), Prepared(GENERATE, None, True, b""))
    assert run(tap, splits(data, cuts)) == data
    out = dialect.outcome(tap, None, 200)
    for count in (out.usage.prompt_tokens, out.usage.completion_tokens):
        assert count is None or count >= 0
