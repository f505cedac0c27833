"""What every engine dialect provides, and the stream taps they share.

A *tap* watches one response body as it passes through the relay. It finds event
boundaries on bytes, marks the events that carry generated output (first/last/gaps),
keeps the few events that carry usage, timings or errors for parsing at the end, and,
when the proxy injected a usage request, removes what that added before the client
sees it. It never parses an event as JSON on the way through.
"""

from __future__ import annotations

import json
import re
from bisect import bisect_left
from dataclasses import dataclass, field

from ..metrics import GAP_BUCKETS
from ..timeline import EngineTimings, Marks, Usage


@dataclass(slots=True)
class Prepared:
    """What a dialect decided about a request before it goes upstream."""

    endpoint: str  # bounded label: chat, completions, ollama_chat, ...
    model: str | None
    stream: bool
    body: bytes  # the bytes to send upstream (the client's unless usage was injected)
    strip_usage: bool = False  # the proxy asked for usage: remove it on the way back


@dataclass(slots=True)
class Outcome:
    """What the dialect read from a finished response."""

    usage: Usage = field(default_factory=Usage)
    engine: EngineTimings = field(default_factory=EngineTimings)
    error_kind: str | None = None  # midstream, truncated, protocol, upstream_status
    error_message: str | None = None
    finished: bool = False  # the response reached its normal end


class Tap:
    """Base tap: per-event bookkeeping shared by SSE and NDJSON framing.

    Subclasses implement :meth:`feed`. Marks are written straight into `marks`; gap
    counts into a bucket array handed to the metrics once per request.
    """

    __slots__ = ("marks", "gap_counts", "gap_sum", "_last_out", "done", "error_payload",
                 "usage_payload", "timings_payload", "finish_seen", "_buf")

    def __init__(self, marks: Marks) -> None:
        self.marks = marks
        self.gap_counts = [0] * (len(GAP_BUCKETS) + 1)
        self.gap_sum = 0.0
        self._last_out = 0.0
        self.done = False  # saw the stream's terminator; without it the relay appends
        # the dialect's stream_error() and the request counts as an error (truncated)
        self.error_payload: bytes | None = None
        self.usage_payload: bytes | None = None
        self.timings_payload: bytes | None = None
        self.finish_seen = False
        self._buf = b""

    def _output(self, now: float) -> None:
        """An event carrying generated output passed at `now`."""
        m = self.marks
        if m.t_first is None:
            m.t_first = now
        else:
            gap = now - self._last_out
            self.gap_counts[bisect_left(GAP_BUCKETS, gap)] += 1
            self.gap_sum += gap
        self._last_out = now
        m.t_last = now
        m.output_events += 1

    def feed(self, chunk: bytes, now: float) -> bytes:  # pragma: no cover - abstract
        raise NotImplementedError

    def flush(self) -> bytes:
        """Bytes still held back when the upstream ends, to forward as they are. A tap
        that only inspects has forwarded everything already and returns nothing."""
        self._buf = b""
        return b""


def loads(payload: bytes | None):
    """Parse a kept event payload; None when absent or not JSON (never raises)."""
    if not payload:
        return None
    try:
        return json.loads(payload)
    except (ValueError, UnicodeDecodeError, RecursionError):
        return None


def error_message(obj) -> str:
    """A short message from an engine's error object, whatever its shape."""
    if isinstance(obj, dict):
        err = obj.get("error", obj)
        if isinstance(err, dict):
            return str(err.get("message") or err.get("type") or err)[:300]
        return str(err)[:300]
    return "upstream error"


def settle(tap: Tap, out: Outcome, terminator: str) -> Outcome:
    """How a stream ended, from what its tap saw: an error event, no terminator (the
    engine cut it short: named in the message), or a normal end."""
    if tap.error_payload is not None:
        out.error_kind = "midstream"
        out.error_message = error_message(loads(tap.error_payload))
    elif not tap.done:
        out.error_kind = "truncated"
        out.error_message = f"stream ended without {terminator}"
    else:
        out.finished = True
    return out


def as_int(value) -> int | None:
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return None


#: An event carrying generated output: non-empty text, reasoning or a tool-call delta, or
#: a finish reason (the finish event carries the last token). Tolerates spaced JSON.
OUTPUT_RE = re.compile(
    rb'"(?:content|text|reasoning_content|reasoning)":\s*"(?!")|"tool_calls":\s*\[\s*\{'
    rb'|"finish_reason":\s*"')
FINISH_RE = re.compile(rb'"finish_reason":\s*"')
USAGE_RE = re.compile(rb'"usage":\s*\{')
EMPTY_CHOICES_RE = re.compile(rb'"choices":\s*\[\s*\]')


# Per-event checks with the same answers as the patterns above, cheaper on the events
# that dominate a stream (a token delta, "finish_reason":null, no usage): a substring
# find decides those, the pattern runs only on the few events it cannot decide.

_CONTENT, _TEXT, _FINISH_KEY, _USAGE_KEY = b'"content":"', b'"text":"', b'"finish_reason":', b'"usage":'


def is_output(payload: bytes) -> bool:
    """``OUTPUT_RE.search(payload) is not None``, fast for compact token deltas."""
    i = payload.find(_CONTENT)
    if i >= 0 and payload[i + 11:i + 12] != b'"':
        return True
    i = payload.find(_TEXT)
    if i >= 0 and payload[i + 8:i + 9] != b'"':
        return True
    return OUTPUT_RE.search(payload) is not None


def is_finish(payload: bytes) -> bool:
    """``FINISH_RE.search(payload) is not None``, fast for one ``"finish_reason":null``."""
    i = payload.find(_FINISH_KEY)
    if i < 0:
        return False
    if payload[i + 16:i + 20] == b"null" and payload.find(_FINISH_KEY, i + 16) < 0:
        return False
    return FINISH_RE.search(payload) is not None


def has_usage(payload: bytes) -> bool:
    """``USAGE_RE.search(payload) is not None``, fast when there is no usage key."""
    return _USAGE_KEY in payload and USAGE_RE.search(payload) is not None
