"""Server-sent events as OpenAI-compatible engines send them, tapped on bytes.

``data: <json>`` events separated by a blank line, ``data: [DONE]`` at the end, ``:``
comments (keep-alives) at any time, ``data: {"error": ...}`` when an engine fails
mid-stream. The tap finds the events that carry output without parsing JSON, keeps the
usage event's payload, and, when the proxy asked for usage the client did not, removes
what that added (see :class:`SSETap`).
"""

from __future__ import annotations

import re

from ..measure.timeline import Marks
from .base import EMPTY_CHOICES_RE, Tap, has_usage, is_finish, is_output

_FP_RE = re.compile(rb'"system_fingerprint":("(?:[^"\\]|\\.)*"|null)')

_KEEP, _FINISH, _USAGE_ONLY = 0, 1, 2


class SSETap(Tap):
    """Server-sent events. With `strip` set, forwards whole events only, drops the usage
    event the proxy asked for, and holds finish events (and, to keep the order, what
    follows them: other choices' tokens when ``n`` > 1) until it knows whether their
    fingerprint went to that usage event."""

    __slots__ = ("_held", "_sep", "strip")

    def __init__(self, marks: Marks, strip: bool = False) -> None:
        super().__init__(marks)
        self.strip = strip
        self._sep = b""
        self._held: list[tuple[bytes, bool]] = []  # (event, is a finish event)

    def _classify(self, ev: bytes, now: float) -> int:
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

    def feed(self, chunk: bytes, now: float) -> bytes:
        data = self._buf + chunk if self._buf else chunk
        sep = self._sep
        if not sep:
            sep = self._sep = b"\r\n\r\n" if b"\r\n" in data else b"\n\n"
        step = len(sep)
        find = data.find
        start = 0
        if not self.strip:
            while (i := find(sep, start)) >= 0:
                self._classify(data[start:i], now)
                start = i + step
            self._buf = data[start:]
            return chunk
        out: list[bytes] = []
        held = self._held
        while (i := find(sep, start)) >= 0:
            end = i + step
            kind = self._classify(data[start:i], now)
            if kind == _USAGE_ONLY:
                m = _FP_RE.search(data, start, i)
                for ev, finish in held:
                    out.append(
                        _with_fingerprint(ev, m.group(1) if m else None, step) if finish else ev
                    )
                held.clear()
            elif kind == _FINISH or held:
                held.append((data[start:end], kind == _FINISH))
            else:
                out.append(data[start:end])
            start = end
        self._buf = data[start:]
        return b"".join(out)

    def flush(self) -> bytes:
        if not self.strip:  # inspect mode forwarded every byte already
            self._buf = b""
            return b""
        held = b"".join(ev for ev, _ in self._held) + self._buf
        self._held.clear()
        self._buf = b""
        return held


def _with_fingerprint(event: bytes, fingerprint: bytes | None, step: int) -> bytes:
    """Put the usage event's fingerprint back on a finish event that lacks one."""
    if fingerprint is None or b'"system_fingerprint"' in event:
        return event
    body = event[:-step]
    if not body.endswith(b"}"):
        return event
    return body[:-1] + b',"system_fingerprint":' + fingerprint + b"}" + event[-step:]
