"""The SSE tap's once-per-read classification (issue 26) answers exactly as event by event.

The tap asks a read of plain token deltas once whether anything in it can finish a choice,
carry usage, end the stream or be an error; only then does it skip those questions per
event. Whatever the events and however the reads cut them, what it forwards and what it
measures must be what the per-event path (``Tap.feed``: split, then every event) gives.
"""

from __future__ import annotations

from hypothesis import example, given, settings
from hypothesis import strategies as st

from proxy.engines.base import Tap
from proxy.engines.sse import SSETap
from proxy.engines.vllm import VLLMDialect
from proxy.measure.timeline import Marks

from ..support.streams import splits

_HEAD = b'{"id":"c1","object":"chat.completion.chunk","model":"m","choices":['

#: Events of every kind the tap tells apart, in the spellings engines use.
EVENTS = [
    b"data: "
    + _HEAD
    + b'{"index":0,"delta":{"role":"assistant","content":""},"finish_reason":null}]}',
    b"data: "
    + _HEAD
    + b'{"index":0,"delta":{"content":" tok"},"logprobs":null,"finish_reason":null}]}',
    b"data: " + _HEAD + b'{"index":0,"delta":{"content":""},"finish_reason":null}]}',
    b"data: " + _HEAD + b'{"index":0,"text":" t","finish_reason":null}]}',
    b"data: " + _HEAD + b'{"index":0,"delta":{"reasoning_content":"hm"},"finish_reason":null}]}',
    b"data: " + _HEAD + b'{"index":0,"delta":{"tool_calls":[{"index":0}]},"finish_reason":null}]}',
    b"data: " + _HEAD + b'{"index":0,"delta":{"content":" end"},"finish_reason":"length"}]}',
    b"data: " + _HEAD + b'{"index":0,"delta":{"content": "x"},"finish_reason": "stop"}]}',
    b"data: " + _HEAD + b'{"index":0,"delta":{},"finish_reason":null},'
    b'{"index":1,"delta":{},"finish_reason":"stop"}]}',
    b"data: " + _HEAD + b'],"usage":{"prompt_tokens":3,"completion_tokens":4,"total_tokens":7},'
    b'"system_fingerprint":"fp"}',
    b"data: " + _HEAD + b'{"index":0,"delta":{"content":"u"},"finish_reason":null}],'
    b'"usage":{"prompt_tokens":3,"completion_tokens":1,"total_tokens":4}}',
    b'data: {"error":{"message":"boom","type":"internal"}}',
    b'data: { "error": "spaced"}',
    b"data: [DONE]",
    b"data:[DONE]",
    b"data:  " + _HEAD + b'{"index":0,"delta":{"content":"two spaces"},"finish_reason":null}]}',
    b": keep-alive",
    b"id: 7\ndata: " + _HEAD + b'{"index":0,"delta":{"content":"id"},"finish_reason":null}]}',
    b'event: x\ndata: {"content":"[DONE]"}',
    b'data: {"content":"\\"usage\\":"}',
    b"retry: 10",
]

TERMINATORS = [b"\n\n", b"\r\n\r\n", b"\n\r\n"]


class PerEvent(SSETap):
    """The per-event path the once-per-read one must agree with: every event asked its
    questions one by one, in Python (no read or event told at once by ``token_kind``)."""

    __slots__ = ()

    def feed(self, chunk: bytes, now: float) -> bytes:
        return Tap.feed(self, chunk, now)

    _classify = SSETap._examine
    _event = SSETap._examine  # type: ignore[assignment]


def _state(tap: SSETap) -> tuple:
    m = tap.marks
    return (
        m.t_first,
        m.t_last,
        m.output_events,
        tuple(tap.gap_counts),
        tap.gap_sum,
        tap.done,
        tap.error_payload,
        tap.usage_payload,
        tap.finish_seen,
        tap.finish_payload,
        tap.oversized,
    )


def _run(tap: SSETap, reads: list[bytes], how: str) -> tuple[bytes, tuple]:
    out = [tap.feed(r, 100.0 + i * 0.01) for i, r in enumerate(reads)]
    out.append(tap.flush() if how == "flush" else tap.end(200.0))
    return b"".join(out), _state(tap)


@settings(max_examples=400, deadline=None)
@given(
    st.lists(st.tuples(st.integers(0, len(EVENTS) - 1), st.sampled_from(TERMINATORS)), max_size=30),
    st.lists(st.integers(min_value=0, max_value=5000), max_size=12),
    st.booleans(),
    st.booleans(),
    st.sampled_from(["flush", "end"]),
    st.sampled_from([1 << 20, 120]),
)
def test_once_per_read_equals_per_event(picks, cuts, by_event, strip, how, limit):
    events = [EVENTS[i] + end for i, end in picks]
    data = b"".join(events)
    # reads of whole events (one or several, as engines write them) or cut anywhere
    reads = [b"".join(events[i : i + 3]) for i in range(0, len(events), 3)]
    reads = events if by_event and not cuts else (reads if not cuts else splits(data, cuts))
    fast = SSETap(Marks(t_recv=0.0), strip=strip, limit=limit)
    slow = PerEvent(Marks(t_recv=0.0), strip=strip, limit=limit)
    assert _run(fast, reads, how) == _run(slow, reads, how)
    if not strip:
        assert _run(SSETap(Marks(t_recv=0.0), limit=limit), reads, "flush")[0] == data
    assert VLLMDialect().outcome(fast, None, 200) == VLLMDialect().outcome(slow, None, 200)


class Counting(SSETap):
    """Counts the events classified one by one."""

    __slots__ = ("classified",)

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.classified = 0

    def _classify(self, ev: bytes, now: float) -> int:
        self.classified += 1
        return super()._classify(ev, now)

    _event = _classify


def test_a_read_of_token_deltas_is_classified_once():
    """A read of plain token deltas goes through without the per-event classification,
    forwarded as the very bytes it came in, its output events counted."""
    token = EVENTS[1] + b"\n\n"
    for strip in (False, True):
        tap = Counting(Marks(t_recv=0.0), strip=strip)
        for read in (token, token * 4):
            assert tap.feed(read, 100.0) is read
        assert tap.classified == 0
        assert tap.marks.output_events == 5
        assert tap.gap_counts[0] == 4  # the events of one read arrive together
        last = EVENTS[6] + b"\n\n"  # a finish reason: classified, and held while stripping
        assert tap.feed(last, 100.5) == (b"" if strip else last)
        assert tap.classified == 1 and tap.finish_seen


_LF_EVENTS = [ev for ev in EVENTS if b"\n" not in ev]


@settings(max_examples=400, deadline=None)
@given(
    st.lists(st.integers(0, len(_LF_EVENTS) - 1), max_size=4),
    st.integers(0, 6),
    st.integers(0, 6),
    st.integers(0, 2),
    st.booleans(),
    st.lists(st.integers(min_value=0, max_value=3000), max_size=3),
)
def test_a_read_of_token_events_around_others_equals_per_event(
    picks, before, after, reads_of, strip, cuts
):
    """How a full-speed stream reads: token deltas around the role event, a finish
    reason, usage, ``[DONE]`` (in LF-only SSE, where the token runs are counted at once),
    cut anywhere or not: forwarded and measured as event by event."""
    token = EVENTS[1] + b"\n\n"
    middle = b"".join(_LF_EVENTS[i] + b"\n\n" for i in picks)
    read = token * before + middle + token * after
    reads = [read] * (reads_of + 1)
    if cuts:
        reads = splits(b"".join(reads), cuts)
    fast = SSETap(Marks(t_recv=0.0), strip=strip)
    slow = PerEvent(Marks(t_recv=0.0), strip=strip)
    assert _run(fast, reads, "end") == _run(slow, reads, "end")


def test_the_token_events_around_a_role_event_are_not_looked_at_one_by_one():
    token = EVENTS[1] + b"\n\n"
    role, finish = EVENTS[0] + b"\n\n", EVENTS[6] + b"\n\n"
    for strip in (False, True):
        tap = Counting(Marks(t_recv=0.0), strip=strip)
        first = role + token * 5
        assert tap.feed(first, 100.0) is first  # forwarded as it came
        assert tap.classified == 1 and tap.marks.output_events == 5  # the role event alone
        last = token * 3 + finish + b"data: [DONE]\n\n"
        out = tap.feed(last, 100.5)
        assert tap.classified == 3  # and the finish event and [DONE], not the tokens
        assert tap.marks.output_events == 9 and tap.done
        assert out == (token * 3 if strip else last)  # the finish waits for usage when stripping


class Shortcut(SSETap):
    """The relay pipe's way through the tap: each read (one that came as one chunk)
    offered to ``token_read`` first (forwarded as it came when it says yes), to ``feed``
    otherwise."""

    __slots__ = ("shortcuts",)

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.shortcuts = 0

    def feed(self, chunk: bytes, now: float) -> bytes:
        if self.token_read(chunk, now):
            self.shortcuts += 1
            return chunk
        return super().feed(chunk, now)


@settings(max_examples=400, deadline=None)
@example(picks=[(6, b"\n\n"), (1, b"\n\n")], cuts=[], strip=True, rewrite=False, limit=1 << 20)
@given(
    st.lists(st.tuples(st.integers(0, len(EVENTS) - 1), st.sampled_from(TERMINATORS)), max_size=30),
    st.lists(st.integers(min_value=0, max_value=5000), max_size=6),
    st.booleans(),
    st.booleans(),
    st.sampled_from([1 << 20, 120]),
)
def test_the_paced_read_shortcut_forwards_and_measures_as_feed(picks, cuts, strip, rewrite, limit):
    """``SSETap.token_read`` (the relay pipe's one call per paced event) takes only a read
    that ``feed`` forwards as it came, and counts it as ``feed`` does: reads one event
    each or cut anywhere, stripping or not, with a rewrite (Ollama's) or not, events
    held or passed through oversized before it."""
    events = [EVENTS[i] + end for i, end in picks]
    reads = splits(b"".join(events), cuts) if cuts else events
    short = Shortcut(Marks(t_recv=0.0), strip=strip, limit=limit)
    plain = SSETap(Marks(t_recv=0.0), strip=strip, limit=limit)
    if rewrite:
        short.rewrite = plain.rewrite = lambda ev: ev.replace(b"tok", b"TOK")
    assert _run(short, reads, "end") == _run(plain, reads, "end")
    if rewrite:
        assert short.shortcuts == 0


def test_the_paced_read_shortcut_takes_a_lone_token_event_only():
    token = EVENTS[1] + b"\n\n"
    tap = SSETap(Marks(t_recv=0.0))
    assert tap.token_read(token, 100.0) and tap.token_read(token, 100.02)
    assert tap.marks.output_events == 2 and tap.marks.t_first == 100.0
    assert tap.marks.t_last == 100.02 and abs(tap.gap_sum - 0.02) < 1e-9
    for other in (token * 2, EVENTS[0] + b"\n\n", EVENTS[6] + b"\n\n", b"data: [DONE]\n\n"):
        assert not tap.token_read(other, 101.0)
    assert tap.marks.output_events == 2  # a refused read is not counted
    assert tap.feed(token[:40], 101.0) == b""  # half an event held by the framer:
    assert not tap.token_read(token, 101.0)  # the next read must join it, not pass alone
    assert tap.marks.output_events == 2
    # a finish event held while stripping (until the usage event): a token read after it
    # waits behind it too, as feed holds it
    stripping = SSETap(Marks(t_recv=0.0), strip=True)
    assert stripping.feed(EVENTS[6] + b"\n\n", 100.0) == b""
    assert not stripping.token_read(token, 100.02)
    assert stripping.marks.output_events == 1
