"""vLLM's OpenAI server: the OpenAI wire format, plus what vLLM adds.

Wire facts (tests/fixtures/vllm-real): the first chat event is role-only
(``"content":""``), not a token; ``"stream_options":{}`` means include_usage=true; with
usage injected, vLLM 0.32+ moves ``system_fingerprint`` from the finish event to the usage
event (the SSE tap puts it back).

Recognised by its models' ``owned_by: "vllm"``, or by ``GET /version``. Its own gauges
come from ``/metrics``: ``vllm:num_requests_running``, ``vllm:num_requests_waiting`` and
``vllm:kv_cache_usage_perc`` (v0 engine: ``vllm:gpu_cache_usage_perc``), per ``model_name``;
the KV cache's size (``num_gpu_blocks × block_size`` tokens) and element type
(``cache_dtype``; ``auto`` is the model's own dtype) from ``vllm:cache_config_info``; and
its own preemption and prefix-cache counters and TTFT / end-to-end / time-per-output-token
histograms, re-exported beside phasewatch's as they are.

Besides generation it serves whole-body pooling endpoints: embeddings, rerank, score,
classify, pooling. Its tokenizer is ``POST /tokenize`` with chat messages: it applies the
model's chat template and answers the ``count`` and the model's ``max_model_len``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar

import httpx

from ..measure.kvcache import kv_dtype
from .base import EngineReading
from .openai import OpenAIDialect
from .probe import read_bounded
from .prometheus import read_metrics

if TYPE_CHECKING:
    from .probe import Prober

GAUGES = {
    "vllm:num_requests_running": "running",
    "vllm:num_requests_waiting": "waiting",
    "vllm:kv_cache_usage_perc": "kv",
    "vllm:gpu_cache_usage_perc": "kv",
}
COUNTERS = {
    "vllm:num_preemptions": "preemptions",
    "vllm:prefix_cache_queries": "prefix_cache_queries",
    "vllm:prefix_cache_hits": "prefix_cache_hits",
}
HISTOGRAMS = {
    "vllm:time_to_first_token_seconds": "ttft",
    "vllm:e2e_request_latency_seconds": "e2e",
    "vllm:request_time_per_output_token_seconds": "tpot",
    "vllm:request_queue_time_seconds": "queue",
}
CACHE_CONFIG = "vllm:cache_config_info"

#: Pooling endpoints (whole JSON bodies, prompt tokens only).
POOLING = {
    "/v1/embeddings": "embeddings",
    "/v1/rerank": "rerank",
    "/v2/rerank": "rerank",
    "/rerank": "rerank",
    "/v1/score": "score",
    "/score": "score",
    "/classify": "classify",
    "/pooling": "pooling",
}


class VLLMDialect(OpenAIDialect):
    name: ClassVar[str] = "vllm"
    health_path: ClassVar[str] = "/health"
    #: Runtime LoRA loading (VLLM_ALLOW_RUNTIME_LORA_UPDATING) changes the model list;
    #: the rest act on the whole engine: profiling, the dev-mode cache resets, sleep and
    #: collective RPC (VLLM_SERVER_DEV_MODE), RLHF's pause and weight updates, and elastic
    #: expert-parallel scaling.
    admin_paths: ClassVar[frozenset[str]] = frozenset(
        {
            "/v1/load_lora_adapter",
            "/v1/unload_lora_adapter",
            "/start_profile",
            "/stop_profile",
            "/reset_prefix_cache",
            "/reset_mm_cache",
            "/reset_encoder_cache",
            "/sleep",
            "/wake_up",
            "/collective_rpc",
            "/pause",
            "/resume",
            "/init_weight_transfer_engine",
            "/start_weight_update",
            "/update_weights",
            "/finish_weight_update",
            "/scale_elastic_ep",
            "/is_scaling_elastic_ep",
        }
    )
    empty_stream_options_is_usage: ClassVar[bool] = True
    busy_gauges: ClassVar[tuple[str, ...]] = (
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
    )
    generated_tokens: ClassVar[tuple[str, ...]] = ("vllm:generation_tokens_total",)
    endpoints: ClassVar[dict[str, str]] = {**OpenAIDialect.endpoints, **POOLING}
    whole_endpoints: ClassVar[frozenset[str]] = frozenset(POOLING.values())

    @staticmethod
    async def detect(probe: Prober) -> bool:
        models = await probe.get_dict("/v1/models")
        data = models.get("data") if models else None
        for item in data if isinstance(data, list) else ():
            if isinstance(item, dict) and item.get("owned_by") == "vllm":
                return True
        version = await probe.get_dict("/version")
        return version is not None and isinstance(version.get("version"), str)

    async def read_state(self, client: httpx.AsyncClient, models: set[str]) -> EngineReading | None:
        status, body = await read_bounded(client, "GET", "/metrics")
        if status != 200:
            return None
        return vllm_reading(body.decode("utf-8", "replace"), models)

    async def tokenizer(self, client: httpx.AsyncClient, model: str) -> VLLMTokenizer | None:
        try:
            resp = await client.post("/tokenize", json=_chat(model, "hello world"))
            data = resp.json() if resp.status_code == 200 else None
        except (httpx.HTTPError, ValueError):
            data = None
        if isinstance(data, dict) and isinstance(data.get("count"), int):
            return VLLMTokenizer(client, model, data.get("max_model_len"))
        return None

    def listed_context(self, entry: dict) -> int | None:
        value = entry.get("max_model_len")
        return value if isinstance(value, int) and value > 0 else None


def _chat(model: str, text: str) -> dict:
    return {"model": model, "messages": [{"role": "user", "content": text}]}


class VLLMTokenizer:
    """vLLM's ``POST /tokenize`` of a one-message chat (the template applied)."""

    def __init__(self, client: httpx.AsyncClient, model: str, max_model_len: int | None) -> None:
        self.client, self.model, self.max_model_len = client, model, max_model_len

    async def count(self, text: str) -> int:
        resp = await self.client.post("/tokenize", json=_chat(self.model, text))
        return resp.json()["count"]


def vllm_reading(text: str, models: set[str]) -> EngineReading:
    """vLLM's gauges, counters, histograms and KV-cache configuration from its /metrics.
    ``cache_config_info`` names no model: with one served model (one engine per model,
    as vLLM runs) it is that model's."""
    only = next(iter(models)) if len(models) == 1 else None
    reading, infos = read_metrics(
        text, GAUGES, COUNTERS, HISTOGRAMS, infos=frozenset({CACHE_CONFIG})
    )
    for labels in infos.get(CACHE_CONFIG, ()):
        model = labels.get("model_name", only)
        if model is None:
            continue
        blocks, size = _int(labels.get("num_gpu_blocks")), _int(labels.get("block_size"))
        if blocks and size:
            gauges = reading.gauges.setdefault(model, {})
            gauges["kv_capacity"] = gauges.get("kv_capacity", 0.0) + float(blocks * size)
        raw = labels.get("cache_dtype")
        dtype = "auto" if raw == "auto" else kv_dtype(raw)  # auto: the model's own dtype
        if dtype is not None:
            reading.kv_dtype[model] = dtype
    return reading


def _int(text: str | None) -> int | None:
    """A plain decimal count of at most 12 digits (a label value is the engine's text)."""
    if text is None or not (text.isascii() and text.isdigit() and len(text) <= 12):
        return None
    return int(text)
