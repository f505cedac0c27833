"""llama.cpp's llama-server: ``/v1/chat/completions``, ``/v1/completions``, native ``/completion``.

Wire facts (fixtures/llama-server captures, fixtures/wire §4, §6):
- SSE ``data: <json>\\n\\n``; ``:`` keep-alive comments may come at any time, even before
  the first token (headers go out when a slot starts, before prefill).
- The first chat event is role-only with ``"content":null``: not a token. The finish
  event has ``"delta":{}`` and stands for the last (EOS) token.
- ``timings`` (``cache_n``, ``prompt_n``, ``prompt_ms``, ``predicted_n``, ``predicted_ms``,
  ``predicted_per_second`` ...) ride on the last JSON event (and, when a stop word ends
  generation, also on the last content event): the last one wins. Usage is never
  injected here: asking for it moves ``timings`` to a new event, and timings carry the
  counts anyway. ``prompt_n`` excludes prefix-cache hits (``cache_n``).
- Chat streams end with ``data: [DONE]``; native ``/completion`` streams end after the
  ``"stop":true`` event, with no ``[DONE]``. A mid-stream error is ``data: {"error":...}``
  and the stream ends without ``[DONE]``.
"""

from __future__ import annotations

import json
import re

from ..timeline import EngineTimings, Marks
from .base import OUTPUT_RE, USAGE_RE, Outcome, Prepared, Tap, as_int, loads, settle
from .openai import OpenAIDialect

_TIMINGS_RE = re.compile(rb'"timings":\s*\{')
_STOP_RE = re.compile(rb'"stop":\s*true')

ENDPOINTS = {"/v1/chat/completions": "chat", "/chat/completions": "chat",
             "/v1/completions": "completions", "/completions": "completions",
             "/completion": "llamacpp_completion"}


class LlamaTap(Tap):
    """llama-server's SSE, inspected and forwarded untouched."""

    __slots__ = ("native", "_sep")

    def __init__(self, marks: Marks, native: bool) -> None:
        super().__init__(marks)
        self.native = native
        self._sep = b""

    def _event(self, ev: bytes, now: float) -> None:
        if ev[:1] == b":":
            return
        p = ev.find(b"data:")
        if p < 0:
            if ev[:6] == b"error:":  # older builds' non-standard error field
                self.error_payload = ev[6:].strip()
            return
        payload = ev[p + 5:].lstrip(b" ")
        if payload[:6] == b"[DONE]":
            self.done = True
            return
        if payload[:9] == b'{"error":':
            self.error_payload = payload
            return
        if OUTPUT_RE.search(payload) is not None:
            self._output(now)
            if b'"finish_reason":"' in payload:
                self.finish_seen = True
        if self.native and b'"stop":' in payload and _STOP_RE.search(payload) is not None:
            if not self.finish_seen:
                self._output(now)  # the stop event stands for the last token
            self.finish_seen = self.done = True
        # only the last events carry these: a substring test first (a key inside a
        # JSON string would have escaped quotes), the regex only when it hits
        if b'"timings"' in payload and _TIMINGS_RE.search(payload) is not None:
            self.timings_payload = payload
        if b'"usage"' in payload and USAGE_RE.search(payload) is not None:
            self.usage_payload = payload

    def feed(self, chunk: bytes, now: float) -> bytes:
        data = self._buf + chunk if self._buf else chunk
        sep = self._sep
        if not sep:
            sep = self._sep = b"\r\n\r\n" if b"\r\n" in data else b"\n\n"
        step = len(sep)
        find = data.find
        start = 0
        while (i := find(sep, start)) >= 0:
            self._event(data[start:i], now)
            start = i + step
        self._buf = data[start:]
        return chunk


class LlamaCppDialect(OpenAIDialect):
    """llama-server: reads its own timings, never injects usage."""

    name = "llamacpp"
    empty_stream_options_is_usage = False
    endpoints = ENDPOINTS

    def prepare(self, endpoint: str, raw: bytes, inject_usage: bool) -> Prepared:
        try:
            obj = json.loads(raw)
        except (ValueError, UnicodeDecodeError, RecursionError):
            obj = None
        if not isinstance(obj, dict):
            return Prepared(endpoint, None, False, raw)
        model = obj.get("model")
        return Prepared(endpoint, model if isinstance(model, str) else None,
                        obj.get("stream") is True, raw)

    def tap(self, content_type: str, marks: Marks, prepared: Prepared) -> Tap | None:
        if content_type.startswith("text/event-stream"):
            return LlamaTap(marks, native=prepared.endpoint == "llamacpp_completion")
        return None

    def outcome(self, tap: Tap | None, body: bytes | None, status: int) -> Outcome:
        if status >= 400:
            return super().outcome(tap, body, status)
        out = Outcome()
        if tap is None:
            obj = loads(body)
            if not isinstance(obj, dict):
                out.error_kind, out.error_message = "protocol", "response is not JSON"
                return out
            read_timings(obj, out)
            out.finished = True
            return out
        usage_obj = loads(tap.usage_payload)
        if isinstance(usage_obj, dict):
            self._read_usage(usage_obj, out.usage)
        timings_obj = loads(tap.timings_payload)
        if isinstance(timings_obj, dict):
            read_timings(timings_obj, out)
        return settle(tap, out, "its last event")


def read_timings(obj: dict, out: Outcome) -> None:
    """Counts and engine timings from an object carrying ``timings`` (and maybe usage)."""
    if out.usage.prompt_tokens is None and isinstance(obj.get("usage"), dict):
        OpenAIDialect._read_usage(obj, out.usage)
    t = obj.get("timings")
    if not isinstance(t, dict):
        return
    prompt_n, cache_n = as_int(t.get("prompt_n")), as_int(t.get("cache_n")) or 0
    predicted_n = as_int(t.get("predicted_n"))
    prompt_ms, predicted_ms = _num(t.get("prompt_ms")), _num(t.get("predicted_ms"))
    u = out.usage
    if u.prompt_tokens is None and prompt_n is not None:
        u.prompt_tokens = prompt_n + cache_n
    if u.cached_tokens is None:
        u.cached_tokens = cache_n
    if u.completion_tokens is None and predicted_n is not None:
        u.completion_tokens = predicted_n
    e = EngineTimings()
    e.prefill_tokens = prompt_n  # excludes tokens served from the prompt cache
    if prompt_ms is not None:
        e.prefill_seconds = prompt_ms / 1000.0
    e.decode_tokens = predicted_n
    if predicted_ms is not None:
        e.decode_seconds = predicted_ms / 1000.0
    rate = _num(t.get("predicted_per_second"))
    if rate is not None and predicted_n is not None and predicted_n >= 2:
        e.decode_tokens_per_second = rate
    out.engine = e


def _num(value) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value)
