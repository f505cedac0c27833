"""TensorRT-LLM's OpenAI server (``trtllm-serve``): OpenAI's wire format, plus what it adds.

Wire facts (tests/fixtures/wire/trtllm/README.md): chat and completion chunks are
pydantic dumps without the null fields; usage only with ``stream_options.include_usage``
(every chunk with ``continuous_usage_stats``); ``data: [DONE]`` at the end.

Recognised by its models' ``owned_by: "tensorrt_llm"``. Its ``/metrics`` is a JSON list of
iteration stats; the Prometheus text is at ``/prometheus/metrics`` (with
``return_perf_metrics``): ``trtllm_num_requests_running`` / ``_waiting``,
``trtllm_kv_cache_utilization``, the KV cache's size (``trtllm_kv_cache_max_blocks`` ×
``trtllm_kv_cache_tokens_per_block``), its own TTFT / end-to-end / time-per-output-token /
queue histograms, and ``trtllm_model_config_info``, whose ``quantization`` and ``dtype``
labels are the model's precision. ``/health`` asks the executor (cheap);
``/health_generate`` generates. Its ``/energy_metrics`` (the GPUs' NVML energy,
server-wide, where its energy monitor runs) is re-exported as a cross-check of the energy
phasewatch reads from the GPUs itself, never in its place.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, ClassVar

import httpx

from ..measure.precision import Precision, from_hf_config
from .base import EngineReading, ModelList, ModelQuery
from .openai import OpenAIDialect
from .probe import TooLarge, get_json, read_bounded
from .prometheus import finite_gauges, read_metrics

if TYPE_CHECKING:
    from .probe import Prober

METRICS_PATH = "/prometheus/metrics"
GAUGES = {
    "trtllm_num_requests_running": "running",
    "trtllm_num_requests_waiting": "waiting",
    "trtllm_kv_cache_utilization": "kv",
    "trtllm_kv_cache_max_blocks": "_blocks",
    "trtllm_kv_cache_tokens_per_block": "_block_size",
}
HISTOGRAMS = {
    "trtllm_time_to_first_token_seconds": "ttft",
    "trtllm_e2e_request_latency_seconds": "e2e",
    "trtllm_time_per_output_token_seconds": "tpot",
    "trtllm_request_queue_time_seconds": "queue",
}
MODEL_CONFIG = "trtllm_model_config_info"


class TRTLLMDialect(OpenAIDialect):
    name: ClassVar[str] = "trtllm"
    health_path: ClassVar[str] = "/health"
    #: RL-only weight and memory control, and the KV-cache event drain (its events are
    #: consumed by whoever asks).
    admin_paths: ClassVar[frozenset[str]] = frozenset(
        {"/release_memory", "/resume_memory", "/update_weights", "/kv_cache_events"}
    )
    busy_gauges: ClassVar[tuple[str, ...]] = (
        "trtllm_num_requests_running",
        "trtllm_num_requests_waiting",
    )
    generated_tokens: ClassVar[tuple[str, ...]] = ("trtllm_generation_tokens_total",)

    @staticmethod
    async def detect(probe: Prober) -> bool:
        models = await probe.get_dict("/v1/models")
        data = models.get("data") if models else None
        return isinstance(data, list) and any(
            isinstance(item, dict) and item.get("owned_by") == "tensorrt_llm" for item in data
        )

    async def list_models(self, query: ModelQuery) -> ModelList | None:
        out = await super().list_models(query)
        if out is None or not out.precision:
            return out
        said = await self._config_precision(query.client, set(out.names))
        for model in out.precision:
            if model in said:
                out.precision[model] = said[model]
        return out

    async def _config_precision(
        self, client: httpx.AsyncClient, models: set[str]
    ) -> dict[str, Precision]:
        """{model: precision} from ``trtllm_model_config_info`` (a sample naming no model is
        the one served model's)."""
        try:
            status, body = await read_bounded(client, "GET", METRICS_PATH)
        except (httpx.HTTPError, TooLarge):
            return {}
        if status != 200:
            return {}
        try:
            _, infos = read_metrics(
                body.decode("utf-8", "replace"), {}, infos=frozenset({MODEL_CONFIG})
            )
        except ValueError:  # not Prometheus text
            return {}
        only = next(iter(models)) if len(models) == 1 else None
        out: dict[str, Precision] = {}
        for labels in infos.get(MODEL_CONFIG, ()):
            model = labels.get("model_name") or labels.get("model") or only
            if model not in models:
                model = only
            p = config_precision(labels.get("quantization"), labels.get("dtype"))
            if model is not None and p is not None:
                out[model] = p
        return out

    async def read_state(self, client: httpx.AsyncClient, models: set[str]) -> EngineReading | None:
        status, body = await read_bounded(client, "GET", METRICS_PATH)
        if status != 200:
            return None
        reading = trtllm_reading(body.decode("utf-8", "replace"), models)
        if len(models) == 1:  # the server's energy is its one model's
            joules = await energy_joules(client)
            if joules is not None:
                reading.counters.setdefault(next(iter(models)), {})["energy_joules"] = joules
        return reading


async def energy_joules(client: httpx.AsyncClient) -> float | None:
    """``/energy_metrics`` ``total_energy_j``: the server's GPUs' energy by NVML, where
    its energy monitor runs (503 otherwise); None when it does not say."""
    try:
        status, obj = await get_json(client, "GET", "/energy_metrics")
    except httpx.HTTPError:
        return None
    value = obj.get("total_energy_j") if status == 200 and isinstance(obj, dict) else None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value) if math.isfinite(value) and value >= 0 else None


def config_precision(quantization: str | None, dtype: str | None) -> Precision | None:
    """Precision from ``trtllm_model_config_info``: its ``quantization`` (a QuantAlgo name:
    ``FP8``, ``NVFP4``, ``W4A16_AWQ`` ...), else its ``dtype``."""
    q = (quantization or "").strip().upper()
    if q and q not in ("NONE", "NO_QUANT", "NULL"):
        if "FP4" in q:
            return Precision("fp4", "NVFP4" if "NVFP4" in q else q, "engine")
        if q.startswith("W4"):
            return Precision("int4", q, "engine")
        if q.startswith(("W8", "INT8")):
            return Precision("int8", q, "engine")
        if "FP8" in q:
            return Precision("fp8", "FP8", "engine")
        if q == "MIXED_PRECISION":
            return Precision("unknown", q, "engine")
    if dtype and dtype.lower() != "auto":
        return from_hf_config({"torch_dtype": dtype})
    return None


def trtllm_reading(text: str, models: set[str]) -> EngineReading:
    """trtllm-serve's gauges and histograms from its Prometheus text, per ``model_name``
    (one model per server: a sample naming none is that model's), the KV cache's size in
    tokens from its blocks."""
    only = next(iter(models)) if len(models) == 1 else None
    reading, _ = read_metrics(text, GAUGES, {}, HISTOGRAMS, model_label=only)
    finite_gauges(reading)
    for values in reading.gauges.values():
        blocks, size = values.pop("_blocks", None), values.pop("_block_size", None)
        if blocks and size and blocks > 0 and size > 0:
            values["kv_capacity"] = blocks * size
    return reading


__all__ = ["TRTLLMDialect", "config_precision", "trtllm_reading"]
