"""OpenAI-compatible SSE dialect (vLLM, and any OpenAI-style server).

Wire facts (fixtures/vllm-real, fixtures/wire §3, §6):
- ``data: <json>\\n\\n`` events, ``data: [DONE]`` at the end, optional ``: keep-alive``.
- vLLM's first chat event is role-only (``"content":""``): not a token.
- Usage only with ``stream_options.include_usage``; vLLM reads ``"stream_options":{}``
  as include_usage=true. Injecting it adds one ``"choices":[]`` usage event and (vLLM
  0.32+) moves ``system_fingerprint`` from the finish event to that usage event; the
  strip below drops the event and puts the fingerprint back where it was.
- Mid-stream errors are ``data: {"error": ...}`` events.
"""

from __future__ import annotations

import json
import re

from ..timeline import Marks, Usage
from .base import (EMPTY_CHOICES_RE, Outcome, Prepared, Tap, as_int, error_message, has_usage,
                   is_finish, is_output, loads, settle)

_FP_RE = re.compile(rb'"system_fingerprint":("(?:[^"\\]|\\.)*"|null)')

_KEEP, _FINISH, _USAGE_ONLY = 0, 1, 2


class SSETap(Tap):
    """Server-sent events. With `strip` set, forwards whole events only, drops the usage
    event the proxy asked for, and holds finish events until it knows whether their
    fingerprint went to that usage event."""

    __slots__ = ("strip", "_sep", "_held")

    def __init__(self, marks: Marks, strip: bool = False) -> None:
        super().__init__(marks)
        self.strip = strip
        self._sep = b""
        self._held: list[bytes] = []

    def _classify(self, ev: bytes, now: float) -> int:
        if ev[:1] == b":":  # comment (keep-alive)
            return _KEEP
        p = ev.find(b"data:")
        if p < 0:
            return _KEEP
        payload = ev[p + 5:].lstrip(b" ")
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
                for ev in held:
                    out.append(_with_fingerprint(ev, m.group(1) if m else None, step))
                held.clear()
            elif kind == _FINISH:
                held.append(data[start:end])
            else:
                if held:
                    out.extend(held)
                    held.clear()
                out.append(data[start:end])
            start = end
        self._buf = data[start:]
        return b"".join(out)

    def flush(self) -> bytes:
        if not self.strip:  # inspect mode forwarded every byte already
            self._buf = b""
            return b""
        held = b"".join(self._held) + self._buf
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


class OpenAIDialect:
    """Chat and text completions over OpenAI's wire format."""

    name = "openai"
    #: Whether ``"stream_options":{}`` means include_usage=true (vLLM) or false (OpenAI).
    empty_stream_options_is_usage = False
    endpoints = {"/v1/chat/completions": "chat", "/v1/completions": "completions"}

    def endpoint(self, method: str, path: str) -> str | None:
        if method == "POST":
            return self.endpoints.get(path)
        return None

    def client_wants_usage(self, stream_options) -> bool:
        if not isinstance(stream_options, dict):
            return False
        include = stream_options.get("include_usage")
        if include is None:
            return self.empty_stream_options_is_usage
        return include is True

    def prepare(self, endpoint: str, raw: bytes, inject_usage: bool) -> Prepared:
        try:
            obj = json.loads(raw)
        except (ValueError, UnicodeDecodeError, RecursionError):
            obj = None
        if not isinstance(obj, dict):  # the engine answers malformed input itself
            return Prepared(endpoint, None, False, raw)
        model = obj.get("model")
        model = model if isinstance(model, str) else None
        stream = obj.get("stream") is True
        prepared = Prepared(endpoint, model, stream, raw)
        if not (stream and inject_usage):
            return prepared
        # only a well-formed request gets usage added: an invalid one must reach the engine
        # (and its error message) exactly as the client wrote it
        required = "messages" if endpoint == "chat" else "prompt"
        if not isinstance(obj.get(required), (list, str)):
            return prepared
        options = obj.get("stream_options")
        if self.client_wants_usage(options):
            return prepared
        if "stream_options" not in obj:
            body = raw.rstrip()
            if body.endswith(b"}"):
                sep = b"," if body[:-1].rstrip() not in (b"{",) else b""
                prepared.body = body[:-1] + sep + b'"stream_options":{"include_usage":true}}'
                prepared.strip_usage = True
        elif (isinstance(options, dict) and options.get("include_usage") is False
              and not options.get("continuous_usage_stats")):
            obj["stream_options"] = {**options, "include_usage": True}
            prepared.body = json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode()
            prepared.strip_usage = True
        return prepared

    def stream_error(self, message: str, endpoint: str = "") -> bytes:
        """A well-formed error event to end a stream the upstream broke off."""
        err = {"error": {"message": message, "type": "upstream_error", "param": None, "code": 502}}
        return b"data: " + json.dumps(err).encode() + b"\n\n"

    def error_body(self, status: int, message: str, kind: str,
                   path: str = "") -> tuple[bytes, bytes]:
        """(content type, body) of an error the proxy itself answers on `path` with."""
        err = {"error": {"message": message, "type": kind, "param": None, "code": status}}
        return b"application/json", json.dumps(err).encode()

    def tap(self, content_type: str, marks: Marks, prepared: Prepared) -> Tap | None:
        if content_type.startswith("text/event-stream"):
            return SSETap(marks, strip=prepared.strip_usage)
        return None

    def outcome(self, tap: Tap | None, body: bytes | None, status: int) -> Outcome:
        out = Outcome()
        if status >= 400:
            out.error_kind = "upstream_status"
            out.error_message = error_message(loads(body)) if body else f"HTTP {status}"
            return out
        if tap is None:  # whole JSON body
            obj = loads(body)
            if not isinstance(obj, dict):
                out.error_kind, out.error_message = "protocol", "response is not JSON"
                return out
            self._read_usage(obj, out.usage)
            out.finished = True
            return out
        obj = loads(tap.usage_payload)
        if isinstance(obj, dict):
            self._read_usage(obj, out.usage)
        return settle(tap, out, "[DONE]")

    @staticmethod
    def _read_usage(obj: dict, usage: Usage) -> None:
        u = obj.get("usage")
        if not isinstance(u, dict):
            return
        usage.prompt_tokens = as_int(u.get("prompt_tokens"))
        usage.completion_tokens = as_int(u.get("completion_tokens"))
        details = u.get("prompt_tokens_details")
        if isinstance(details, dict):
            usage.cached_tokens = as_int(details.get("cached_tokens"))


class VLLMDialect(OpenAIDialect):
    name = "vllm"
    empty_stream_options_is_usage = True
