"""One read asked once (proxy.engines.token_read, compiled from ``_sse.c``): for any read,
the C code gives the Python reference's answer (tests/unit/sse_reference.py), and the
answer means what the tap's per-event path (``SSETap._examine``, which tells every other
event by its payload) would conclude: plain token events are forwarded as they came,
output counted alike."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from proxy.engines.base import OUTPUT_RE, is_output
from proxy.engines.sse import _KEEP, SSETap
from proxy.engines.token_read import GENERAL, PATTERN, token_kind, token_runs
from proxy.measure.timeline import Marks

from . import sse_reference
from .test_tap_once_per_read import EVENTS, TERMINATORS

#: Fragments reads are made of: the keys and values the answer turns on, in every
#: spelling, line ends of every kind, and anything else.
_FRAGMENTS = st.one_of(
    st.sampled_from(
        [
            b"data: ",
            b"data:",
            b'data: {"',
            b"{",
            b"}",
            b'"',
            b'error"',
            b'"error":',
            b'"usage":',
            b'"usage": ',
            b'"finish_reason":',
            b'"finish_reason":null',
            b'"finish_reason":"stop"',
            b"null",
            b'"content":"',
            b'"content":""',
            b'"content": "',
            b'"text":"',
            b'"text":""',
            b'"tool_calls":[{',
            b" tok",
            b",",
            b"\n",
            b"\n\n",
            b"\r",
            b"\r\n",
            b":",
            b"[DONE]",
        ]
    ),
    st.binary(max_size=12),
)

_READS = st.lists(_FRAGMENTS, max_size=14).map(b"".join)


def _examined(read: bytes) -> list[tuple[int, SSETap]]:
    """Each whole event of `read` (LF only) told by the per-event path, on a tap of its
    own: what it returned, and the tap."""
    out = []
    for ev in _events(read):
        tap = SSETap(Marks(t_recv=0.0))
        out.append((tap._examine(ev, 1.0), tap))
    return out


def _plain(kind: int, tap: SSETap, output: bool) -> bool:
    """The per-event path kept the event as it came, kept no payload, and counted output
    as `output` says."""
    return (
        kind == _KEEP
        and not (tap.done or tap.finish_seen)
        and tap.usage_payload is tap.error_payload is None
        and tap.marks.output_events == (1 if output else 0)
    )


def _holds_to_the_per_event_path(read: bytes) -> None:
    kind = token_kind(read)
    if kind == GENERAL:
        return
    examined = _examined(read)
    if kind == PATTERN:
        assert len(examined) == 1
        ((k, tap),) = examined
        assert k == _KEEP and tap.usage_payload is tap.error_payload is None, read
        assert not (tap.done or tap.finish_seen), read
        return
    assert len(examined) == kind, read
    assert all(_plain(k, tap, output=True) for k, tap in examined), read


@settings(max_examples=3000, deadline=None)
@given(_READS)
def test_the_answer_is_the_per_event_paths(read):
    _holds_to_the_per_event_path(read)


@settings(max_examples=3000, deadline=None)
@given(_READS)
def test_the_c_code_answers_as_the_reference(read):
    assert token_kind(read) == sse_reference.token_kind(read)
    assert token_runs(read) == sse_reference.token_runs(read)


def test_the_c_code_refuses_what_is_not_bytes():
    with pytest.raises(TypeError):
        token_kind("data: {}\n\n")  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        token_runs("data: {}\n\n")  # type: ignore[arg-type]


_EVENT_SHAPED = _READS.map(lambda r: b'data: {"' + r + b"\n\n")


@settings(max_examples=1000, deadline=None)
@given(_EVENT_SHAPED)
def test_the_answer_is_the_per_event_paths_on_event_shaped_reads(read):
    assert token_kind(read) == sse_reference.token_kind(read)
    _holds_to_the_per_event_path(read)


_TOKEN = b'data: {"choices":[{"delta":{"content":" tok"},"finish_reason":null}]}\n\n'


@settings(max_examples=1000, deadline=None)
@given(st.lists(st.one_of(st.just(_TOKEN), _EVENT_SHAPED), min_size=2, max_size=5))
def test_the_answer_is_the_per_event_paths_on_reads_of_several_events(events):
    read = b"".join(events)
    assert token_kind(read) == sse_reference.token_kind(read)
    _holds_to_the_per_event_path(read)


@pytest.mark.parametrize("terminator", TERMINATORS)
@pytest.mark.parametrize("event", EVENTS)
def test_the_answer_agrees_with_the_output_pattern(event, terminator):
    """A plain token event's output is what is_output (the general path's check) says;
    anything that could finish, carry usage, fail or end the stream is not plain."""
    read = event + terminator
    kind = token_kind(read)
    if kind == GENERAL:
        return
    assert terminator == b"\n\n" and b"\n" not in event
    assert b'"usage"' not in read and b"[DONE]" not in read and b"error" not in read
    assert read.count(b'"finish_reason":') == read.count(b'"finish_reason":null') <= 1
    if kind == 1:
        assert is_output(read)
    else:
        assert kind == PATTERN
        assert is_output(read) == (OUTPUT_RE.search(read) is not None)


def test_plain_token_events_are_taken_in_one_call():
    token = _TOKEN
    role = b'data: {"choices":[{"delta":{"role":"assistant","content":""}}]}\n\n'
    finish = token.replace(b"null", b'"stop"')
    assert token_kind(token) == 1
    assert token_kind(role) == PATTERN
    assert token_kind(token * 3) == 3  # a read of several token events, each with output
    assert token_kind(role + token) == GENERAL  # one the pattern must look at: general
    assert token_kind(token + finish) == token_kind(finish) == GENERAL
    assert token_kind(token + b"data: [DONE]\n\n") == GENERAL
    assert token_kind(token + token[:20]) == GENERAL  # an unfinished event
    assert token_kind(token.replace(b"\n\n", b"\ndata: x\n\n")) == GENERAL  # two lines


# --- token_runs: the token events around the others in a read ------------------------------


def _events(read: bytes) -> list[bytes]:
    """The read's whole events as the tap's framer finds them (LF only), and the rest."""
    out, pos = [], 0
    while (i := read.find(b"\n\n", pos)) >= 0:
        out.append(read[pos : i + 2])
        pos = i + 2
    return out + ([read[pos:]] if pos < len(read) else [])


@settings(max_examples=3000, deadline=None)
@given(st.lists(st.one_of(st.just(_TOKEN), _EVENT_SHAPED, _READS), min_size=1, max_size=8))
def test_the_runs_are_the_plain_token_events_at_either_end(parts):
    """Event by event (token_kind on each): the leading run is the plain events before the
    first other one; the trailing run the plain events after the last other one, when
    the read ends with a whole event; a read with a CR has none."""
    read = b"".join(parts)
    lead, lead_end, tail, tail_start = token_runs(read)
    assert (lead, lead_end, tail, tail_start) == sse_reference.token_runs(read)
    if b"\r" in read:
        assert (lead, lead_end, tail, tail_start) == (0, 0, 0, len(read))
        return
    events = _events(read)
    plain = [ev.endswith(b"\n\n") and token_kind(ev) == 1 for ev in events]
    first_other = plain.index(False) if False in plain else len(plain)
    assert lead == first_other
    assert lead_end == sum(len(ev) for ev in events[:lead])
    if lead == len(events) or not read.endswith(b"\n\n"):
        assert (tail, tail_start) == (0, len(read))
        return
    last_other = len(plain) - 1 - plain[::-1].index(False)
    assert tail == len(plain) - 1 - last_other
    assert tail_start == (
        len(read) - sum(len(ev) for ev in events[last_other + 1 :]) if tail else len(read)
    )


def test_the_runs_around_a_role_event_and_a_stream_end():
    role = b'data: {"choices":[{"delta":{"role":"assistant","content":""}}]}\n\n'
    finish = _TOKEN.replace(b"null", b'"stop"')
    done = b"data: [DONE]\n\n"
    first = role + _TOKEN * 3
    assert token_runs(first) == (0, 0, 3, len(role))
    last = _TOKEN * 2 + finish + done
    assert token_runs(last) == (2, 2 * len(_TOKEN), 0, len(last))
    cut = _TOKEN * 2 + _TOKEN[:10]  # an unfinished event: no trailing run
    assert token_runs(cut) == (2, 2 * len(_TOKEN), 0, len(cut))
    both = _TOKEN + done + _TOKEN
    assert token_runs(both) == (1, len(_TOKEN), 1, len(_TOKEN) + len(done))
    assert token_runs(_TOKEN.replace(b"\n\n", b"\r\n\r\n") * 2) == (0, 0, 0, 2 * len(_TOKEN) + 4)
