"""`phasewatch serve --workers 2`: requests spread over both workers, /metrics sums them."""

from __future__ import annotations

import concurrent.futures
import os
import signal
import time
from pathlib import Path

import httpx
import pytest

from ...support.servers import (
    metric_samples,
    sample,
    start_proxy,
    start_sim,
    stream_chat,
    wait_for,
)

N = 24


@pytest.fixture(scope="module")
def stack():
    sim = start_sim("vllm", speed=4.0, deterministic=False, max_num_seqs=64)
    proxy = start_proxy(f"sim={sim.url}", args=["--workers", "2"])
    # the first health answer comes from whichever worker is up first: wait for both, or
    # the first requests may all reach the one that is
    wait_for(lambda: len(_started(proxy.log())) == 2 or None, what="both workers' start-up")
    yield sim, proxy
    proxy.stop()
    sim.stop()


def _started(log: str) -> set[str]:
    """The workers whose application start-up is complete, by the proxy's log."""
    return {
        line.split("worker=", 1)[1].split(" ", 1)[0]
        for line in log.splitlines()
        if "Application startup complete" in line and "worker=" in line
    }


def _stream(url: str, model: str) -> int:
    body = {
        "model": model,
        "stream": True,
        "max_tokens": 12,
        "messages": [{"role": "user", "content": "hello there"}],
    }
    with (
        httpx.Client(timeout=30) as client,  # a fresh connection per request
        client.stream("POST", url + "/v1/chat/completions", json=body) as resp,
    ):
        assert resp.status_code == 200
        return sum(1 for line in resp.iter_lines() if line.startswith("data: "))


def _models(url: str) -> str:
    return httpx.get(url + "/v1/models", timeout=10).json()["data"][0]["id"]


def test_requests_spread_and_metrics_sum(stack):
    sim, proxy = stack
    model = _models(sim.url)
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        events = list(pool.map(lambda _: _stream(proxy.url, model), range(N)))
    assert all(e >= 12 for e in events)
    lines = wait_for(
        lambda: (lambda got: got if len(got) >= N else None)(proxy.request_lines()),
        what="every request's log line",
    )
    assert len(lines) == N
    # every request line names the worker that served it (worker=i pid=P)
    pids = {
        line.split(" pid=", 1)[1].split(" ", 1)[0]
        for line in proxy.log().splitlines()
        if "msg=request " in line
    }
    assert len(pids) == 2, f"all requests went to one worker: {pids}"

    # whichever worker answers /metrics, the totals are both workers' together
    for _ in range(4):
        s = metric_samples(proxy.url)
        assert sample(s, "phasewatch_requests_total", outcome="ok") == N
        assert sample(s, "phasewatch_ttft_seconds_count") == N
        assert sample(s, "phasewatch_tokens_total", phase="decode") == N * 12
        assert sample(s, "phasewatch_inter_token_seconds_count") == N * 11
        assert sample(s, "phasewatch_in_flight_requests") == 0
        # gauges come out once per label set, not once per worker (no pid label)
        assert not [k for k in s if dict(k[1]).get("pid")]


def test_exposition_under_workers_negotiates_and_has_no_created_series(stack):
    """The summed multiprocess registry goes through the same exposition: OpenMetrics
    on request, gzip, no _created series; no process_* series, which would describe
    one worker only."""
    _, proxy = stack
    from prometheus_client.openmetrics.parser import text_string_to_metric_families

    plain = httpx.get(proxy.url + "/metrics")
    assert plain.headers["content-type"].startswith("text/plain; version=0.0.4")
    assert "_created" not in plain.text and "process_resident_memory_bytes" not in plain.text
    om = httpx.get(
        proxy.url + "/metrics", headers={"accept": "application/openmetrics-text; version=1.0.0"}
    )
    assert om.headers["content-type"].startswith("application/openmetrics-text")
    assert "phasewatch_requests" in {f.name for f in text_string_to_metric_families(om.text)}
    gz = httpx.get(proxy.url + "/metrics", headers={"accept-encoding": "gzip"})
    assert gz.headers.get("content-encoding") == "gzip"


def test_power_sampler_runs_in_one_worker_only(stack):
    _, proxy = stack
    # No GPU here: the sampler says so once, from the primary (worker 0) only.
    said = [line for line in proxy.log().splitlines() if "GPU power is not" in line]
    assert len(said) == 1 and " worker=0 " in said[0], said


def test_sigterm_stops_every_worker_and_cleans_up():
    sim = start_sim("vllm", speed=10.0, deterministic=False)
    proxy = start_proxy(f"sim={sim.url}", args=["--workers", "2"])
    try:
        pids = [
            int(p)
            for p in Path(f"/proc/{proxy.proc.pid}/task/{proxy.proc.pid}/children")
            .read_text()
            .split()
        ]
        assert len(pids) >= 2
        folder = next(
            line.split("metrics_dir=", 1)[1].split()[0]
            for line in proxy.log().splitlines()
            if "metrics_dir=" in line
        )
        assert os.path.isdir(folder)
        proxy.proc.send_signal(signal.SIGTERM)
        assert proxy.proc.wait(timeout=20) == 0
        deadline = time.monotonic() + 10  # workers (and multiprocessing's helper) exit
        while time.monotonic() < deadline and any(_alive(pid) for pid in pids):
            time.sleep(0.1)
        assert not [pid for pid in pids if _alive(pid)]
        assert not os.path.exists(folder)
    finally:
        proxy.stop()
        sim.stop()


def _alive(pid: int) -> bool:
    try:
        return "zombie" not in Path(f"/proc/{pid}/status").read_text().lower()
    except OSError:
        return False


def test_every_workers_requests_carry_phase_power_from_one_sampler():
    """--workers 2: one process samples GPU power for the host, every worker's requests
    get their prefill/decode power and energy share, and the engines are probed once."""
    from proxy.sim.physics import RTX_4090, power_watts

    from ..observability.test_power_e2e import GPU, MODELS, TOKENS

    sim = start_sim("vllm", speed=1.0, jitter=0.0, max_num_seqs=64)
    args = [
        "--workers",
        "2",
        "--power-source",
        "dcgm",
        "--power-dcgm-url",
        sim.url + "/metrics",
        "--power-interval",
        "0.05",
    ]
    for p, m in MODELS.items():
        args += ["--power-gpu", f"{GPU[p]}={m.id}"]
    proxy = start_proxy(f"sim={sim.url}", args=args)
    try:
        wait_for(
            lambda: (
                sample(metric_samples(proxy.url), "phasewatch_power_sampling_up", source="dcgm")
                == 1.0
            ),
            what="power sampling",
        )
        # Rounds of two concurrent streams per precision (each on a fresh connection, so
        # the kernel spreads them) until both workers have served some.
        pids: set[str] = set()
        sent = 0
        for _ in range(6):
            with concurrent.futures.ThreadPoolExecutor(6) as pool:
                jobs = [
                    pool.submit(
                        stream_chat,
                        proxy.url,
                        m.id,
                        f"workers power {p} {i} {len(pids)}",
                        TOKENS[p] // 2,
                    )
                    for p, m in MODELS.items()
                    for i in range(2)
                ]
                for job in jobs:
                    job.result()
                sent += len(jobs)
            pids = {
                line.split(" pid=", 1)[1].split(" ", 1)[0]
                for line in proxy.log().splitlines()
                if "msg=request " in line
            }
            if len(pids) == 2:
                break
        assert len(pids) == 2, "all requests went to one worker"
        truth = sim.truth(at_least=sent)
        lines = wait_for(
            lambda: (lambda got: got if len(got) >= len(truth) else None)(proxy.request_lines()),
            what="a log line for every request the engine served",
        )
        assert len(lines) == len(truth)
        per_pid: dict[str, list[str]] = {}
        for raw in proxy.log().splitlines():
            if "msg=request " in raw:
                pid = raw.split(" pid=", 1)[1].split(" ", 1)[0]
                per_pid.setdefault(pid, []).append(raw)
        assert all(per_pid[p] for p in pids)

        def settled():
            s = metric_samples(proxy.url)
            n = sum(v for (name, lab), v in s.items() if name == "phasewatch_gpu_power_watts_count")
            u = sum(
                v for (name, lab), v in s.items() if name == "phasewatch_gpu_power_unresolved_total"
            )
            return s if n + u >= 2 * sent else None

        s = wait_for(settled, what="every request's power settled, whichever worker served it")
        # every worker's requests: decode power at a batch of two, from the one sampler
        for p, m in MODELS.items():
            lab = {"precision": p, "phase": "decode"}
            n = sample(s, "phasewatch_gpu_power_watts_count", **lab)
            assert n == sum(1 for t in truth if t["model"] == m.id), p
            assert sample(s, "phasewatch_gpu_power_watts_sum", **lab) / n == pytest.approx(
                power_watts(MODELS[p], RTX_4090, "decode", 2), rel=0.05
            ), p
        # energy shares against the simulator's, per precision (ticks carry what both
        # workers have in flight: a share split over the wrong count would be off)
        for p, m in MODELS.items():
            proxy_j = sum(
                v
                for (name, lab), v in s.items()
                if name == "phasewatch_request_phase_energy_joules_total"
                and dict(lab).get("precision") == p
            )
            true_j = sum(t["energy_joules"] for t in truth if t["model"] == m.id)
            assert proxy_j == pytest.approx(true_j, rel=0.05), p
        # decode-state samples were taken while requests of either worker decoded
        s = metric_samples(proxy.url)
        assert sample(s, "phasewatch_gpu_power_sample_watts_count", state="decode") > 20
        # the engine was probed by one worker only
        probes = [ln for ln in proxy.log().splitlines() if "upstream sim" in ln and " is up" in ln]
        assert len(probes) == 1 and " worker=0 " in probes[0], probes
    finally:
        proxy.stop()
        sim.stop()
