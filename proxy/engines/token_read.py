"""What one read of a streamed answer is, asked once: plain token events or not.

An engine writes one event per read at pace, a few at full speed, nearly all of them
token deltas. The SSE tap asks each read the same questions (whole single-line LF-only
events? each ``data: {"`` and not an error? no usage key? no finish reason but one
``null``? output, by substring?) and forwards a read of plain token events as it came.
:func:`token_kind` answers them all in one call: ``n >= 1`` (that many plain token events,
each with output), :data:`PATTERN` (one plain event that only its payload can tell about)
or :data:`GENERAL` (anything else: the tap's per-event path decides). :func:`token_runs`
finds the plain token events that begin and end a read that mixes them, as
``(lead, lead_end, tail, tail_start)``. Every other event is told by its payload
(``SSETap._examine``).

Both are compiled (``_sse.c``, built by every install: setup.py, the container image's
build stage). Why C: at full speed a read holds dozens of events, and asked in Python each
costs about a microsecond of searches and slices, which doubled the proxy's CPU per event
there. tests/unit/sse_reference.py holds their answers, in Python, to test them by.
"""

from __future__ import annotations

from ._sse import token_kind, token_runs

#: Not plain token events: the tap's general path decides what the read holds.
GENERAL = -1
#: One plain token event that only its payload can tell about (an empty content, a tool
#: call, reasoning, spaced JSON).
PATTERN = -2

__all__ = ["GENERAL", "PATTERN", "token_kind", "token_runs"]
