"""vLLM's OpenAI server: the OpenAI wire format, plus what vLLM adds.

Wire facts (tests/fixtures/vllm-real): the first chat event is role-only
(``"content":""``), not a token; ``"stream_options":{}`` means include_usage=true; with
usage injected, vLLM 0.32+ moves ``system_fingerprint`` from the finish event to the usage
event (the SSE tap puts it back).

Recognised by its models' ``owned_by: "vllm"``, or by ``GET /version``. Its own gauges
come from ``/metrics``: ``vllm:num_requests_running``, ``vllm:num_requests_waiting`` and
``vllm:kv_cache_usage_perc`` (v0 engine: ``vllm:gpu_cache_usage_perc``), per ``model_name``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar

import httpx

from .base import EngineState
from .openai import OpenAIDialect
from .probe import read_bounded
from .prometheus import parse_prometheus

if TYPE_CHECKING:
    from .probe import Prober

GAUGES = {
    "vllm:num_requests_running": "running",
    "vllm:num_requests_waiting": "waiting",
    "vllm:kv_cache_usage_perc": "kv",
    "vllm:gpu_cache_usage_perc": "kv",
}


class VLLMDialect(OpenAIDialect):
    name: ClassVar[str] = "vllm"
    empty_stream_options_is_usage: ClassVar[bool] = True

    @staticmethod
    async def detect(probe: Prober) -> bool:
        models = await probe.get_dict("/v1/models")
        data = models.get("data") if models else None
        for item in data if isinstance(data, list) else ():
            if isinstance(item, dict) and item.get("owned_by") == "vllm":
                return True
        version = await probe.get_dict("/version")
        return version is not None and isinstance(version.get("version"), str)

    async def read_state(self, client: httpx.AsyncClient, models: set[str]) -> EngineState | None:
        status, body = await read_bounded(client, "GET", "/metrics")
        if status != 200:
            return None
        return parse_prometheus(body.decode("utf-8", "replace"), GAUGES)
