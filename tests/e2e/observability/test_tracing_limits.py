"""OpenTelemetry's limits (--otel): every span a full batch queue drops is counted (the
SDK only logs each drop, and its duplicate filter shows one line in 20 s), and shutdown
with a collector that is down takes at most --otel-shutdown-timeout instead of the SDK's
retries (37-42 s with its defaults), while a live collector still gets what was queued.
Through the real command line, a raw-socket engine and a port nothing listens on."""

from __future__ import annotations

import json
import signal
import subprocess
import time

import httpx

from ...support.fake_engine import FakeEngine, Reply, Request, response
from ...support.otlp_receiver import Receiver
from ...support.servers import free_port, metric_samples, sample, start_proxy

N = 40  # requests, one span each
QUEUE = 4  # OTEL_BSP_MAX_QUEUE_SIZE


def answer(req: Request) -> Reply | None:
    if req.method != "POST":
        return None  # the engine's standard answer
    body = {
        "id": "cmpl-1",
        "object": "chat.completion",
        "model": "fake-model",
        "choices": [{"index": 0, "message": {"role": "assistant", "content": "Hi"}}],
        "usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4},
    }
    return Reply(response(200, json.dumps(body).encode(), [("Content-Type", "application/json")]))


def send(proxy, n: int) -> None:
    body = {"model": "fake-model", "messages": [{"role": "user", "content": "hi"}]}
    with httpx.Client(timeout=30) as client:
        for _ in range(n):
            assert client.post(proxy.url + "/v1/chat/completions", json=body).status_code == 200
    proxy.request_lines(at_least=n)  # each span ends as its line is written


def stop_timed(proxy) -> float:
    """SIGTERM the proxy and return how long it took to exit."""
    t0 = time.monotonic()
    proxy.proc.send_signal(signal.SIGTERM)
    try:
        assert proxy.proc.wait(timeout=90) == 0, proxy.log()[-3000:]
    except subprocess.TimeoutExpired:
        proxy.proc.kill()
        raise
    return time.monotonic() - t0


def test_every_dropped_span_is_counted_and_shutdown_with_a_dead_collector_is_bounded():
    dead = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    with FakeEngine(answer) as engine:
        proxy = start_proxy(
            f"fake={engine.url}",
            args=["--otel", "--engine", "fake=openai", "--metrics-public"],
            env={
                "OTEL_EXPORTER_OTLP_ENDPOINT": dead,
                # each export retries for a minute: the first batch holds the worker
                "OTEL_EXPORTER_OTLP_TIMEOUT": "60",
                "OTEL_BSP_MAX_QUEUE_SIZE": str(QUEUE),
                "OTEL_BSP_MAX_EXPORT_BATCH_SIZE": str(QUEUE),
                "OTEL_BSP_SCHEDULE_DELAY": "60000",
                "OTEL_METRIC_EXPORT_INTERVAL": "600000",  # metrics only at shutdown
            },
        )
        try:
            send(proxy, N)
            dropped = sample(
                metric_samples(proxy.url),
                "phasewatch_otel_spans_dropped_total",
                reason="queue_full",
            )
            # the worker holds at most one batch, the queue at most QUEUE spans; the queue
            # fills before its first drop: every other span was dropped, and counted
            assert N - 2 * QUEUE <= dropped <= N - QUEUE, dropped
            assert proxy.log().count("OpenTelemetry span queue is full") == 1
            assert "Queue full, dropping" not in proxy.log()  # the SDK's line, once per span
            took = stop_timed(proxy)
        finally:
            if proxy.proc.poll() is None:
                proxy.proc.kill()
                proxy.proc.wait()
    log = proxy.log()
    # the bound is proved by the proxy's own word that it gave up (the SDK alone waits
    # 30 s for its worker, then retries the metrics: over 37 s), and by an exit before
    # the exporter's own timeout (60 s, set above) could have run out once; the time it
    # took is a figure, not a claim
    print(f"\nshutdown with a dead collector took {took:.1f} s")
    assert took < 60, (took, log[-3000:])
    assert "OpenTelemetry spans not exported within 5s of shutdown" in log, log[-3000:]
    assert "queued span(s) dropped" in log
    assert "OpenTelemetry metrics not exported within 5s of shutdown" in log, log[-3000:]


def test_the_shutdown_bound_follows_the_flag_and_a_live_collector_gets_the_queued_spans():
    receiver = Receiver()
    try:
        with FakeEngine(answer) as engine:
            proxy = start_proxy(
                f"fake={engine.url}",
                args=["--otel", "--engine", "fake=openai", "--otel-shutdown-timeout", "20"],
                env={
                    "OTEL_EXPORTER_OTLP_ENDPOINT": receiver.endpoint,
                    "OTEL_BSP_SCHEDULE_DELAY": "600000",  # spans wait in the queue
                    "OTEL_METRICS_EXPORTER": "none",
                },
            )
            try:
                send(proxy, 3)
                assert receiver.spans == []  # still queued
                stop_timed(proxy)
            finally:
                if proxy.proc.poll() is None:
                    proxy.proc.kill()
                    proxy.proc.wait()
        assert sum(s["kind"] == "SPAN_KIND_SERVER" for s in receiver.spans) == 3
        assert "not exported within" not in proxy.log()
    finally:
        receiver.stop()
