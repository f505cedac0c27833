"""SGLang's server (``python -m sglang.launch_server``): OpenAI's wire format, plus what
SGLang adds.

Wire facts (tests/fixtures/wire/sglang/README.md): chat chunks carry every field, nulls
included (``"usage":null``, ``"matched_stop":null``), an optional vendor ``sglext`` object
and a top-level ``reasoning_tokens`` in usage; the finish reason rides on an event of its
own with an empty delta, and may be ``"abort"`` (the engine gave the request up: counted
as an error, ``midstream``); ``stream_options.continuous_usage_stats`` puts the usage so
far on every chunk (the tap keeps the last one: replaced, never added); an error after
the stream began is a ``data: {"error": ...}`` event inside the 200 stream, then
``data: [DONE]``. The native ``POST /generate`` streams ``data: {"text", "output_ids",
"meta_info"}`` events (``meta_info`` holds the counts) and ends with ``data: [DONE]``;
a whole answer is the same object (a list of them for a batch).

Recognised by ``GET /model_info`` (the deprecated ``/get_model_info``, which logs a warning
on every call, is asked only when the new name is missing). Precision from ``GET
/server_info`` (again before ``/get_server_info``): ``quantization``, else ``dtype``
unless it is ``auto``, else the checkpoint's config.json and the model name as for any
OpenAI server. Only those fields are read: ``server_info`` also carries the server's
``api_key``, which is never kept, logged or exported. Its own gauges come from
``/metrics``, served only with ``--enable-metrics`` (said once per upstream when it is
not). ``/health`` runs a one-token generation on an idle server (in the versions that
do): the idle health probe asks ``/v1/models`` instead.
"""

from __future__ import annotations

import json
import logging
from typing import TYPE_CHECKING, ClassVar

import httpx

from ..measure.precision import Precision, from_hf_config
from ..measure.sanity import Values
from ..measure.timeline import Marks
from .base import (
    EngineReading,
    ModelList,
    ModelQuery,
    Outcome,
    Prepared,
    Tap,
    error_message,
    loads,
    no_generation,
    settle,
)
from .framing import MAX_EVENT_BYTES
from .openai import OpenAIDialect
from .probe import get_json, read_bounded
from .prometheus import finite_gauges, read_metrics

if TYPE_CHECKING:
    from .probe import Prober

log = logging.getLogger(__name__)

GAUGES = {
    "sglang:num_running_reqs": "running",
    "sglang:num_queue_reqs": "waiting",
    "sglang:token_usage": "kv",
}
HISTOGRAMS = {
    "sglang:time_to_first_token_seconds": "ttft",
    "sglang:e2e_request_latency_seconds": "e2e",
    "sglang:queue_time_seconds": "queue",
}
#: The native generate endpoint's label.
GENERATE = "sglang_generate"

#: SGLang's ``--quantization`` names that a checkpoint's ``quant_method`` does not share.
_QUANTIZATION = {
    "w8a8_int8": Precision("int8", "W8A8", "engine"),
    "w8a8_fp8": Precision("fp8", "FP8", "engine"),
    "w4afp8": Precision("int4", "W4AFP8", "engine"),
    "qoq": Precision("int4", "QoQ", "engine"),
    "moe_wna16": Precision("int4", "WNA16", "engine"),
    "gguf": Precision("unknown", "GGUF", "engine"),
}

#: Upstreams (base URLs) already told that their /metrics is off: said once each.
_METRICS_OFF: set[str] = set()


class SGLangDialect(OpenAIDialect):
    name: ClassVar[str] = "sglang"
    #: It serves one model and answers a request naming any other with it.
    answers_any_model: ClassVar[bool] = True
    #: /health generates a token on an idle server: the cheap model list instead.
    health_path: ClassVar[str] = "/v1/models"
    #: From its route table (python/sglang/srt/entrypoints/http_server.py): weights,
    #: memory, caches, LoRA, profiling, sessions, aborting and pausing the engine.
    admin_paths: ClassVar[frozenset[str]] = frozenset(
        {
            "/flush_cache",
            "/clear_hicache_storage_backend",
            "/update_weights_from_disk",
            "/update_weights_from_tensor",
            "/update_weights_from_distributed",
            "/update_weights_from_ipc",
            "/update_weight_version",
            "/init_weights_update_group",
            "/destroy_weights_update_group",
            "/init_weights_send_group_for_remote_instance",
            "/send_weights_to_remote_instance",
            "/get_weights_by_name",
            "/release_memory_occupation",
            "/resume_memory_occupation",
            "/load_lora_adapter",
            "/unload_lora_adapter",
            "/start_profile",
            "/stop_profile",
            "/start_expert_distribution_record",
            "/stop_expert_distribution_record",
            "/dump_expert_distribution_record",
            "/freeze_gc",
            "/slow_down",
            "/set_internal_state",
            "/configure_logging",
            "/abort_request",
            "/pause_generation",
            "/continue_generation",
            "/open_session",
            "/close_session",
        }
    )
    busy_gauges: ClassVar[tuple[str, ...]] = ("sglang:num_running_reqs", "sglang:num_queue_reqs")
    generated_tokens: ClassVar[tuple[str, ...]] = ("sglang:generation_tokens_total",)
    endpoints: ClassVar[dict[str, str]] = {
        **OpenAIDialect.endpoints,
        "/generate": GENERATE,
        "/v1/rerank": "rerank",
        "/v1/score": "score",
    }
    whole_endpoints: ClassVar[frozenset[str]] = frozenset({"embeddings", "rerank", "score"})

    @staticmethod
    async def detect(probe: Prober) -> bool:
        for path in ("/model_info", "/get_model_info"):
            info = await probe.get_dict(path)
            if info is not None:
                return isinstance(info.get("model_path"), str) and "is_generation" in info
        models = await probe.get_dict("/v1/models")
        data = models.get("data") if models else None
        return isinstance(data, list) and any(
            isinstance(item, dict) and item.get("owned_by") == "sglang" for item in data
        )

    async def list_models(self, query: ModelQuery) -> ModelList | None:
        out = await super().list_models(query)
        if out is None or not out.precision:
            return out
        info = await server_info(query.client)
        said = info_precision(info) if info is not None else None
        if said is not None:
            for model in out.precision:
                out.precision[model] = said
        return out

    async def read_state(self, client: httpx.AsyncClient, models: set[str]) -> EngineReading | None:
        status, body = await read_bounded(client, "GET", "/metrics")
        if status == 404:
            u = client.base_url  # without any credentials it holds
            where = f"{u.scheme}://{u.host}{f':{u.port}' if u.port else ''}{u.path}"
            if where not in _METRICS_OFF and len(_METRICS_OFF) < 4096:
                _METRICS_OFF.add(where)
                log.info(
                    "SGLang serves no /metrics (started without --enable-metrics): its "
                    "running and waiting requests and KV-cache use are not read",
                    extra={"fields": {"upstream": where[:300]}},
                )
            return None
        if status != 200:
            return None
        return sglang_reading(body.decode("utf-8", "replace"), models)

    def listed_context(self, entry: dict) -> int | None:
        value = entry.get("max_model_len")
        return value if isinstance(value, int) and value > 0 else None

    # --- the native /generate -----------------------------------------------------------

    def endpoint(self, method: str, path: str) -> str | None:
        if path == "/generate" and method in ("POST", "PUT"):
            return GENERATE
        return super().endpoint(method, path)

    def prepare(
        self, endpoint: str, raw: bytes, inject_usage: bool, view: bytes | None = None
    ) -> Prepared | None:
        if endpoint != GENERATE:
            return super().prepare(endpoint, raw, inject_usage, view)
        try:
            obj = json.loads(raw if view is None else view)
        except (ValueError, UnicodeDecodeError, RecursionError):
            obj = None
        # meta_info carries the counts on every answer: nothing is injected
        stream = isinstance(obj, dict) and obj.get("stream") is True
        return Prepared(endpoint, None, stream, raw)

    def tap(
        self, content_type: str, marks: Marks, prepared: Prepared, limit: int = MAX_EVENT_BYTES
    ) -> Tap | None:
        if prepared.endpoint == GENERATE:
            if content_type.startswith("text/event-stream"):
                return GenerateTap(marks, limit)
            return None
        return super().tap(content_type, marks, prepared, limit)

    def outcome(self, tap: Tap | None, body: bytes | None, status: int) -> Outcome:
        if isinstance(tap, GenerateTap):
            return generate_outcome(tap, body, status)
        # (an OpenAI answer, the common case, is not parsed twice to ask)
        if tap is None and status < 400 and body and _maybe_native(body):
            obj = loads(body)
            items = obj if isinstance(obj, list) else [obj]
            if any(_generated(item) for item in items[:1024]):  # /generate, whole
                return generate_outcome(None, body, status)
            if isinstance(obj, list):  # /v1/rerank: a list of scores, nothing generated
                return Outcome(finished=True)
        out = super().outcome(tap, body, status)
        if "abort" in out.finish_reasons and out.error_kind is None:
            out.error_kind = "midstream"
            out.error_message = "the engine aborted the request (finish_reason abort)"
            out.finished = False
        return out


def _maybe_native(body: bytes) -> bool:
    """Whether a whole answer may be /generate's or a rerank's: a list, or ``meta_info``."""
    return body[:64].lstrip()[:1] == b"[" or body.find(b'"meta_info"') >= 0


def _generated(item: object) -> bool:
    """A native /generate answer: an object with ``meta_info`` and no OpenAI ``choices``."""
    return (
        isinstance(item, dict) and isinstance(item.get("meta_info"), dict) and "choices" not in item
    )


class GenerateTap(Tap):
    """The native /generate stream: every ``data:`` event carries the text so far and its
    ``meta_info`` (output, the last one kept for its counts); ``[DONE]`` ends it; an
    ``{"error": ...}`` event is the engine's failure."""

    __slots__ = ()

    def _event(self, ev: bytes, now: float) -> None:
        if ev[:1] == b":":
            return
        p = ev.find(b"data:")
        if p < 0:
            return
        payload = ev[p + 5 :].lstrip(b" ")
        if payload[:6] == b"[DONE]":
            self.done = True
        elif payload[:8] == b'{"error"' or payload[:9] == b'{ "error"':
            self.error_payload = payload
        elif payload.find(b'"meta_info"') >= 0:
            self._output(now)
            self.usage_payload = payload  # the counts so far: the last one stands


def generate_outcome(tap: Tap | None, body: bytes | None, status: int) -> Outcome:
    """What a /generate answer said: the counts of its ``meta_info`` (a batch's summed),
    its finish reason, and ``abort`` as an error."""
    out = Outcome()
    if status >= 400:
        out.error_kind = "upstream_status"
        out.error_message = error_message(loads(body)) if body else f"HTTP {status}"
        return out
    if tap is None and no_generation(status):
        out.finished = True
        return out
    obj = loads(tap.usage_payload if tap is not None else body)
    items = obj if isinstance(obj, list) else [obj]
    v = Values(out.dropped)
    prompt = completion = cached = 0
    seen = False
    reasons = []
    for item in items[:1024]:
        meta = item.get("meta_info") if isinstance(item, dict) else None
        if not isinstance(meta, dict):
            continue
        seen = True
        p = v.count(meta.get("prompt_tokens"), "prompt_tokens")
        c = v.count(meta.get("completion_tokens"), "completion_tokens")
        k = v.count(meta.get("cached_tokens"), "cached_tokens")
        prompt += p or 0
        completion += c or 0
        cached += k or 0
        reason = meta.get("finish_reason")
        kind = reason.get("type") if isinstance(reason, dict) else reason
        if isinstance(kind, str) and kind:
            reasons.append(kind[:64])
    if seen:
        out.usage.prompt_tokens, out.usage.completion_tokens = prompt, completion
        out.usage.cached_tokens = cached
    out.finish_reasons = tuple(reasons[:16])
    if tap is None:
        if not seen:
            out.error_kind, out.error_message = "protocol", "response has no meta_info"
            return out
        out.finished = True
    else:
        settle(tap, out, "[DONE]")
    if "abort" in reasons and out.error_kind is None:
        out.error_kind = "midstream"
        out.error_message = "the engine aborted the request (finish_reason abort)"
        out.finished = False
    return out


async def server_info(client: httpx.AsyncClient) -> dict | None:
    """The server's ``/server_info`` (``/get_server_info`` on versions before the rename):
    only the fields phasewatch reads, so its ``api_key`` is never held."""
    for path in ("/server_info", "/get_server_info"):
        try:
            status, obj = await get_json(client, "GET", path)
        except httpx.HTTPError:
            return None
        if status == 200 and isinstance(obj, dict):
            return {k: obj.get(k) for k in ("quantization", "dtype", "kv_cache_dtype", "version")}
        if status != 404:
            return None
    return None


def info_precision(info: dict) -> Precision | None:
    """Precision from ``server_info``: ``quantization`` (SGLang's ``--quantization``),
    else a ``dtype`` other than ``auto``; None when neither says (the checkpoint does)."""
    quant = info.get("quantization")
    if isinstance(quant, str) and quant:
        q = quant.strip().lower()
        p = _QUANTIZATION.get(q)
        if p is None:
            method = q.removesuffix("_marlin") if q.startswith(("awq", "gptq")) else q
            p = from_hf_config({"quantization_config": {"quant_method": method}})
        if p is not None:
            return p
    dtype = info.get("dtype")
    if isinstance(dtype, str) and dtype.lower() != "auto":
        return from_hf_config({"torch_dtype": dtype})
    return None


def sglang_reading(text: str, models: set[str]) -> EngineReading:
    """SGLang's gauges and histograms from its /metrics (one model per server: a sample
    naming none is that model's)."""
    only = next(iter(models)) if len(models) == 1 else None
    reading, _ = read_metrics(text, GAUGES, {}, HISTOGRAMS, model_label=only)
    finite_gauges(reading)
    return reading


__all__ = ["GENERATE", "GenerateTap", "SGLangDialect"]
