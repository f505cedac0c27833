"""The engine's own count of what it runs, read for the energy ledger: only the busy
gauges' lines of its /metrics, the dialect's whole read where /metrics lacks them, one
line where the engine gives no count, and nothing read while power is not sampled."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import httpx

from proxy.engines.llamacpp import LlamaCppDialect
from proxy.engines.ollama import OllamaDialect
from proxy.engines.vllm import VLLMDialect
from proxy.measure.metrics import Metrics
from proxy.services.engine_state import EngineCounts

VLLM_PAGE = """# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 3.0
vllm:num_requests_running{engine="1",model_name="m"} 1.0
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="m"} 2.0
vllm:num_requests_waiting_by_reason{engine="0",model_name="m",reason="capacity"} 9.0
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.5
"""


def upstream(dialect, handler, models=("m",)) -> tuple[SimpleNamespace, list[str]]:
    asked: list[str] = []

    def record(request: httpx.Request) -> httpx.Response:
        asked.append(str(request.url.raw_path, "ascii"))
        return handler(request)

    client = httpx.AsyncClient(transport=httpx.MockTransport(record), base_url="http://e")
    u = SimpleNamespace(
        name="u",
        engine=dialect.name,
        up=True,
        dialect=dialect,
        client=client,
        models=set(models),
        model_label=lambda m: m,
    )
    return u, asked


async def test_vllm_is_read_from_its_busy_gauges_lines():
    u, asked = upstream(VLLMDialect(), lambda r: httpx.Response(200, text=VLLM_PAGE))
    metrics = Metrics()
    counts = EngineCounts(metrics, lambda: 0.1)
    await counts.read(u)
    got = counts.of(u, "m")
    assert got is not None and got[0] == 6.0  # 3 + 1 running (two cores) + 2 waiting
    assert got[1] <= got[2]
    assert counts.of(u, "other-model") is not None and counts.of(u, "other-model")[0] == 0
    assert asked[0].startswith("/metrics?name")
    assert metrics.registry.get_sample_value("phasewatch_power_engine_count_up", {"upstream": "u"})


async def test_llama_server_without_metrics_is_read_from_its_slots():
    slots = [{"id": 0, "is_processing": True}, {"id": 1, "is_processing": False}]

    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/metrics":
            return httpx.Response(501, text="metrics are disabled")
        return httpx.Response(200, json=slots)

    u, asked = upstream(LlamaCppDialect(), handler)
    counts = EngineCounts(Metrics(), lambda: 0.1)
    await counts.read(u)
    await counts.read(u)
    assert counts.of(u, None) is not None and counts.of(u, None)[0] == 1.0
    assert asked == ["/metrics?name[]=llamacpp:requests_processing&name[]=llamacpp:requests_deferred",
                     "/slots", "/slots"]  # fmt: skip


async def test_an_engine_with_no_count_is_said_once(caplog):
    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/api/ps":
            return httpx.Response(200, json={"models": []})
        return httpx.Response(404)

    u, _ = upstream(OllamaDialect(), handler)
    metrics = Metrics()
    counts = EngineCounts(metrics, lambda: 0.1)
    with caplog.at_level(logging.INFO):
        for _ in range(3):
            await counts.read(u)
    said = [r for r in caplog.records if "gives no count" in r.getMessage()]
    assert len(said) == 1
    assert counts.of(u, None) is None
    labels = {"upstream": "u"}
    assert metrics.registry.get_sample_value("phasewatch_power_engine_count_up", labels) == 0


async def test_nothing_is_read_while_power_is_not_sampled():
    u, asked = upstream(VLLMDialect(), lambda r: httpx.Response(200, text=VLLM_PAGE))
    counts = EngineCounts(Metrics(), lambda: 0.1, wanted=lambda: False)
    await counts.read(u)
    assert asked == [] and counts.of(u, "m") is None
    assert counts.interval() == 0.1
    slow = EngineCounts(Metrics(), lambda: 30.0)
    assert slow.interval() == 1.0  # never slower than a second, never faster than 0.1 s
