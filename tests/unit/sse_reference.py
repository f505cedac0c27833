"""The Python reference of proxy.engines.token_read (``_sse.c``): the answers the C code
must give, question by question, for tests/unit/test_token_read.py to hold it to on any
input. Not shipped: production runs the C code alone."""

from __future__ import annotations

#: Not plain token events: the tap's general path decides what the read holds.
GENERAL = -1
#: One plain token event that only the output pattern can tell about (an empty
#: content, a tool call, reasoning, spaced JSON). A count n >= 1 means n plain token
#: events, each carrying output (a non-empty "content" or "text").
PATTERN = -2

_FINISH_KEY = b'"finish_reason":'


def event_kind(ev: bytes) -> int:
    """1 (output), PATTERN or GENERAL for one single-line event, its terminator in."""
    if ev[:8] != b'data: {"' or ev[8:14] == b'error"':
        return GENERAL
    if ev.find(b'"usage":') >= 0:
        return GENERAL
    i = ev.find(_FINISH_KEY)
    if i >= 0 and (ev[i + 16 : i + 20] != b"null" or ev.find(_FINISH_KEY, i + 16) >= 0):
        return GENERAL
    i = ev.find(b'"content":"')
    if i >= 0 and ev[i + 11 : i + 12] != b'"':
        return 1
    i = ev.find(b'"text":"')
    if i >= 0 and ev[i + 8 : i + 9] != b'"':
        return 1
    return PATTERN


def token_kind(chunk: bytes) -> int:
    """n >= 1 (that many plain token events, each with output), PATTERN (one plain event
    the output pattern must look at) or GENERAL (see the module)."""
    if chunk[-2:] != b"\n\n" or chunk.find(b"\r") >= 0:
        return GENERAL
    if chunk.find(b"\n") == len(chunk) - 2:  # one event, how engines write them at pace
        return event_kind(chunk)
    events = chunk[:-2].split(b"\n\n")
    if any(ev.find(b"\n") >= 0 for ev in events):
        return GENERAL  # a line that does not end its event
    if len(events) == 1:
        return event_kind(chunk)
    for ev in events:
        if event_kind(ev + b"\n\n") != 1:
            return GENERAL
    return len(events)


def token_runs(chunk: bytes) -> tuple[int, int, int, int]:
    """``(lead, lead_end, tail, tail_start)``: the plain token events (each with output)
    that begin a read, and where they end; those that end it, and where they begin (a
    read that ends inside an event has none). Events are found as the tap's framer
    finds them in LF-only bytes, at each next blank line; a read with a CR has no runs.
    Why: at full speed a read holds many events, of which the first (the role) or the
    last few (the finish reason, usage, ``[DONE]``) need the tap's general path; the
    token events around them need only counting."""
    n = len(chunk)
    lead = lead_end = tail = 0
    tail_start = n
    if chunk.find(b"\r") >= 0:
        return lead, lead_end, tail, tail_start
    leading = True
    pos = 0
    while (i := chunk.find(b"\n\n", pos)) >= 0:
        end = i + 2
        ev = chunk[pos:end]
        plain = ev.find(b"\n") == len(ev) - 2 and event_kind(ev) == 1
        if plain and leading:
            lead += 1
            lead_end = end
        elif plain:
            if tail == 0:
                tail_start = pos
            tail += 1
        else:
            leading = False
            tail, tail_start = 0, n
        pos = end
    if pos < n:  # no trailing run before an unfinished event
        tail, tail_start = 0, n
    return lead, lead_end, tail, tail_start
