"""Label values from the wire are bounded, and /metrics never stalls the loop (issue 23.5).

An engine listing 64 model ids of 100 KiB each made a 12.8 MB /metrics at idle, 253 MiB
after one stream per model, and rendering it on the event loop stalled every stream and
health check for a second per scrape. Here: such an engine behind the real proxy leaves
/metrics small, its RSS bounded, the real model listed and measured, each long id
counted and said once; and a scrape held inside the registry does not hold up
/phasewatch/health.
"""

from __future__ import annotations

import asyncio
import json
import re
import threading
from pathlib import Path

import httpx
from prometheus_client.core import GaugeMetricFamily

from proxy.measure.labels import plain

from ...support.fake_engine import FakeEngine, Reply, Request, response
from ...support.in_process import InProcessProxy
from ...support.servers import metric_samples, sample, start_proxy

LONG_IDS = [f"{i:02d}-" + "x" * (100 * 1024) for i in range(64)]
REAL = "real-model"


def test_what_may_be_a_label_value():
    assert plain("Qwen/Qwen2.5-7B-Instruct-AWQ")
    assert plain("qwen2.5:7b-instruct-q4_K_M")
    assert plain("модель-日本語")  # printable text of any script
    assert plain("x" * 128) and not plain("x" * 129)
    assert not plain("")
    for bad in ("a\nb", "a\rb", "a\x00b", "a\x1b[31mb", "a\u2028b", "a\x85b"):
        assert not plain(bad), repr(bad)


def many_models_engine():
    listing = json.dumps(
        {"object": "list", "data": [{"id": m, "object": "model"} for m in [*LONG_IDS, REAL]]}
    ).encode()

    def answer(req: Request) -> Reply:
        if req.target.startswith("/v1/models"):
            return Reply(response(200, listing, [("Content-Type", "application/json")]))
        if req.method == "POST" and req.target == "/v1/chat/completions":
            model = json.loads(req.body)["model"]
            events = [
                {"model": model, "choices": [{"index": 0, "delta": {"content": "h"}}]},
                {"model": model, "choices": [{"index": 0, "delta": {"content": "i"}}]},
                {"model": model, "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]},
                {
                    "model": model,
                    "choices": [],
                    "usage": {"prompt_tokens": 5, "completion_tokens": 3},
                },
            ]
            sse = b"".join(b"data: " + json.dumps(e).encode() + b"\n\n" for e in events)
            sse += b"data: [DONE]\n\n"
            return Reply(response(200, sse, [("Content-Type", "text/event-stream")], chunked=True))
        return Reply(response(404, b"not found"))

    return answer


def rss_bytes(pid: int) -> int:
    status = Path(f"/proc/{pid}/status").read_text()
    return int(re.search(r"VmRSS:\s+(\d+) kB", status).group(1)) * 1024  # type: ignore[union-attr]


def test_an_engine_listing_huge_model_ids_leaves_metrics_small_and_memory_bounded():
    with FakeEngine(many_models_engine()) as engine:
        proxy = start_proxy(f"eng={engine.url}", args=["--engine", "eng=openai"])
        try:
            idle = httpx.get(proxy.url + "/metrics", timeout=30)
            before = rss_bytes(proxy.proc.pid)
            with httpx.Client(timeout=30) as client:
                for model in [*LONG_IDS, REAL]:
                    body = {
                        "model": model,
                        "stream": True,
                        "messages": [{"role": "user", "content": "hi"}],
                    }
                    with client.stream("POST", proxy.url + "/v1/chat/completions", json=body) as r:
                        assert r.status_code == 200
                        assert r.read().endswith(b"data: [DONE]\n\n")
            lines = proxy.request_lines(at_least=65)
            after = rss_bytes(proxy.proc.pid)
            page = httpx.get(proxy.url + "/metrics", timeout=30)
            # every label value on the page is short, the long ids are all "other"
            values = set(re.findall(r'="((?:[^"\\]|\\.)*)"', page.text))
            assert max(len(v) for v in values) <= 128
            models = set(re.findall(r'model="([^"]*)"', page.text))
            assert models <= {REAL, "other"} and REAL in models
            assert len(idle.content) < 256 * 1024 and len(page.content) < 256 * 1024
            # the real model, listed after the 64 long ids, still took a place in the list
            samples = metric_samples(proxy.url)
            assert sample(samples, "phasewatch_requests_total", model=REAL, outcome="ok") == 1
            assert sample(samples, "phasewatch_requests_total", model="other", outcome="ok") == 64
            assert (
                sample(
                    samples, "phasewatch_label_values_folded_total", upstream="eng", label="model"
                )
                >= 64
            )
            assert sum(1 for x in lines if x["model"] == "other") == 64
            said = [x for x in proxy.log().splitlines() if "--max-label-length" in x]
            assert len(said) == 1 and "xxxxxxxx" not in said[0]
            assert after - before < 48 * 1024 * 1024, (before, after)
        finally:
            proxy.stop()


def test_the_label_bound_is_a_flag():
    longish = "m-" + "y" * 200  # over the default 128, under the flag's 512
    listing = json.dumps({"object": "list", "data": [{"id": longish}]}).encode()

    def answer(req: Request) -> Reply:
        return Reply(response(200, listing, [("Content-Type", "application/json")]))

    with FakeEngine(answer) as engine:
        proxy = start_proxy(
            f"eng={engine.url}", args=["--engine", "eng=openai", "--max-label-length", "512"]
        )
        try:
            ready = httpx.get(proxy.url + "/phasewatch/ready", timeout=10).json()
            assert ready["upstreams"][0]["models"] == 1
            assert f'model="{longish}"' in httpx.get(proxy.url + "/metrics", timeout=10).text
        finally:
            proxy.stop()


class HeldCollector:
    """A collector that holds its scrape until released: a registry slow to render."""

    def __init__(self) -> None:
        self.entered = threading.Event()
        self.release = threading.Event()
        self.calls = 0

    def collect(self):
        self.calls += 1
        self.entered.set()
        self.release.wait(5)
        yield GaugeMetricFamily("held_scrape", "A scrape held inside the registry.", value=1)

    def describe(self):
        return []


def test_a_slow_scrape_does_not_hold_up_health_and_concurrent_scrapes_share_it():
    with InProcessProxy.serving("eng=http://127.0.0.1:9", engine=["eng=openai"]) as proxy:
        held = HeldCollector()
        proxy.metrics.exposition.register(held)

        async def main() -> None:
            async with httpx.AsyncClient(base_url=proxy.url, timeout=30) as c:
                first = asyncio.create_task(c.get("/metrics"))
                assert await asyncio.to_thread(held.entered.wait, 10)
                second = asyncio.create_task(c.get("/metrics"))
                health = await asyncio.wait_for(c.get("/phasewatch/health"), 10)
                assert health.status_code == 200
                # health was answered while the scrapes were still being rendered
                assert not first.done() and not second.done()
                held.release.set()
                for r in await asyncio.gather(first, second):
                    assert r.status_code == 200 and "held_scrape 1.0" in r.text
                assert held.calls == 1  # one rendering for both

        try:
            asyncio.run(main())
        finally:
            held.release.set()
