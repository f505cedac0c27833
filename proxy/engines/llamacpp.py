"""llama.cpp's llama-server: ``/v1/chat/completions``, ``/v1/completions``, native ``/completion``.

Wire facts (tests/fixtures/llama-server captures, tests/fixtures/wire/README.md §4, §6):
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

Embeddings (``--embeddings``: ``/v1/embeddings``, ``/embeddings``, the older ``/embedding``
with no counts) and reranking (``--rerank``: ``/rerank``, ``/v1/rerank``, ``/reranking``,
``/v1/reranking``) answer whole JSON bodies with ``usage.prompt_tokens``.

Recognised by ``GET /props`` (build and generation settings) or models ``owned_by:
"llamacpp"``. It serves one model and answers any model name with it. Precision comes from
``/props`` ``model_ftype``, ``/v1/models`` ``meta.ftype``, the GGUF file name, else bits per
weight. The KV-cache shape comes from the GGUF file's metadata where ``/props``
``model_path`` is readable from the proxy (or found under ``--model-dir`` by its name);
the cache's element type (``--cache-type-k``) is not on any endpoint. Its own state
comes from ``/slots`` (slots processing, tokens held over the slots' context); only
where ``/slots`` is off (``--no-slots``) from ``/metrics``, because every scrape of that
resets the server's throughput gauges for whoever else scrapes it. Its tokenizer is
``POST /tokenize`` (``content``, BOS with ``add_special``) of the prompt
``POST /apply-template`` makes of the messages, where the server can apply its template;
a slot's context (``n_ctx``) comes from ``/props``.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import re
from typing import TYPE_CHECKING, ClassVar

import httpx

from ..measure.kvcache import KVShape, from_gguf
from ..measure.precision import Precision, from_bits_per_weight, from_gguf_type, from_llama_ftype
from ..measure.sanity import Values
from ..measure.timeline import EngineTimings, Marks
from .base import (
    OUTPUT_RE,
    USAGE_RE,
    EngineReading,
    ModelList,
    ModelQuery,
    Outcome,
    Prepared,
    Tap,
    loads,
    no_generation,
    read_response,
    settle,
)
from .framing import MAX_EVENT_BYTES
from .gguf import GGUFError, read_metadata
from .openai import OpenAIDialect
from .probe import get_json, read_bounded
from .prometheus import parse_prometheus

if TYPE_CHECKING:
    from .probe import Prober

log = logging.getLogger(__name__)

#: llama-server's /metrics names (``--metrics``), read only where /slots is off.
GAUGES = {
    "llamacpp:requests_processing": "running",
    "llamacpp:requests_deferred": "waiting",
    "llamacpp:kv_cache_usage_ratio": "kv",
}

_TIMINGS_RE = re.compile(rb'"timings":\s*\{')
_STOP_RE = re.compile(rb'"stop":\s*true')

ENDPOINTS = {
    "/v1/chat/completions": "chat",
    "/chat/completions": "chat",
    "/v1/completions": "completions",
    "/completions": "completions",
    "/completion": "llamacpp_completion",
}
WHOLE = {
    "/v1/embeddings": "embeddings",
    "/embeddings": "embeddings",
    "/embedding": "llamacpp_embedding",
    "/v1/rerank": "rerank",
    "/rerank": "rerank",
    "/v1/reranking": "rerank",
    "/reranking": "rerank",
}


class LlamaTap(Tap):
    """llama-server's SSE, inspected and forwarded untouched."""

    __slots__ = ("native",)

    def __init__(self, marks: Marks, native: bool, limit: int = MAX_EVENT_BYTES) -> None:
        super().__init__(marks, limit)
        self.native = native

    def _event(self, ev: bytes, now: float) -> None:
        if ev[:1] == b":":
            return
        p = ev.find(b"data:")
        if p < 0:
            if ev[:6] == b"error:":  # older builds' non-standard error field
                self.error_payload = ev[6:].strip()
            return
        payload = ev[p + 5 :].lstrip(b" ")
        if payload[:6] == b"[DONE]":
            self.done = True
            return
        if payload[:9] == b'{"error":':
            self.error_payload = payload
            return
        if OUTPUT_RE.search(payload) is not None:
            self._output(now)
            if payload.find(b'"finish_reason":"') >= 0:
                self.finish_seen = True
        if self.native and payload.find(b'"stop":') >= 0 and _STOP_RE.search(payload) is not None:
            if not self.finish_seen:
                self._output(now)  # the stop event stands for the last token
            self.finish_seen = self.done = True
        # only the last events carry these: a substring test first (a key inside a
        # JSON string would have escaped quotes), the regex only when it hits
        if payload.find(b'"timings"') >= 0 and _TIMINGS_RE.search(payload) is not None:
            self.timings_payload = payload
        if payload.find(b'"usage"') >= 0 and USAGE_RE.search(payload) is not None:
            self.usage_payload = payload


class LlamaCppDialect(OpenAIDialect):
    """llama-server: reads its own timings, never injects usage."""

    name: ClassVar[str] = "llamacpp"
    health_path: ClassVar[str] = "/health"  # 503 while the model loads
    #: Setting LoRA scales; saving, restoring or erasing a slot's cache; changing global
    #: properties (``POST /props``); router mode's adding, loading, unloading and deleting
    #: models (``/models...``, whose GETs are the model list); the web UI's server-side
    #: tools and CORS proxy, which reach beyond the engine.
    admin_paths: ClassVar[frozenset[str]] = frozenset(
        {"/lora-adapters", "/slots", "/props", "/models", "/tools", "/cors-proxy"}
    )
    #: The web UI's CORS proxy fetches any URL it is given from the engine's host, GET
    #: included.
    admin_reads: ClassVar[frozenset[str]] = frozenset({"/cors-proxy"})
    answers_any_model: ClassVar[bool] = True
    #: llama.cpp's default cache type (OLLAMA_KV_CACHE_TYPE / --cache-type-k f16)
    kv_default_dtype: ClassVar[str | None] = "fp16"
    empty_stream_options_is_usage: ClassVar[bool] = False
    busy_gauges: ClassVar[tuple[str, ...]] = (
        "llamacpp:requests_processing",
        "llamacpp:requests_deferred",
    )
    generated_tokens: ClassVar[tuple[str, ...]] = ("llamacpp:tokens_predicted_total",)
    endpoints: ClassVar[dict[str, str]] = {**ENDPOINTS, **WHOLE}
    whole_endpoints: ClassVar[frozenset[str]] = frozenset(WHOLE.values())

    # --- recognising it, its model and its precision, its state --------------------------

    def canonical(self, model: str, listed: set[str]) -> str | None:
        """The listed name, or the file name a path-shaped one is listed under (a
        llama-server started without ``-a`` lists its model by the GGUF's path)."""
        if model in listed:
            return model
        name = file_label(model)
        return name if name != model and name in listed else None

    @staticmethod
    async def detect(probe: Prober) -> bool:
        props = await probe.get_dict("/props")
        if props is not None and (
            "default_generation_settings" in props or "build_info" in props or "model_path" in props
        ):
            return True
        models = await probe.get_dict("/v1/models")
        data = models.get("data") if models else None
        return any(
            isinstance(item, dict) and item.get("owned_by") == "llamacpp"
            for item in (data if isinstance(data, list) else ())
        )

    async def list_models(self, query: ModelQuery) -> ModelList | None:
        try:
            status, obj = await get_json(query.client, "GET", "/v1/models")
            if status != 200 or not isinstance(obj, dict):
                return None
            data = obj.get("data")
            entries = [
                e
                for e in (data if isinstance(data, list) else ())
                if isinstance(e, dict)
                and isinstance(e.get("id"), str)
                and query.fits(file_label(e["id"]))
            ]
            props = None
            if any(file_label(e["id"]) not in query.known for e in entries):
                p_status, props = await get_json(query.client, "GET", "/props")
                props = props if p_status == 200 else None
        except httpx.HTTPError:
            return None
        out = ModelList([])
        for i, e in enumerate(entries):
            name = file_label(e["id"])
            out.names.append(name)
            # every name routes; only the first max_models are read in detail
            if name not in query.known and i < query.max_models:
                # /props describes the loaded model; with one model it is this one
                mine = props if len(entries) == 1 else None
                out.precision[name] = llamacpp_precision(mine, e)
                out.kv[name] = await gguf_kv_shape(mine, query.model_dir)
        return out

    async def read_state(self, client: httpx.AsyncClient, models: set[str]) -> EngineReading | None:
        only = next(iter(models)) if len(models) == 1 else ""
        status, body = await read_bounded(client, "GET", "/slots")
        if status == 200:
            state = slots_state(json.loads(body))
            return EngineReading({only: state}) if state else None
        status, body = await read_bounded(client, "GET", "/metrics")
        if status != 200:
            return None
        gauges = parse_prometheus(body.decode("utf-8", "replace"), GAUGES, only)
        return EngineReading(gauges) if gauges else None

    async def tokenizer(self, client: httpx.AsyncClient, model: str) -> LlamaCppTokenizer | None:
        try:
            resp = await client.post("/tokenize", json={"content": "hello world"})
            data = resp.json() if resp.status_code == 200 else None
        except (httpx.HTTPError, ValueError):
            data = None
        if not (isinstance(data, dict) and isinstance(data.get("tokens"), list)):
            return None
        tok = LlamaCppTokenizer(client)
        try:  # the context a slot has (prompts beyond it are refused)
            props = (await client.get("/props")).json()
            n_ctx = (props.get("default_generation_settings") or {}).get("n_ctx") or props.get(
                "n_ctx"
            )
            if isinstance(n_ctx, int) and n_ctx > 0:
                tok.max_model_len = n_ctx
        except (httpx.HTTPError, ValueError, AttributeError):
            pass
        return tok

    def listed_context(self, entry: dict) -> int | None:
        meta = entry.get("meta")
        value = meta.get("n_ctx") if isinstance(meta, dict) else None
        return value if isinstance(value, int) and value > 0 else None

    async def served_file(self, client: httpx.AsyncClient) -> str | None:
        try:  # the GGUF file's name carries the precision
            props = (await client.get("/props")).json()
            path = props.get("model_path")
        except (httpx.HTTPError, ValueError, AttributeError):
            return None
        return path if isinstance(path, str) else None

    # --- the request path ---------------------------------------------------------------

    def prepare(
        self, endpoint: str, raw: bytes, inject_usage: bool, view: bytes | None = None
    ) -> Prepared:
        try:
            obj = json.loads(raw if view is None else view)
        except (ValueError, UnicodeDecodeError, RecursionError):
            obj = None
        if not isinstance(obj, dict):
            return Prepared(endpoint, None, False, raw)
        model = obj.get("model")
        return Prepared(
            endpoint, model if isinstance(model, str) else None, obj.get("stream") is True, raw
        )

    def tap(
        self, content_type: str, marks: Marks, prepared: Prepared, limit: int = MAX_EVENT_BYTES
    ) -> Tap | None:
        if content_type.startswith("text/event-stream"):
            return LlamaTap(marks, native=prepared.endpoint == "llamacpp_completion", limit=limit)
        return None

    def outcome(self, tap: Tap | None, body: bytes | None, status: int) -> Outcome:
        if status >= 400 or (tap is None and no_generation(status)):
            return super().outcome(tap, body, status)
        out = Outcome()
        if tap is None:
            obj = loads(body)
            if isinstance(obj, list) and obj and isinstance(obj[0], dict):
                out.finished = True  # the older /embedding: embeddings with no counts
                return out
            if not isinstance(obj, dict):
                out.error_kind, out.error_message = "protocol", "response is not JSON"
                return out
            read_timings(obj, out)
            if "choices" not in obj and "content" not in obj:  # embeddings, rerank
                out.usage.completion_tokens = None
            out.finished = True
            return out
        usage_obj = loads(tap.usage_payload)
        if isinstance(usage_obj, dict):
            self._read_usage(usage_obj, out)
        timings_obj = loads(tap.timings_payload)
        if isinstance(timings_obj, dict):
            read_timings(timings_obj, out)
        return settle(tap, out, "its last event")


class LlamaCppTokenizer:
    """llama-server's ``/tokenize`` of the templated prompt (the one model it serves)."""

    def __init__(self, client: httpx.AsyncClient) -> None:
        self.client = client
        self.max_model_len: int | None = None

    async def count(self, text: str) -> int:
        prompt = text
        try:  # the chat template's own tokens, where the server can apply it
            r = await self.client.post(
                "/apply-template", json={"messages": [{"role": "user", "content": text}]}
            )
            if r.status_code == 200 and isinstance(r.json().get("prompt"), str):
                prompt = r.json()["prompt"]
        except (httpx.HTTPError, ValueError):
            pass
        resp = await self.client.post("/tokenize", json={"content": prompt, "add_special": True})
        return len(resp.json()["tokens"])


def read_timings(obj: dict, out: Outcome) -> None:
    """Counts and engine timings from an object carrying ``timings`` (and maybe usage)."""
    if out.usage.prompt_tokens is None and isinstance(obj.get("usage"), dict):
        OpenAIDialect._read_usage(obj, out)
    read_response(obj, out)
    t = obj.get("timings")
    if not isinstance(t, dict):
        return
    v = Values(out.dropped)
    prompt_n = v.count(t.get("prompt_n"), "prefill_tokens")
    cache_n = v.count(t.get("cache_n"), "cached_tokens") or 0
    predicted_n = v.count(t.get("predicted_n"), "decode_tokens")
    prompt_s = v.seconds(t.get("prompt_ms"), "prefill_seconds", 1000.0)
    predicted_s = v.seconds(t.get("predicted_ms"), "decode_seconds", 1000.0)
    u = out.usage
    if u.prompt_tokens is None and prompt_n is not None:
        u.prompt_tokens = prompt_n + cache_n
    if u.cached_tokens is None:
        u.cached_tokens = cache_n
    if u.completion_tokens is None and predicted_n is not None:
        u.completion_tokens = predicted_n
    e = EngineTimings()
    e.prefill_tokens = prompt_n  # excludes tokens served from the prompt cache
    e.prefill_seconds = prompt_s
    e.decode_tokens = predicted_n
    e.decode_seconds = predicted_s
    rate = v.rate(t.get("predicted_per_second"), "decode_rate")
    if rate is not None and predicted_n is not None and predicted_n >= 2:
        e.decode_tokens_per_second = rate
    out.engine = e


# --- precision and state ----------------------------------------------------------------------


def llamacpp_precision(props: object, model_entry: object) -> Precision | None:
    """``/props`` model_ftype, ``/v1/models`` meta.ftype, the GGUF type in the model path,
    else bits per weight from ``/v1/models`` meta."""
    props = props if isinstance(props, dict) else {}
    entry = model_entry if isinstance(model_entry, dict) else {}
    meta = entry.get("meta")
    meta = meta if isinstance(meta, dict) else {}
    for text in (props.get("model_ftype"), meta.get("ftype")):
        p = from_llama_ftype(text) if isinstance(text, str) else None
        if p is not None:
            return p
    for path in (props.get("model_path"), entry.get("id")):
        if isinstance(path, str):
            p = from_gguf_type(os.path.basename(path))
            if p is not None:
                return p
    return from_bits_per_weight(meta.get("size"), meta.get("n_params"))


async def gguf_kv_shape(props: object, model_dir: str | None) -> KVShape | None:
    """The KV shape from the GGUF file ``/props`` names, where the proxy can read it (the
    engine on this host, or the file under --model-dir by its name). None otherwise."""
    path = props.get("model_path") if isinstance(props, dict) else None
    if not isinstance(path, str) or not path.lower().endswith(".gguf"):
        return None
    candidates = [path]
    if model_dir:
        candidates.append(os.path.join(model_dir, os.path.basename(path)))
    for candidate in candidates:
        try:  # a header read (long arrays skipped): off the event loop all the same
            meta = await asyncio.to_thread(read_metadata, candidate)
        except FileNotFoundError:
            continue
        except (OSError, GGUFError) as exc:
            log.warning(
                "cannot read the GGUF metadata of the upstream's model; its KV-cache "
                "figures are unknown",
                extra={"fields": {"path": candidate[:300], "error": str(exc)[:200]}},
            )
            return None
        return from_gguf(meta)
    return None


_PATH_SHAPED = re.compile(r"^(?:/|\./|\.\./|~|[A-Za-z]:[\\/])|\\|/.*\.gguf$", re.IGNORECASE)


def file_label(model_id: str) -> str:
    """A model id as its label: a path-shaped one (llama-server without ``-a`` lists
    ``/home/me/models/qwen2.5-7b-instruct-q4_k_m.gguf``) by its file name, so series do
    not carry a local path; any other id unchanged."""
    if not _PATH_SHAPED.search(model_id):
        return model_id
    name = re.split(r"[\\/]", model_id.rstrip("/\\"))[-1]
    return name or model_id


def slots_state(slots: object) -> dict[str, float]:
    """Running requests and KV-cache use from llama-server's /slots."""
    if not isinstance(slots, list):
        return {}
    running = 0
    ctx = held = n = 0
    for slot in slots:
        if not isinstance(slot, dict):
            continue
        n += 1
        ctx += _count(slot.get("n_ctx"))
        if slot.get("is_processing"):
            running += 1
            held += _count(slot.get("n_prompt_tokens"))
            nxt = slot.get("next_token")
            if isinstance(nxt, list) and nxt and isinstance(nxt[0], dict):
                held += _count(nxt[0].get("n_decoded"))
    state = {"running": float(running)}
    if n:
        state["slots"] = float(n)  # -np: at most this many requests run at once
    if ctx:
        state["kv"] = min(1.0, held / ctx)
        state["kv_capacity"] = float(ctx)  # tokens: the slots' contexts together
    return state


def _count(value: object) -> int:
    """A count from an engine's JSON; anything odd (``"4096"``, null, -1) counts 0."""
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else 0
