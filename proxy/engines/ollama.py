"""Ollama: the native NDJSON API (``/api/chat``, ``/api/generate``) and its ``/v1`` layer.

Wire facts (tests/fixtures/wire/README.md §2, §6):
- Native streams are NDJSON, one ``json + "\\n"`` per flush, ``stream`` defaulting to
  true. Counts and timings sit on the final ``"done":true`` line, in nanoseconds; a
  metric that is zero is left out (Go omitempty), so a missing key means 0.
  ``load_duration`` is cold start / scheduling, ``prompt_eval_duration`` covers only the
  uncached prompt tokens while ``prompt_eval_count`` counts them all, ``eval_count``
  includes the EOS token (which the done line stands for). The engine-side wait is
  ``total - load - prompt_eval - eval`` (semaphore wait, templating, tokenising).
- A mid-stream failure is a final ``{"error":"..."}`` line; a stream that ends without
  its done line is an upstream error. ``done_reason`` ``load``/``unload`` answers (a chat
  with no messages, a generate with no prompt) are not generations: they pass unmeasured.
- ``/v1``: OpenAI SSE. Usage only with ``stream_options.include_usage`` (a missing
  ``include_usage`` means false); injecting it adds one ``"choices":[]`` event, and on
  ``/v1/completions`` also a zero ``usage`` object inside *every* event, both removed here
  byte for byte. A stream that loses its error ends without ``[DONE]``.

Embeddings: native ``/api/embed`` (``prompt_eval_count``, ns durations) and the older
``/api/embeddings`` (no counts), and ``/v1/embeddings`` (OpenAI ``usage``): whole bodies.

Recognised by ``GET /api/version``. Models come from ``/api/tags``, their precision from
``details.quantization_level`` (``/api/show`` when the tag does not say), their KV-cache
shape from ``/api/show``'s ``model_info`` (GGUF keys; the cache's element type is the
server's ``OLLAMA_KV_CACHE_TYPE``, which no API shows); a model asked
for without a tag means ``:latest``. Its own state comes from ``/api/ps``: the loaded
models, their size in VRAM and when they unload. It has no tokenizer endpoint (the bench
estimates prompt lengths from usage).
"""

from __future__ import annotations

import json
import re
from datetime import UTC, datetime
from typing import TYPE_CHECKING, ClassVar

import httpx

from ..measure.kvcache import from_gguf
from ..measure.precision import (
    Precision,
    from_gguf_file_type,
    from_gguf_type,
    from_hf_config,
    from_llama_ftype,
)
from ..measure.sanity import Values
from ..measure.timeline import EngineTimings, Marks, Usage
from .base import (
    EngineReading,
    EngineState,
    Listing,
    ModelList,
    ModelQuery,
    Outcome,
    Prepared,
    Tap,
    Tokenizer,
    error_message,
    loads,
    read_response,
    settle,
)
from .framing import MAX_EVENT_BYTES
from .openai import OpenAIDialect
from .probe import get_json, read_bounded
from .sse import SSETap

if TYPE_CHECKING:
    from .probe import Prober

#: A native line carrying generated output: non-empty text, thinking or tool calls.
_NATIVE_OUTPUT_RE = re.compile(
    rb'"(?:content|response|thinking)":\s*"(?!")|"tool_calls":\s*\[\s*\{'
)
_DONE_RE = re.compile(rb'"done":\s*true')
_NOT_GENERATION_RE = re.compile(rb'"done_reason":\s*"(?:load|unload)"')

#: What Ollama's /v1/completions adds inside every event when include_usage is on.
_ZERO_USAGE_EVENT_END = b',"usage":{"prompt_tokens":0,"completion_tokens":0,"total_tokens":0}}'

NATIVE = {"/api/chat": "ollama_chat", "/api/generate": "ollama_generate"}
OPENAI = {"/v1/chat/completions": "chat", "/v1/completions": "completions"}
EMBED = {
    "/api/embed": "ollama_embed",
    "/api/embeddings": "ollama_embeddings",
    "/v1/embeddings": "embeddings",
}


class NDJSONTap(Tap):
    """Ollama's native stream: one JSON object per line, forwarded untouched (whole lines
    at a time)."""

    __slots__ = ()
    lines = True

    def _event(self, ev: bytes, now: float) -> None:
        line = ev[:-1] if ev[-1:] == b"\n" else ev
        if line[-1:] == b"\r":
            line = line[:-1]
        if line:
            self._line(line, now)

    def _line(self, line: bytes, now: float) -> None:
        if line[-14:] == b',"done":false}':  # the common mid-stream line: one scan
            if _NATIVE_OUTPUT_RE.search(line) is not None:
                self._output(now)
            return
        if line[:9] == b'{"error":' or line[:10] == b'{"error" :':
            self.error_payload = line
            return
        if _DONE_RE.search(line) is not None:
            self.done = True
            self.finish_seen = True
            self.timings_payload = line
            if _NOT_GENERATION_RE.search(line) is None:
                self._output(now)  # the done line stands for the last (EOS) token
            return
        if _NATIVE_OUTPUT_RE.search(line) is not None:
            self._output(now)


class OllamaSSETap(SSETap):
    """Ollama's /v1 stream; when stripping completions, also removes the zero usage
    object Ollama puts inside every event once include_usage is on."""

    __slots__ = ()

    def __init__(
        self, marks: Marks, strip: bool, zero_suffix: bool, limit: int = MAX_EVENT_BYTES
    ) -> None:
        super().__init__(marks, strip=strip, limit=limit)
        if zero_suffix:
            self.rewrite = _drop_zero_usage


def _drop_zero_usage(event: bytes) -> bytes:
    # Anchored at the event's end: the same bytes inside a JSON string would be escaped.
    body = event.rstrip(b"\r\n")
    if not body.endswith(_ZERO_USAGE_EVENT_END):
        return event
    return body[: -len(_ZERO_USAGE_EVENT_END)] + b"}" + event[len(body) :]


class OllamaDialect(OpenAIDialect):
    """Ollama, native and /v1."""

    name: ClassVar[str] = "ollama"
    health_path: ClassVar[str] = "/api/version"
    #: Copying, deleting, pulling, creating and pushing models, and uploading blobs.
    admin_paths: ClassVar[frozenset[str]] = frozenset(
        {"/api/copy", "/api/delete", "/api/pull", "/api/create", "/api/push", "/api/blobs"}
    )
    #: ``keep_alive: 0`` unloads the model once the request is answered.
    unload_fields: ClassVar[dict[str, str]] = {
        p: "keep_alive" for p in ("/api/generate", "/api/chat", "/api/embed", "/api/embeddings")
    }
    #: llama.cpp's default cache type (OLLAMA_KV_CACHE_TYPE / --cache-type-k f16)
    kv_default_dtype: ClassVar[str | None] = "fp16"
    empty_stream_options_is_usage: ClassVar[bool] = False
    endpoints: ClassVar[dict[str, str]] = {**NATIVE, **OPENAI, **EMBED}
    whole_endpoints: ClassVar[frozenset[str]] = frozenset(EMBED.values())
    #: Ollama's own API: its clients are answered by Ollama upstreams only.
    native_prefix: ClassVar[str | None] = "/api/"
    #: Its own model lists beside OpenAI's, merged by name over the Ollama upstreams.
    model_lists: ClassVar[dict[str, Listing]] = {
        **OpenAIDialect.model_lists,
        "/api/tags": Listing("/api/tags", "models", "name", native=True),
        "/api/ps": Listing("/api/ps", "models", "name", native=True),
    }
    #: "name": Ollama's older alias of "model".
    model_fields: ClassVar[tuple[str, ...]] = ("model", "name")

    # --- recognising it, its models and their precision, its state ----------------------

    @staticmethod
    async def detect(probe: Prober) -> bool:
        version = await probe.get_dict("/api/version")
        return version is not None and isinstance(version.get("version"), str)

    def canonical(self, model: str, listed: set[str]) -> str | None:
        if model in listed:
            return model
        if ":" not in model and model + ":latest" in listed:
            return model + ":latest"
        return None

    async def list_models(self, query: ModelQuery) -> ModelList | None:
        try:
            status, obj = await get_json(query.client, "GET", "/api/tags")
            if status != 200 or not isinstance(obj, dict):
                return None
            out = ModelList([])
            items = obj.get("models")
            for item in items if isinstance(items, list) else ():
                if not isinstance(item, dict) or not isinstance(item.get("name"), str):
                    continue
                name = item["name"]
                if not query.fits(name):
                    continue
                out.names.append(name)
                # every name routes; only the first max_models are read in detail
                if name not in query.known and len(out.names) <= query.max_models:
                    # /api/show: the KV shape, and the precision the tag may not give
                    s_status, show = await get_json(
                        query.client, "POST", "/api/show", {"model": name}
                    )
                    show = show if s_status == 200 and isinstance(show, dict) else {}
                    p = ollama_precision(item.get("details"))
                    if p is None:  # /api/show fills an unknown level from the GGUF
                        p = ollama_precision(show.get("details"), show.get("model_info"))
                    out.precision[name] = p
                    out.kv[name] = from_gguf(show.get("model_info"))
            return out
        except httpx.HTTPError:
            return None

    async def read_state(self, client: httpx.AsyncClient, models: set[str]) -> EngineReading | None:
        status, body = await read_bounded(client, "GET", "/api/ps")
        return EngineReading(ollama_ps(json.loads(body))) if status == 200 else None

    async def tokenizer(self, client: httpx.AsyncClient, model: str) -> Tokenizer | None:
        return None  # no tokenizer endpoint, native or /v1

    # --- the request path ---------------------------------------------------------------

    def prepare(
        self, endpoint: str, raw: bytes, inject_usage: bool, view: bytes | None = None
    ) -> Prepared | None:
        if endpoint in OPENAI.values():
            return super().prepare(endpoint, raw, inject_usage, view)
        try:
            obj = json.loads(raw if view is None else view)
        except (ValueError, UnicodeDecodeError, RecursionError):
            obj = None
        if not isinstance(obj, dict):  # Ollama answers malformed input itself (400)
            return Prepared(endpoint, None, False, raw)
        model = obj.get("model", obj.get("name"))
        model = model if isinstance(model, str) else None
        if endpoint in self.whole_endpoints:
            return Prepared(endpoint, model, False, raw)
        if endpoint == "ollama_chat":
            load_only = obj.get("messages") in (None, [])
        else:
            load_only = not obj.get("prompt") and not obj.get("images")
        if load_only:
            return None  # a model load/unload, not a generation: passed through unmeasured
        return Prepared(endpoint, model, obj.get("stream") is not False, raw)

    def tap(
        self, content_type: str, marks: Marks, prepared: Prepared, limit: int = MAX_EVENT_BYTES
    ) -> Tap | None:
        if prepared.endpoint in NATIVE.values():
            if content_type.startswith("application/x-ndjson"):
                return NDJSONTap(marks, limit)
            return None
        if content_type.startswith("text/event-stream"):
            zero = prepared.strip_usage and prepared.endpoint == "completions"
            return OllamaSSETap(marks, prepared.strip_usage, zero, limit)
        return None

    def error_body(
        self, status: int, message: str, kind: str, path: str = ""
    ) -> tuple[bytes, bytes]:
        if path.startswith("/api/"):
            return b"application/json; charset=utf-8", json.dumps({"error": message}).encode()
        return super().error_body(status, message, kind, path)

    def stream_error(self, message: str, endpoint: str = "") -> bytes:
        if endpoint in NATIVE.values():
            return json.dumps({"error": message}).encode() + b"\n"
        return super().stream_error(message, endpoint)

    def outcome(self, tap: Tap | None, body: bytes | None, status: int) -> Outcome:
        if isinstance(tap, NDJSONTap):
            out = Outcome()
            obj = loads(tap.timings_payload)
            if isinstance(obj, dict):
                read_done_line(obj, out)
            return settle(tap, out, "its done line")
        if tap is None and status < 400:
            obj = loads(body)
            if isinstance(obj, dict) and ("embeddings" in obj or "embedding" in obj):
                out = Outcome(finished=True)  # /api/embed counts its input; /api/embeddings not
                read_embed(obj, out)
                return out
            if isinstance(obj, dict) and "choices" not in obj and "done" in obj:
                out = Outcome()
                if "error" in obj:
                    out.error_kind, out.error_message = "midstream", error_message(obj)
                    return out
                read_done_line(obj, out)
                out.finished = True
                return out
        return super().outcome(tap, body, status)


def read_done_line(obj: dict, out: Outcome) -> None:
    """Counts and engine timings from a native done line (ns; a missing key is 0, an
    implausible value is dropped: proxy.measure.sanity)."""
    v = Values(out.dropped)

    def given(key: str) -> object:
        value = obj.get(key)
        return 0 if value is None else value

    ns: dict[str, float] = {}  # the plausible durations, in nanoseconds as sent

    def seconds(key: str, name: str) -> float | None:
        value = given(key)
        s = v.seconds(value, name, 1e9)
        if s is not None:
            ns[key] = value  # type: ignore[assignment]
        return s

    prompt_n = v.count(given("prompt_eval_count"), "prompt_tokens")
    eval_n = v.count(given("eval_count"), "completion_tokens")
    total, load = (
        seconds("total_duration", "total_seconds"),
        seconds("load_duration", "load_seconds"),
    )
    prompt_s = seconds("prompt_eval_duration", "prefill_seconds")
    eval_s = seconds("eval_duration", "decode_seconds")
    out.usage = Usage(prompt_tokens=prompt_n, completion_tokens=eval_n)
    e = EngineTimings()
    # prompt_eval_count includes prefix-cache hits, prompt_eval_duration does not:
    # Ollama gives no cached count, so the engine's prefill rate is over all prompt
    # tokens (docs/dialects.md says what that means).
    e.prefill_tokens = prompt_n
    e.prefill_seconds = prompt_s
    e.decode_tokens = eval_n
    e.decode_seconds = eval_s
    if eval_s and eval_n is not None and eval_n >= 2:
        e.decode_tokens_per_second = v.rate(eval_n / eval_s, "decode_rate")
    e.load_seconds = load
    if total:
        e.total_seconds = total
        parts = ("load_duration", "prompt_eval_duration", "eval_duration")
        e.queue_seconds = max(0, ns["total_duration"] - sum(ns.get(k, 0) for k in parts)) / 1e9
    out.engine = e
    read_response(obj, out)


def read_embed(obj: dict, out: Outcome) -> None:
    """Input tokens and engine timings from a native embeddings answer (ns)."""
    v = Values(out.dropped)
    out.usage = Usage(prompt_tokens=v.count(obj.get("prompt_eval_count"), "prompt_tokens"))
    e = EngineTimings()
    e.load_seconds = v.seconds(obj.get("load_duration"), "load_seconds", 1e9)
    total = v.seconds(obj.get("total_duration"), "total_seconds", 1e9)
    if total:
        e.total_seconds = total
    out.engine = e


# --- precision and state ----------------------------------------------------------------------


def ollama_precision(details: object, model_info: object = None) -> Precision | None:
    """Ollama's ``details.quantization_level`` (``Q4_K_M``, ``F16``, ``BF16`` ...), else the
    GGUF ``general.file_type`` of ``/api/show``'s model_info."""
    level = details.get("quantization_level") if isinstance(details, dict) else None
    if isinstance(level, str) and level and level.lower() != "unknown":
        p = from_gguf_type(level) or from_llama_ftype(level)
        if p is not None:
            return p
        dtype = from_hf_config({"torch_dtype": level})  # safetensors models: a dtype
        if dtype is not None:
            return dtype
    if isinstance(model_info, dict):
        return from_gguf_file_type(model_info.get("general.file_type"))
    return None


def ollama_ps(obj: object, now: datetime | None = None) -> EngineState:
    """{model: {loaded, vram, size, expiry}} from Ollama's /api/ps."""
    now = now or datetime.now(UTC)
    out: EngineState = {}
    items = obj.get("models") if isinstance(obj, dict) else None
    for item in items if isinstance(items, list) else ():
        if not isinstance(item, dict) or not isinstance(item.get("name"), str):
            continue
        state = {
            "loaded": 1.0,
            "vram": _number(item.get("size_vram")),
            "size": _number(item.get("size")),
        }
        expires = _parse_time(item.get("expires_at"))
        if expires is not None:
            state["expiry"] = max(0.0, (expires - now).total_seconds())
        out[item["name"]] = state
    return out


def _number(value: object) -> float:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else 0.0


def _parse_time(text: object) -> datetime | None:
    """Go's RFC3339Nano (any number of fraction digits) as an aware datetime."""
    if not isinstance(text, str) or "T" not in text:
        return None
    t = text.replace("Z", "+00:00")
    main, _, rest = t.partition(".")
    if rest:
        n = 0
        while n < len(rest) and rest[n].isdigit():
            n += 1
        digits, tz = rest[:n], rest[n:]
        t = f"{main}.{(digits + '000000')[:6]}{tz}"
    try:
        parsed = datetime.fromisoformat(t)
    except ValueError:
        return None
    return parsed if parsed.tzinfo else parsed.replace(tzinfo=UTC)
