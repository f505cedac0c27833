"""Server-sent events as OpenAI-compatible engines send them, tapped on bytes.

``data: <json>`` events separated by a blank line, ``data: [DONE]`` at the end, ``:``
comments (keep-alives) at any time, ``data: {"error": ...}`` when an engine fails
mid-stream. The tap finds the events that carry output without parsing JSON, keeps the
usage event's payload, and, when the proxy asked for usage the client did not, removes
what that added (see :class:`SSETap`).
"""

from __future__ import annotations

import re
from collections.abc import Callable

from ..measure.timeline import Marks
from .base import EMPTY_CHOICES_RE, Tap, has_usage, is_finish, is_output
from .framing import MAX_EVENT_BYTES, Raw
from .token_read import PATTERN, token_kind, token_runs

_FP_RE = re.compile(rb'"system_fingerprint":("(?:[^"\\]|\\.)*"|null)')

_KEEP, _FINISH, _USAGE_ONLY = 0, 1, 2

_FINISH_KEY, _FINISH_NULL = b'"finish_reason":', b'"finish_reason":null'


class SSETap(Tap):
    """Server-sent events. With `strip` set, drops the usage event the proxy asked for,
    and holds finish events (and, to keep the order, what follows them: other choices'
    tokens when ``n`` > 1) until it knows whether their fingerprint went to that usage
    event. Events are found per the SSE rules (``\\n``, ``\\r\\n`` and ``\\r`` end a line)
    on every chunk, by the base tap's framer."""

    __slots__ = ("_held", "_held_size", "rewrite", "strip")

    def __init__(self, marks: Marks, strip: bool = False, limit: int = MAX_EVENT_BYTES) -> None:
        super().__init__(marks, limit)
        self.strip = self.rewrites = strip
        self._held: list[tuple[bytes, bool]] = []  # (event, is a finish event)
        self._held_size = 0
        #: Applied to every event forwarded while stripping (Ollama's zero usage).
        self.rewrite: Callable[[bytes], bytes] | None = None

    def feed(self, chunk: bytes, now: float) -> bytes:
        """The base tap's feed, with what can be asked once per read asked once: in a
        read of whole events that holds no usage key and no finish reason but null, no
        event can finish a choice or carry usage, so none is held or stripped and the
        read is forwarded as it came; each event is asked only whether it carries output
        (an event that starts otherwise than ``data: {"`` is classified as ever: a
        comment, ``[DONE]``, an error, another field first)."""
        fr = self._fr
        if not (self._held or self.rewrite is not None or fr.holding()):
            # plain token events, one a read at pace: their questions asked in one
            # call (proxy.engines.token_read)
            kind = token_kind(chunk)
            if kind == 1:  # the paced read: one event, no loop to set up
                self._output(now)
                return chunk
            if kind > 1:
                self._outputs(now, kind)
                return chunk
            if kind == PATTERN:  # one event, told by its payload
                self._examine(chunk, now)
                return chunk
            lead, lead_end, tail, tail_start = token_runs(chunk)
            if lead or tail:
                return self._around(chunk, now, lead, lead_end, tail, tail_start)
        return self._general(chunk, now)

    def token_read(self, chunk: bytes, now: float) -> bool:
        """Whether `chunk` is a paced read that :meth:`feed` forwards as it came: one
        plain token event, nothing held, nothing rewritten. Then it is counted, as
        `feed` counts it, and True (the caller forwards `chunk`); otherwise False with
        nothing done (the caller feeds it)."""
        if self._held or self.rewrite is not None or self._fr.holding() or token_kind(chunk) != 1:
            return False
        self._output(now)
        return True

    def _around(
        self, chunk: bytes, now: float, lead: int, lead_end: int, tail: int, tail_start: int
    ) -> bytes:
        """A read of plain token events around others (the role event first, the finish,
        usage and ``[DONE]`` last): the token events are counted and forwarded as they
        came, the others go through the general path. Nothing is held before the read;
        the trailing run too goes through the general path when its events must wait
        behind a held one."""
        if lead:
            self._outputs(now, lead)
        middle = chunk[lead_end:tail_start]
        out = self._general(middle, now)
        rest = chunk[tail_start:]
        if tail and self._held:
            rest = self._general(rest, now)
        else:
            if tail:
                self._outputs(now, tail)
            if out is middle:  # nothing changed: the read goes out as it came
                return chunk
        return chunk[:lead_end] + out + rest

    def _general(self, chunk: bytes, now: float) -> bytes:
        """Any read, event by event (a read of whole events with no finish reason and no
        usage is forwarded as it came)."""
        fr = self._fr
        pieces = fr.split(chunk)
        if not pieces:
            return b""
        if (
            not fr.whole
            or self._held
            or self.rewrite is not None
            or chunk.find(b'"usage":') >= 0
            or chunk.count(_FINISH_KEY) != chunk.count(_FINISH_NULL)
        ):
            return self._pass(pieces, chunk, now)
        classify = self._classify
        for ev in pieces:
            classify(ev, now)  # _KEEP: no finish reason, no usage in this read
        return chunk

    def _classify(self, ev: bytes, now: float) -> int:
        """What one whole event is, the one classifier of every path (its output
        counted, its payload kept where it matters): a plain token delta is told in one
        call (:func:`token_kind`), any other event by its payload (:meth:`_examine`)."""
        if token_kind(ev) == 1:
            self._output(now)
            return _KEEP
        return self._examine(ev, now)

    def _examine(self, ev: bytes, now: float) -> int:
        """An event that is not a plain token delta: a comment, ``[DONE]``, an error,
        the role, a finish, usage, or output only the pattern can tell."""
        if ev[:1] == b":":  # comment (keep-alive)
            return _KEEP
        p = ev.find(b"data:")
        if p < 0:
            return _KEEP
        payload = ev[p + 5 :].lstrip(b" ")
        if payload[:6] == b"[DONE]":
            self.done = True
            return _KEEP
        if payload[:8] == b'{"error"' or payload[:9] == b'{ "error"':
            self.error_payload = payload
            return _KEEP
        kind = _KEEP
        if is_output(payload):  # same answers as OUTPUT_RE etc., by substring first
            self._output(now)
            if is_finish(payload):
                self.finish_seen = True
                self.finish_payload = payload
                kind = _FINISH
        if has_usage(payload):
            self.usage_payload = payload
            if EMPTY_CHOICES_RE.search(payload) is not None:
                kind = _USAGE_ONLY
        return kind

    _event = _classify  # type: ignore[assignment]  # its kind is only read while stripping

    def _rewrite(self, pieces: list[bytes], now: float) -> bytes:
        out: list[bytes] = []
        held = self._held
        raw_seen = self._fr.passed
        rewrite = self.rewrite
        classify = self._classify
        for ev in pieces:
            if raw_seen and type(ev) is Raw:  # an oversized event: unexamined, in order
                out.extend(h for h, _ in held)
                held.clear()
                self._held_size = 0
                out.append(ev)
                continue
            kind = classify(ev, now)
            if rewrite is not None:
                ev = rewrite(ev)
            if kind == _USAGE_ONLY:
                m = _FP_RE.search(ev)
                for h, finish in held:
                    out.append(_with_fingerprint(h, m.group(1) if m else None) if finish else h)
                held.clear()
                self._held_size = 0
            elif kind == _FINISH or held:
                held.append((ev, kind == _FINISH))
                self._held_size += len(ev)
                if self._held_size > self._fr.limit:  # an engine that only finishes
                    out.extend(h for h, _ in held)
                    held.clear()
                    self._held_size = 0
            else:
                out.append(ev)
        return b"".join(out)

    def _release(self) -> bytes:
        held = b"".join(h for h, _ in self._held)
        self._held.clear()
        self._held_size = 0
        return held


def _with_fingerprint(event: bytes, fingerprint: bytes | None) -> bytes:
    """Put the usage event's fingerprint back on a finish event that lacks one."""
    if fingerprint is None or event.find(b'"system_fingerprint"') >= 0:
        return event
    body = event.rstrip(b"\r\n")
    if not body.endswith(b"}"):
        return event
    return body[:-1] + b',"system_fingerprint":' + fingerprint + b"}" + event[len(body) :]
