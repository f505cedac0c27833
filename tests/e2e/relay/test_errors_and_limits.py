"""Unreachable engines, broken streams, the admission gate and bounded labels."""

from __future__ import annotations

import asyncio
import concurrent.futures
import json

import httpx
import openai
import pytest

from ...support.fake_engine import SSE_HEAD, FakeEngine, Request, chunk
from ...support.servers import free_port, metric_samples, sample, start_proxy, start_sim, wait_for

MODEL = "hugging-quants/Llama-3.1-8B-Instruct-AWQ-INT4"


def test_unreachable_upstream_is_a_clear_502():
    dead = f"http://127.0.0.1:{free_port()}"
    proxy = start_proxy(f"dead={dead}")
    try:
        resp = httpx.post(
            proxy.url + "/v1/chat/completions", json={"model": "m", "messages": [], "stream": True}
        )
        assert resp.status_code == 502
        err = resp.json()["error"]
        assert "unreachable" in err["message"] and dead in err["message"]
        assert err["type"] == "connect"
        # the openai SDK surfaces it as an API error with that message
        client = openai.OpenAI(base_url=proxy.url + "/v1", api_key="k", max_retries=0)
        with pytest.raises(openai.APIStatusError) as info:
            client.chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}])
        assert info.value.status_code == 502
        assert httpx.get(proxy.url + "/v1/models").status_code == 502  # plain paths too
        s = metric_samples(proxy.url)
        assert sample(s, "phasewatch_requests_total", outcome="error") == 2
        assert sample(s, "phasewatch_errors_total", kind="connect") == 2
        assert sample(s, "phasewatch_upstream_up", upstream="dead") == 0
        assert proxy.proc.poll() is None
    finally:
        proxy.stop()


async def die_after_three_tokens(req: Request, reader, writer) -> None:
    """Streams three token events, then drops the connection (an engine crash)."""
    writer.write(SSE_HEAD)
    for i in range(3):
        event = {
            "id": "x",
            "object": "chat.completion.chunk",
            "created": 1,
            "model": "m",
            "choices": [{"index": 0, "delta": {"content": f"t{i}"}, "finish_reason": None}],
        }
        writer.write(chunk(b"data: " + json.dumps(event).encode() + b"\n\n"))
        await writer.drain()
        await asyncio.sleep(0.01)
    writer.close()  # mid-body: no last chunk


def test_engine_dying_midstream_ends_with_an_error_event():
    engine = FakeEngine(models=["m"], script=die_after_three_tokens).start()
    proxy = start_proxy(f"dying={engine.url}")
    try:
        resp = httpx.post(
            proxy.url + "/v1/chat/completions", json={"model": "m", "messages": [], "stream": True}
        )
        events = [e for e in resp.content.split(b"\n\n") if e]
        assert len(events) == 4
        last = json.loads(events[-1][len(b"data: ") :])
        assert "failed mid-response" in last["error"]["message"]
        client = openai.OpenAI(base_url=proxy.url + "/v1", api_key="k", max_retries=0)
        with pytest.raises(openai.APIError):
            for _ in client.chat.completions.create(model="m", messages=[], stream=True):
                pass
        s = metric_samples(proxy.url)
        assert sample(s, "phasewatch_requests_total", outcome="error") == 2
        assert sample(s, "phasewatch_errors_total", kind="midstream") == 2
        assert sample(s, "phasewatch_ttft_seconds_count") == 2  # the client did get tokens
    finally:
        proxy.stop()
        engine.stop()


def test_admission_gate_queues_then_rejects():
    sim = start_sim("vllm", speed=1.0)
    proxy = start_proxy(
        f"sim={sim.url}",
        args=["--max-concurrency", "1", "--max-queue", "1", "--queue-timeout", "600"],
    )
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 200,
        "stream": True,
        "ignore_eos": True,
    }

    def gauge(name: str) -> float:
        return sample(metric_samples(proxy.url), name)

    try:
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            post = lambda: httpx.post(proxy.url + "/v1/chat/completions", json=body, timeout=60)  # noqa: E731
            first = pool.submit(post)
            wait_for(lambda: gauge("phasewatch_in_flight_requests") == 1, what="the first admitted")
            second = pool.submit(post)
            wait_for(lambda: gauge("phasewatch_queued_requests") == 1, what="the second queued")
            # running one, queueing one: the third is refused at once
            rejected = httpx.post(proxy.url + "/v1/chat/completions", json=body, timeout=60)
            assert rejected.status_code == 429
            assert first.result().status_code == 200 and second.result().status_code == 200
        assert rejected.json()["error"]["type"] == "rate_limit_exceeded"
        assert rejected.headers["retry-after"] == "1"
        s = metric_samples(proxy.url)
        assert sample(s, "phasewatch_requests_total", outcome="rejected") == 1
        assert sample(s, "phasewatch_requests_total", outcome="ok") == 2
        # the queued request waited for the first one: its proxy queue time is visible
        assert sample(s, "phasewatch_queue_seconds_sum", where="proxy") > 0
        assert sample(s, "phasewatch_queued_requests") == 0
        assert sample(s, "phasewatch_in_flight_requests") == 0
        # the limit said so once in the log, naming the flags that set it
        said = [ln for ln in proxy.log().splitlines() if "limit=queue_full" in ln]
        assert len(said) == 1 and "--max-queue" in said[0], said
    finally:
        proxy.stop()
        sim.stop()


def test_model_label_is_bounded(sim, proxy):
    """1,000 made-up model names add one label value ('other'), not 1,000 series."""
    with httpx.Client(base_url=proxy.url) as c:
        for i in range(1000):
            r = c.post(
                "/v1/chat/completions",
                json={
                    "model": f'made-up-{i}-\u2603"{{x}}',
                    "messages": [{"role": "user", "content": "x"}],
                },
                headers={"x-random": f"{i}", "user-agent": f"ua-{i}"},
            )
            assert r.status_code == 404
    s = metric_samples(proxy.url)
    models = {dict(items).get("model") for (name, items) in s if name.startswith("phasewatch_")}
    models.discard(None)
    assert models <= {
        "other",
        "meta-llama/Llama-3.1-8B-Instruct",
        "RedHatAI/Llama-3.1-8B-Instruct-FP8",
        "hugging-quants/Llama-3.1-8B-Instruct-AWQ-INT4",
    }
    assert sample(s, "phasewatch_requests_total", model="other", outcome="error") >= 1000
    assert len(s) < 2000
