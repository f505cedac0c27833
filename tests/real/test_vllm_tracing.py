"""A real vLLM started with ``--otlp-traces-endpoint`` and phasewatch with ``--otel``, both
exporting to one OTLP/HTTP receiver in the test: vLLM's own span of the request lands in
the client's trace, under phasewatch's span, because phasewatch sent it the trace context
in `traceparent`.
"""

from __future__ import annotations

import secrets

import openai
import pytest

from ..support.otlp_receiver import Receiver
from ..support.servers import start_proxy
from . import engines as E
from .engines import VLLM_MODEL

pytestmark = pytest.mark.real_engine


@pytest.fixture(scope="module")
def traced_vllm(engines_manifest):
    receiver = Receiver()
    servers = []
    try:
        with pytest.MonkeyPatch.context() as mp:
            # vLLM exports over gRPC unless told otherwise; the receiver speaks OTLP/HTTP
            mp.setenv("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "http/protobuf")
            mp.setenv("OTEL_BSP_SCHEDULE_DELAY", "100")
            try:
                vllm = E.start_vllm(
                    engines_manifest,
                    extra=["--otlp-traces-endpoint", receiver.endpoint + "/v1/traces"],
                )
            except E.EnginesMissing as exc:
                pytest.fail(str(exc), pytrace=False)
        servers.append(vllm)
        proxy = start_proxy(
            f"vllm={vllm.url}",
            args=["--otel"],
            env={
                "OTEL_EXPORTER_OTLP_ENDPOINT": receiver.endpoint,
                "OTEL_BSP_SCHEDULE_DELAY": "50",
                "OTEL_METRICS_EXPORTER": "none",
                "OTEL_SERVICE_NAME": "phasewatch-real",
            },
        )
        servers.append(proxy)
        yield receiver, vllm, proxy
    finally:
        for s in reversed(servers):
            s.stop()
        receiver.stop()


def test_vllm_spans_land_under_phasewatchs(traced_vllm):
    receiver, _, proxy = traced_vllm
    trace_id, client_span = secrets.token_hex(16), secrets.token_hex(8)
    client = openai.OpenAI(base_url=proxy.url + "/v1", api_key="unused", max_retries=0)
    stream = client.chat.completions.create(
        model=VLLM_MODEL,
        messages=[{"role": "user", "content": "hello world"}],
        max_tokens=8,
        temperature=0,
        stream=True,
        extra_headers={"traceparent": f"00-{trace_id}-{client_span}-01"},
    )
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices)

    def both(spans):
        mine = [s for s in spans if s["trace_id"] == trace_id]
        return any(
            s["service"] == "phasewatch-real" and s["kind"] == "SPAN_KIND_SERVER" for s in mine
        ) and any(s["service"] != "phasewatch-real" for s in mine)

    spans = [s for s in receiver.wait_spans(both, timeout=120) if s["trace_id"] == trace_id]
    (ours,) = [
        s for s in spans if s["service"] == "phasewatch-real" and s["kind"] == "SPAN_KIND_SERVER"
    ]
    theirs = [s for s in spans if s["service"] != "phasewatch-real"]
    assert ours["parent_span_id"] == client_span
    # vLLM's request span is a child of phasewatch's, begun after phasewatch had the request
    engine = [s for s in theirs if s["parent_span_id"] == ours["span_id"]]
    assert engine, (ours, theirs)
    span = engine[0]
    assert span["name"] == "llm_request"
    assert ours["start"] <= span["start"]
    # both count the same tokens
    assert (
        span["attributes"]["gen_ai.usage.completion_tokens"]
        == ours["attributes"]["gen_ai.usage.output_tokens"]
    )
    assert (
        span["attributes"]["gen_ai.usage.prompt_tokens"]
        == ours["attributes"]["gen_ai.usage.input_tokens"]
    )
