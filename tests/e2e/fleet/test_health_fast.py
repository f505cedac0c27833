"""Health that is true within seconds: an idle engine that dies is seen down by the idle
probe (not at the next model-list refresh, here 300 s away), a refused request marks its
upstream down at once, a dead engine that returns is seen up, and the reason is on
readiness and the status page. The times are reported, never asserted against a clock:
each wait is for a condition, with a timeout far below the refresh interval."""

from __future__ import annotations

import itertools
import time

import httpx

from ...support.fake_engine import FakeEngine
from ...support.servers import free_port, metric_samples, sample, start_proxy, start_sim, wait_for

#: Far below --model-refresh (300 s): only the health probe can meet it.
SEEN_WITHIN = 20.0


def ready_status(proxy) -> int:
    return httpx.get(proxy.url + "/phasewatch/ready", timeout=10).status_code


def up_gauge(proxy, name: str) -> float:
    return sample(metric_samples(proxy.url), "phasewatch_upstream_up", upstream=name)


def summary_upstream(proxy, name: str) -> dict:
    got = httpx.get(proxy.url + "/phasewatch/api/summary", timeout=10).json()["upstreams"]
    return next(u for u in got if u["name"] == name)


def test_an_idle_engine_that_dies_is_seen_down_and_back_up_within_seconds():
    port = free_port()
    sim = start_sim("vllm", speed=8.0, port=port)
    proxy = start_proxy(
        f"sim=http://127.0.0.1:{port}", args=["--model-refresh", "300", "--engine-scrape", "0"]
    )
    try:
        assert ready_status(proxy) == 200 and up_gauge(proxy, "sim") == 1
        sim.stop()
        t_kill = time.monotonic()
        wait_for(
            lambda: ready_status(proxy) == 503 and up_gauge(proxy, "sim") == 0,
            timeout=SEEN_WITHIN,
            what="readiness 503 and upstream_up 0 after the engine died",
        )
        print(f"death seen after {time.monotonic() - t_kill:.2f} s")
        down = summary_upstream(proxy, "sim")
        assert down["up"] is False and down["reason"] == "connection refused"
        page = httpx.get(proxy.url + "/phasewatch/", headers={"accept": "text/html"}).text
        assert (
            "connection refused" in page
        )  # the card shows it (tests/e2e/tools/test_first_hour_status.py)

        sim = start_sim("vllm", speed=8.0, port=port)
        t_back = time.monotonic()
        wait_for(
            lambda: ready_status(proxy) == 200 and up_gauge(proxy, "sim") == 1,
            timeout=SEEN_WITHIN,
            what="readiness 200 and upstream_up 1 after the engine came back",
        )
        print(f"return seen after {time.monotonic() - t_back:.2f} s")
        assert summary_upstream(proxy, "sim")["reason"] is None
    finally:
        proxy.stop()
        sim.stop()


def test_a_refused_request_marks_its_upstream_down_at_once():
    """No probe at all (--health-interval 0): the failed request itself tells."""
    port = free_port()
    sim = start_sim("vllm", speed=8.0, port=port)
    proxy = start_proxy(
        f"sim=http://127.0.0.1:{port}",
        args=["--model-refresh", "300", "--engine-scrape", "0", "--health-interval", "0"],
    )
    try:
        assert ready_status(proxy) == 200
        sim.stop()
        r = httpx.post(
            proxy.url + "/v1/chat/completions",
            json={
                "model": "meta-llama/Llama-3.1-8B-Instruct",
                "messages": [{"role": "user", "content": "hi"}],
            },
        )
        assert r.status_code == 502
        # at once: the very next reads, no waiting
        assert ready_status(proxy) == 503
        samples = metric_samples(proxy.url)
        assert sample(samples, "phasewatch_upstream_up", upstream="sim") == 0
        assert sample(samples, "phasewatch_upstream_ejections_total", kind="connect") == 1
        assert summary_upstream(proxy, "sim")["reason"] == "connection refused"
    finally:
        proxy.stop()
        sim.stop()


def test_probes_skip_while_traffic_answers_and_a_5xx_probe_says_why():
    eng = FakeEngine(models=["m"]).start()
    proxy = start_proxy(
        f"gen={eng.url}",
        args=["--model-refresh", "300", "--engine-scrape", "0", "--health-interval", "0.5"],
    )
    try:
        start = eng.lists
        wait_for(lambda: eng.lists >= start + 3, timeout=SEEN_WITHIN, what="idle probes")
        # real traffic that answers: a probe only where a gap between answers exceeded
        # the interval (the shared machine may stall the client)
        before = eng.lists
        done = []
        for _ in range(30):
            r = httpx.post(
                proxy.url + "/v1/chat/completions",
                json={"model": "m", "messages": [{"role": "user", "content": "q"}]},
            )
            assert r.status_code == 200
            done.append(time.monotonic())
            time.sleep(0.05)
        gaps = sum(1 for a, b in itertools.pairwise(done) if b - a > 0.5)
        assert eng.lists - before <= 1 + gaps, (eng.lists - before, gaps)

        eng.fail = True
        wait_for(lambda: ready_status(proxy) == 503, timeout=SEEN_WITHIN, what="the 500s seen")
        assert summary_upstream(proxy, "gen")["reason"] == "HTTP 500 on /v1/models"
        eng.fail = False
        wait_for(lambda: ready_status(proxy) == 200, timeout=SEEN_WITHIN, what="seen up again")
    finally:
        proxy.stop()
        eng.stop()


def test_every_worker_sees_death_and_return_within_seconds():
    """Under --workers 2 the primary probes and the other worker follows its board."""
    port = free_port()
    sim = start_sim("vllm", speed=8.0, port=port)
    proxy = start_proxy(
        f"sim=http://127.0.0.1:{port}",
        args=["--workers", "2", "--model-refresh", "300", "--engine-scrape", "0"],
    )
    try:
        sim.stop()
        # several answers in a row: whichever worker takes each one agrees
        wait_for(
            lambda: all(ready_status(proxy) == 503 for _ in range(6)),
            timeout=SEEN_WITHIN,
            what="every worker's readiness 503",
        )
        sim = start_sim("vllm", speed=8.0, port=port)
        wait_for(
            lambda: all(ready_status(proxy) == 200 for _ in range(6)),
            timeout=SEEN_WITHIN,
            what="every worker's readiness 200",
        )
    finally:
        proxy.stop()
        sim.stop()
