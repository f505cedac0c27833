"""Any OpenAI-compatible server: chat and text completions over OpenAI's wire format.

Wire facts (tests/fixtures/vllm-real, tests/fixtures/wire/README.md §3, §6):
- ``data: <json>\\n\\n`` events, ``data: [DONE]`` at the end, optional ``: keep-alive``.
- Usage only with ``stream_options.include_usage``. Injecting it adds one
  ``"choices":[]`` usage event, which :class:`~proxy.engines.sse.SSETap` strips again.
- Mid-stream errors are ``data: {"error": ...}`` events.

Recognised as the fallback: anything serving ``GET /v1/models``. Models come from
``/v1/models``; precision from the checkpoint's ``config.json`` where ``--model-dir``
makes it readable, else from the model id or its ``root`` path.
"""

from __future__ import annotations

import glob
import json
import os
from typing import TYPE_CHECKING, ClassVar

import httpx

from ..measure import kvcache
from ..measure.kvcache import KVShape
from ..measure.precision import Precision, from_hf_config, from_name
from ..measure.sanity import Values
from ..measure.timeline import Marks
from .base import (
    EngineReading,
    Listing,
    ModelList,
    ModelQuery,
    Outcome,
    Prepared,
    Tap,
    Tokenizer,
    canonical_name,
    error_message,
    loads,
    no_generation,
    read_response,
    settle,
)
from .framing import MAX_EVENT_BYTES
from .probe import get_json
from .sse import SSETap

if TYPE_CHECKING:
    from .probe import Prober


class OpenAIDialect:
    """Chat and text completions over OpenAI's wire format."""

    name: ClassVar[str] = "openai"
    answers_any_model: ClassVar[bool] = False
    kv_default_dtype: ClassVar[str | None] = None
    busy_gauges: ClassVar[tuple[str, ...]] = ()
    generated_tokens: ClassVar[tuple[str, ...]] = ()
    #: Whether ``"stream_options":{}`` means include_usage=true (vLLM) or false (OpenAI).
    empty_stream_options_is_usage: ClassVar[bool] = False
    #: A cheap GET that says whether the engine answers (the health probe of an idle
    #: upstream; its body is not read).
    health_path: ClassVar[str] = "/v1/models"
    #: Paths (and what is under them) that manage the engine's models rather than use
    #: them: refused or allowed by --admin-api. A generic server has none known.
    admin_paths: ClassVar[frozenset[str]] = frozenset()
    admin_reads: ClassVar[frozenset[str]] = frozenset()
    unload_fields: ClassVar[dict[str, str]] = {}
    endpoints: ClassVar[dict[str, str]] = {
        "/v1/chat/completions": "chat",
        "/v1/completions": "completions",
        "/v1/embeddings": "embeddings",
    }
    #: Measured endpoints whose answer is one whole body (no tokens generated): counted,
    #: timed and their prompt tokens read, never tapped as a stream.
    whole_endpoints: ClassVar[frozenset[str]] = frozenset({"embeddings"})
    #: A generic server has no API of its own beside OpenAI's.
    native_prefix: ClassVar[str | None] = None
    #: OpenAI's model list (``/models``: the same list, as clients with a ``/v1`` base
    #: URL of their own ask it), merged by model id.
    model_lists: ClassVar[dict[str, Listing]] = {
        path: Listing("/v1/models", "data", "id", (("object", "list"),))
        for path in ("/v1/models", "/models")
    }
    model_fields: ClassVar[tuple[str, ...]] = ("model",)

    # --- recognising it, its models and their precision (off the request path) ---------

    @staticmethod
    async def detect(probe: Prober) -> bool:
        return await probe.get_dict("/v1/models") is not None

    def canonical(self, model: str, listed: set[str]) -> str | None:
        return canonical_name(model, listed)

    async def list_models(self, query: ModelQuery) -> ModelList | None:
        try:
            status, obj = await get_json(query.client, "GET", "/v1/models")
        except httpx.HTTPError:
            return None
        if status != 200 or not isinstance(obj, dict):
            return None
        out = ModelList([])
        items = obj.get("data")
        for item in items if isinstance(items, list) else ():
            if (
                isinstance(item, dict)
                and isinstance(item.get("id"), str)
                and query.fits(item["id"])
            ):
                mid = item["id"]
                out.names.append(mid)
                # every name routes; only the first max_models are read in detail
                if mid not in query.known and len(out.names) <= query.max_models:
                    root = item.get("root") if isinstance(item.get("root"), str) else None
                    out.precision[mid] = openai_precision(mid, root, query.model_dir)
                    out.kv[mid] = openai_kv_shape(mid, root, query.model_dir)
        return out

    async def read_state(self, client: httpx.AsyncClient, models: set[str]) -> EngineReading | None:
        return None  # a generic OpenAI-compatible server exports no known gauges

    async def tokenizer(self, client: httpx.AsyncClient, model: str) -> Tokenizer | None:
        return None  # OpenAI's API has no tokenizer endpoint

    def listed_context(self, entry: dict) -> int | None:
        return None

    async def served_file(self, client: httpx.AsyncClient) -> str | None:
        return None

    # --- the request path ---------------------------------------------------------------

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

    def prepare(
        self, endpoint: str, raw: bytes, inject_usage: bool, view: bytes | None = None
    ) -> Prepared | None:
        try:
            obj = json.loads(raw if view is None else view)
        except (ValueError, UnicodeDecodeError, RecursionError):
            obj = None
        if not isinstance(obj, dict):  # the engine answers malformed input itself
            return Prepared(endpoint, None, False, raw)
        model = obj.get("model")
        model = model if isinstance(model, str) else None
        if endpoint in self.whole_endpoints:
            return Prepared(endpoint, model, False, raw)
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
            # where the object closes, trailing whitespace aside (found, not stripped:
            # stripping would copy a body that may be large)
            end = len(raw)
            while end and raw[end - 1] in b" \t\r\n":
                end -= 1
            if end and raw[end - 1] == 0x7D:  # }
                # (an empty object is short: a large body is never copied to ask)
                empty = end <= 64 and raw[: end - 1].strip() == b"{"
                sep = b"" if empty else b","
                # the field added after a view of the body, not in a copy of it
                prepared.body = memoryview(raw)[: end - 1]
                prepared.tail = sep + b'"stream_options":{"include_usage":true}}'
                prepared.strip_usage = True
        elif (
            view is None  # the whole object is at hand (a large body's is not rewritten)
            and isinstance(options, dict)
            and options.get("include_usage") is False
            and not options.get("continuous_usage_stats")
        ):
            obj["stream_options"] = {**options, "include_usage": True}
            prepared.body = json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode()
            prepared.strip_usage = True
        return prepared

    def stream_error(self, message: str, endpoint: str = "") -> bytes:
        """A well-formed error event to end a stream the upstream broke off."""
        err = {"error": {"message": message, "type": "upstream_error", "param": None, "code": 502}}
        return b"data: " + json.dumps(err).encode() + b"\n\n"

    def error_body(
        self, status: int, message: str, kind: str, path: str = ""
    ) -> tuple[bytes, bytes]:
        """(content type, body) of an error the proxy itself answers on `path` with."""
        err = {"error": {"message": message, "type": kind, "param": None, "code": status}}
        return b"application/json", json.dumps(err).encode()

    def tap(
        self, content_type: str, marks: Marks, prepared: Prepared, limit: int = MAX_EVENT_BYTES
    ) -> Tap | None:
        if prepared.endpoint in self.whole_endpoints:
            return None
        if content_type.startswith("text/event-stream"):
            return SSETap(marks, strip=prepared.strip_usage, limit=limit)
        return None

    def outcome(self, tap: Tap | None, body: bytes | None, status: int) -> Outcome:
        out = Outcome()
        if status >= 400:
            out.error_kind = "upstream_status"
            out.error_message = error_message(loads(body)) if body else f"HTTP {status}"
            return out
        if tap is None and no_generation(status):
            out.finished = True
            return out
        if tap is None:  # whole JSON body
            obj = loads(body)
            if not isinstance(obj, dict):
                out.error_kind, out.error_message = "protocol", "response is not JSON"
                return out
            self._read_usage(obj, out)
            read_response(obj, out)
            if "choices" not in obj:  # embeddings, rerank, score: nothing was generated
                out.usage.completion_tokens = None
            out.finished = True
            return out
        obj = loads(tap.usage_payload)
        if isinstance(obj, dict):
            self._read_usage(obj, out)
            read_response(obj, out)
        finish = loads(tap.finish_payload)
        if isinstance(finish, dict):
            read_response(finish, out)
        return settle(tap, out, "[DONE]")

    @staticmethod
    def _read_usage(obj: dict, out: Outcome) -> None:
        """The usage object's counts; implausible ones are dropped (proxy.measure.sanity)."""
        u = obj.get("usage")
        if not isinstance(u, dict):
            return
        v, usage = Values(out.dropped), out.usage
        usage.prompt_tokens = v.count(u.get("prompt_tokens"), "prompt_tokens")
        usage.completion_tokens = v.count(u.get("completion_tokens"), "completion_tokens")
        if u.get("prompt_tokens") is None and u.get("completion_tokens") is None:
            # pooling answers (vLLM's rerank) count only total_tokens: all of them input
            usage.prompt_tokens = v.count(u.get("total_tokens"), "total_tokens")
        details = u.get("prompt_tokens_details")
        if isinstance(details, dict):
            usage.cached_tokens = v.count(details.get("cached_tokens"), "cached_tokens")


# --- precision from the checkpoint ----------------------------------------------------------


def read_model_config(model_dir: str | None, model_id: str, root: str | None) -> dict | None:
    """The checkpoint's ``config.json`` where ``--model-dir`` makes it readable."""
    if not model_dir:
        return None
    candidates = []
    if root and os.path.isabs(root):
        candidates.append(root)
    for name in (model_id, root or ""):
        if name:
            candidates.append(os.path.join(model_dir, name))
            candidates.append(os.path.join(model_dir, os.path.basename(name.rstrip("/"))))
            hub = os.path.join(
                model_dir, "models--" + name.strip("/").replace("/", "--"), "snapshots"
            )
            candidates.extend(sorted(glob.glob(os.path.join(hub, "*")), reverse=True))
    for folder in candidates:
        path = os.path.join(folder, "config.json")
        try:
            with open(path, encoding="utf-8") as f:
                obj = json.load(f)
        except (OSError, ValueError):
            continue
        if isinstance(obj, dict):
            return obj
    return None


def openai_kv_shape(model_id: str, root: str | None, model_dir: str | None) -> KVShape | None:
    """The KV-cache shape from the checkpoint's config.json, where --model-dir makes it
    readable (None otherwise: vLLM's API does not say)."""
    config = read_model_config(model_dir, model_id, root)
    return kvcache.from_hf_config(config) if config is not None else None


def openai_precision(model_id: str, root: str | None, model_dir: str | None) -> Precision | None:
    """config.json when readable, else the id, else the root path (``/models/x-AWQ``)."""
    config = read_model_config(model_dir, model_id, root)
    p = from_hf_config(config) if config is not None else None
    if p is not None:
        return p
    p = from_name(model_id)
    if p is None and root:
        p = from_name(root)
    return p
