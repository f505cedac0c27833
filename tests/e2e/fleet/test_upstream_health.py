"""Dead and silent upstreams: the proxy serves from the first moment, says which upstream
does not answer (in the log, in readiness, on the status page, with its engine
``unknown`` until detected), warns once when an upstream goes down and says when it is
back."""

from __future__ import annotations

import time

import httpx
import pytest

from ...support.fake_engine import FakeEngine, Reply
from ...support.servers import Server, _spawn, free_port, start_proxy, start_sim, wait_for


def silent_upstream() -> FakeEngine:
    """An engine that reads each request and never answers; its ``ended`` says when each
    connection was closed by the other side (the proxy giving up on it)."""
    return FakeEngine(answer=lambda req: Reply(then="hang")).start()


def warnings_for(log: str, name: str) -> list[str]:
    return [
        line
        for line in log.splitlines()
        if "level=warning" in line and f"upstream {name} " in line and "not answering" in line
    ]


def test_refused_and_silent_upstreams_start_at_once_and_say_so():
    silent = silent_upstream()
    refused = f"http://127.0.0.1:{free_port()}"
    port = free_port()
    t_health: list[float] = []

    def serving(resp: httpx.Response) -> bool:
        if resp.status_code == 200:
            t_health.append(time.monotonic())
            return True
        return False

    proc, log = _spawn(
        [
            "serve",
            "--port",
            str(port),
            "--upstream",
            f"refused={refused}",
            "--upstream",
            f"silent={silent.url}",
            "--connect-timeout",
            "60",
            "--read-timeout",
            "600",
        ],
        port,
        "/phasewatch/health",
        ready=serving,
    )
    proxy = Server(proc, f"http://127.0.0.1:{port}", log)
    try:
        # serving before the silent upstream's first probe gave up: no start-up stall
        assert silent.connections >= 1
        first = httpx.get(proxy.url + "/phasewatch/ready")
        wait_for(
            lambda: silent.ended, what="the probe of the silent upstream to give up", timeout=40
        )
        assert t_health[0] < silent.ended[0]
        assert first.status_code == 503
        states = {u["name"]: u for u in first.json()["upstreams"]}
        assert states["silent"]["engine"] == "unknown"

        # both named in the log, once each, with no engine claimed
        wait_for(
            lambda: warnings_for(proxy.log(), "silent"),
            what="the silent upstream's warning",
            timeout=40,
        )
        text = proxy.log()
        for name in ("refused", "silent"):
            (line,) = warnings_for(text, name)
            assert "engine unknown" in line
        assert "engine vllm" not in text and "engine openai" not in text

        # readiness and the status page tell the truth; liveness stays 200
        ready = httpx.get(proxy.url + "/phasewatch/ready")
        assert ready.status_code == 503 and ready.json()["ready"] is False
        assert {(u["name"], u["engine"], u["up"]) for u in ready.json()["upstreams"]} == {
            ("refused", "unknown", False),
            ("silent", "unknown", False),
        }
        assert httpx.get(proxy.url + "/phasewatch/health").status_code == 200
        summary = httpx.get(proxy.url + "/phasewatch/api/summary").json()
        assert {(u["name"], u["engine"], u["up"]) for u in summary["upstreams"]} == {
            ("refused", "unknown", False),
            ("silent", "unknown", False),
        }
    finally:
        proxy.stop()
        silent.stop()


def test_warned_once_when_an_upstream_goes_down_and_told_when_it_is_back():
    port = free_port()
    sim = start_sim("vllm", speed=8.0, port=port)
    proxy = start_proxy(
        f"sim=http://127.0.0.1:{port}", args=["--model-refresh", "0.2", "--engine-scrape", "0"]
    )
    refuser = None
    try:
        assert httpx.get(proxy.url + "/phasewatch/ready").status_code == 200
        assert not warnings_for(proxy.log(), "sim")
        wait_for(
            lambda: "is up" in proxy.log(), what="the start-up line saying it is up", timeout=40
        )
        sim.stop()
        refuser = FakeEngine(refuse=True, port=port).start()
        wait_for(lambda: warnings_for(proxy.log(), "sim"), what="the down warning", timeout=40)
        assert httpx.get(proxy.url + "/phasewatch/ready").status_code == 503
        # many more probes while it stays down: still one warning
        seen = refuser.connections
        wait_for(
            lambda: refuser.connections >= seen + 15,
            what="more probes of the down upstream",
            timeout=40,
        )
        assert len(warnings_for(proxy.log(), "sim")) == 1
        refuser.stop()
        refuser = None

        sim = start_sim("vllm", speed=8.0, port=port)

        def up_lines() -> list[str]:
            return [
                line
                for line in proxy.log().splitlines()
                if "level=info" in line and "upstream sim " in line and "is up" in line
            ]

        back = wait_for(
            lambda: len(up_lines()) == 2 and up_lines(), what="the back-up line", timeout=40
        )
        assert "engine vllm" in back[-1]  # detected again: it may have been replaced
        wait_for(
            lambda: httpx.get(proxy.url + "/phasewatch/ready").status_code == 200,
            what="readiness",
            timeout=40,
        )
        assert len(warnings_for(proxy.log(), "sim")) == 1
    finally:
        if refuser is not None:
            refuser.stop()
        proxy.stop()
        sim.stop()


@pytest.mark.parametrize("engine_flag", [None, "sim=vllm"])
def test_the_start_up_line_claims_no_engine_it_has_not_seen(engine_flag):
    dead = f"http://127.0.0.1:{free_port()}"
    proxy = start_proxy(f"sim={dead}", args=["--engine", engine_flag] if engine_flag else [])
    try:
        (line,) = [ln for ln in proxy.log().splitlines() if "relaying to sim" in ln]
        if engine_flag:
            assert "(engine vllm)" in line  # the operator said so
        else:
            assert "engine vllm" not in line and "detected in the background" in line
    finally:
        proxy.stop()


def test_an_engine_that_starts_after_the_proxy_is_detected_soon_not_at_the_next_refresh():
    """An engine still loading at start (compose brings both up together): the proxy
    probes it again within seconds, not after the model-list interval (here 300 s), so its
    requests are measured in the right dialect and labelled with its models."""
    port = free_port()
    proxy = start_proxy(f"late=http://127.0.0.1:{port}", args=["--model-refresh", "300"])
    sim = None
    try:
        assert httpx.get(proxy.url + "/phasewatch/ready").status_code == 503
        sim = start_sim("llamacpp", speed=8.0, port=port)
        wait_for(
            lambda: httpx.get(proxy.url + "/phasewatch/ready").status_code == 200,
            what="the late engine detected",
            timeout=40,
        )
        ready = httpx.get(proxy.url + "/phasewatch/ready").json()
        assert ready["upstreams"][0]["engine"] == "llamacpp"
        # measured in llama-server's own dialect: its native endpoint counts
        r = httpx.post(
            proxy.url + "/completion",
            json={"prompt": "hello there", "n_predict": 4, "stream": True},
        )
        assert r.status_code == 200
        wait_for(lambda: proxy.request_lines(), what="the request's log line", timeout=40)
        line = proxy.request_lines()[-1]
        assert line["endpoint"] == "llamacpp_completion" and line["model"] != "other", line
    finally:
        proxy.stop()
        if sim is not None:
            sim.stop()
