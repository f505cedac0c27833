"""Stalled streams end to end: an engine that accepts requests and then streams nothing,
beside one that streams a long steady generation, behind a real phasewatch scraped by a
real Prometheus that loads the project's own rules.

The engine that stalls answers the head and a role-only first event (not a first token),
then nothing. Within minutes its upstream must have ``UpstreamStalled`` pending (then
firing), ``/phasewatch/ready`` must say degraded with the reason, and its pool must send
new requests to the other member. The steady 100-second generation (an event every 2 s,
under the test's 5 s floor) and light traffic beside it must raise nothing. The test's
floor is small (``--stall-floor 5``) and Prometheus scrapes and evaluates every second;
the real defaults' detection time is checked against the shipped configuration, and
promtool replays them (phasewatch-incidents_test.yml).
"""

from __future__ import annotations

import asyncio
import json
import re
import shutil
import tempfile
import threading
import time
from pathlib import Path

import httpx
import pytest
import yaml

from proxy.settings import Settings

from ...support.fake_engine import SSE_HEAD, FakeEngine, chunk
from ...support.hostile import token_event, usage_event
from ...support.prometheus import PromServer, tool
from ...support.servers import ROOT, start_proxy, wait_for

PROM_DIR = ROOT / "deploy" / "prometheus"
RULE_FILES = sorted(
    p for p in (PROM_DIR / "rules").glob("*.yml") if not p.name.endswith("_test.yml")
)
POOLED = "fake-model"
STEADY = "steady-model"
FLOOR = 5.0  # the test's --stall-floor (seconds)
STEADY_EVENTS = 50
STEADY_GAP = 2.0  # seconds between the steady engine's events: 100 s in all

ROLE = (
    b'data: {"id":"c1","object":"chat.completion.chunk","created":1,"model":"fake-model",'
    b'"choices":[{"index":0,"delta":{"role":"assistant","content":""},"finish_reason":null}]}'
    b"\n\n"
)
DONE = b"data: [DONE]\n\n"


async def _stuck(req, reader, writer):
    """The head and a role-only first event, then silence until the proxy hangs up."""
    writer.write(SSE_HEAD + chunk(ROLE))
    await writer.drain()
    while await reader.read(65536):
        pass
    writer.close()


async def _quick(req, reader, writer):
    writer.write(SSE_HEAD + chunk(ROLE))
    for text in ("a", "b", "c"):
        writer.write(chunk(token_event(text)))
    writer.write(chunk(token_event("", finish="stop") + usage_event() + DONE) + b"0\r\n\r\n")
    await writer.drain()


async def _steady(req, reader, writer):
    """A long steady generation: one event every STEADY_GAP seconds."""
    writer.write(SSE_HEAD + chunk(ROLE))
    await writer.drain()
    for i in range(STEADY_EVENTS):
        await asyncio.sleep(STEADY_GAP)
        writer.write(chunk(token_event(f"t{i} ")))
        await writer.drain()
    writer.write(chunk(token_event("", finish="stop") + usage_event() + DONE) + b"0\r\n\r\n")
    await writer.drain()


def _body(model: str) -> dict:
    return {"model": model, "messages": [{"role": "user", "content": "hi"}], "stream": True}


def _generations(engine: FakeEngine) -> int:
    return sum(1 for r in engine.posts() if "chat/completions" in r.target)


def _alert(prom: PromServer, upstream: str) -> str | None:
    got = prom.query(f'ALERTS{{alertname="UpstreamStalled", upstream="{upstream}"}}')
    return got[0]["metric"]["alertstate"] if got else None


@pytest.fixture(scope="module")
def scene():
    tool("prometheus")
    tmp = Path(tempfile.mkdtemp(prefix="pw-stall-"))
    engines = {
        "stuck": FakeEngine(models=[POOLED], script=_stuck).start(),
        "good": FakeEngine(models=[POOLED], script=_quick).start(),
        "steady": FakeEngine(models=[STEADY], script=_steady).start(),
    }
    args = ["--balance", "round-robin", "--stall-floor", str(FLOOR)]
    for name in engines:
        args += ["--engine", f"{name}=openai"]
    proxy = start_proxy(*(f"{n}={e.url}" for n, e in engines.items()), args=args)
    config = yaml.safe_load((PROM_DIR / "prometheus.yml").read_text())
    config["global"] = {"scrape_interval": "1s", "evaluation_interval": "1s"}
    config["rule_files"] = [str(p) for p in RULE_FILES]
    config.pop("alerting", None)
    config["scrape_configs"] = [
        {
            "job_name": "phasewatch",
            "static_configs": [{"targets": [proxy.url.removeprefix("http://")]}],
        }
    ]
    prom = PromServer(config, tmp)
    client = httpx.Client(base_url=proxy.url, timeout=httpx.Timeout(10, read=300))
    hanging: list[threading.Thread] = []
    try:
        yield {"engines": engines, "proxy": proxy, "prom": prom, "client": client, "bg": hanging}
    finally:
        proxy.stop()  # ends the streams still waiting on the stuck engine
        for t in hanging:
            t.join(timeout=30)
        client.close()
        prom.stop()
        for e in engines.values():
            e.stop()
        shutil.rmtree(tmp, ignore_errors=True)


def _stream(client: httpx.Client, model: str, out: list) -> None:
    """One streamed chat request; appends (events, seconds) or the error's type."""
    start = time.monotonic()
    try:
        with client.stream("POST", "/v1/chat/completions", json=_body(model)) as r:
            events = sum(1 for line in r.iter_lines() if line.startswith("data: {"))
        out.append((events, time.monotonic() - start))
    except httpx.HTTPError as exc:
        out.append(type(exc).__name__)


def test_a_stalled_engine_is_detected_and_avoided_and_a_steady_one_is_not(scene):
    engines, proxy, prom, client = (scene[k] for k in ("engines", "proxy", "prom", "client"))
    stuck, good = engines["stuck"], engines["good"]

    # the steady 100-second generation starts first and runs through everything below
    steady_out: list = []
    steady = threading.Thread(target=_stream, args=(client, STEADY, steady_out), daemon=True)
    steady.start()
    scene["bg"].append(steady)

    # streams to the pool until one lands on the stuck member (round-robin: the first two)
    light: list = []

    def send() -> None:
        t = threading.Thread(target=_stream, args=(client, POOLED, light), daemon=True)
        t.start()
        scene["bg"].append(t)

    n = 0
    while _generations(stuck) == 0:
        send()
        n += 1
        wait_for(lambda: _generations(stuck) + _generations(good) >= n, 10)
    sent = time.monotonic()

    # light traffic beside it (a request a second, each on its own thread: one that lands
    # on the stuck member waits there), and the detection: readiness, then the alert
    stop = threading.Event()

    def trickle() -> None:
        while not stop.wait(1.0):
            send()

    tr = threading.Thread(target=trickle, daemon=True)
    tr.start()
    try:
        ready = wait_for(
            lambda: (r := client.get("/phasewatch/ready").json())["degraded"] and r, 60
        )
        t_ready = time.monotonic() - sent
        assert ready["reasons"] and "upstream stuck" in ready["reasons"][0], ready
        assert ready["ready"] is True  # degraded, still serving: the pool has a member
        assert next(u["stalled"] for u in ready["upstreams"] if u["name"] == "stuck") >= 1
        # the status page's data shows the stalled streams and why
        cards = {u["name"]: u for u in client.get("/phasewatch/api/summary").json()["upstreams"]}
        assert cards["stuck"]["stalled"] >= 1 and "stalled" in cards["stuck"]["stall_reason"]
        assert cards["steady"]["stalled"] == 0 and cards["good"]["stalled"] == 0

        wait_for(lambda: _alert(prom, "stuck") in ("pending", "firing"), 180, "pending")
        t_pending = time.monotonic() - sent

        # new pool requests go to the member without stalled streams (round-robin
        # would send every other one to the stuck member)
        before_stuck, before_good = _generations(stuck), _generations(good)
        done: list = []
        for _ in range(8):
            _stream(client, POOLED, done)
        assert _generations(stuck) == before_stuck
        assert _generations(good) >= before_good + 8
        assert all(isinstance(d, tuple) and d[0] >= 3 for d in done), done

        wait_for(lambda: _alert(prom, "stuck") == "firing", 180, "firing")
        t_firing = time.monotonic() - sent
    finally:
        stop.set()
        tr.join(timeout=30)

    steady.join(timeout=STEADY_EVENTS * STEADY_GAP + 60)
    assert steady_out and isinstance(steady_out[0], tuple), steady_out
    events, seconds = steady_out[0]
    assert events >= STEADY_EVENTS and seconds >= STEADY_EVENTS * STEADY_GAP, steady_out

    # nothing for the steady upstream, ever: no stalled stream scraped, no alert, no count
    window = f"{int(time.monotonic() - sent) + 30}s"
    assert prom.query(f'max_over_time(phasewatch_stalled_streams{{upstream="steady"}}[{window}])')
    assert not prom.query(
        f'max_over_time(phasewatch_stalled_streams{{upstream="steady"}}[{window}]) > 0'
    )
    assert not prom.query('ALERTS{upstream="steady"}')
    assert not prom.query(f'max_over_time(ALERTS{{upstream=~"steady|good"}}[{window}])')
    assert not prom.query('phasewatch_stalls_total{upstream="steady"} > 0')
    assert prom.query('phasewatch_stalls_total{upstream="stuck", phase="prefill"} > 0')
    assert "stalled in prefill" in proxy.log() and "upstream stuck" in proxy.log()
    assert "upstream steady stalled" not in proxy.log()

    # with the real defaults: the floor, a shipped scrape and evaluation, then `for:`
    shipped = yaml.safe_load((PROM_DIR / "prometheus.yml").read_text())["global"]
    rule = next(
        r
        for g in yaml.safe_load((PROM_DIR / "rules" / "phasewatch-alerts.yml").read_text())[
            "groups"
        ]
        for r in g["rules"]
        if r.get("alert") == "UpstreamStalled"
    )
    floor = Settings.model_fields["stall_floor"].default
    pending_real = (
        floor + _seconds(shipped["scrape_interval"]) + _seconds(shipped["evaluation_interval"])
    )
    firing_real = pending_real + _seconds(rule["for"])
    assert pending_real < 180 and firing_real < 180
    # the test-sized run: the floor, a scan, a scrape and an evaluation (1 s each), with
    # room for a busy machine; firing one `for:` later
    assert t_pending < FLOOR + 30, t_pending
    assert t_firing >= _seconds(rule["for"]) and t_firing < t_pending + _seconds(rule["for"]) + 30
    _record(
        test_floor=FLOOR,
        ready_degraded_s=round(t_ready, 1),
        pending_s=round(t_pending, 1),
        firing_s=round(t_firing, 1),
        real_default_pending_bound_s=pending_real,
        real_default_firing_bound_s=firing_real,
    )


def _seconds(text: str) -> float:
    total = 0.0
    for n, unit in re.findall(r"(\d+)([hms])", text):
        total += int(n) * {"h": 3600, "m": 60, "s": 1}[unit]
    return total


def _record(**figures) -> None:
    """The measured detection times, in the test's output (pytest -s shows them)."""
    print("stall detection:", json.dumps(figures))


def _panel(prom: PromServer, title: str, index: int = 0, rng: str = "10m") -> dict[str, float]:
    """The Overview panel's query, as Grafana runs it with every upstream selected: its
    value per legend (upstream, and phase where it has one)."""
    board = json.loads((ROOT / "grafana" / "dashboards" / "phasewatch-overview.json").read_text())
    (panel,) = [p for p in board["panels"] if p["title"] == title]
    expr = panel["targets"][index]["expr"].replace("$upstream", ".*").replace("$__range", rng)
    return {
        " ".join(filter(None, (s["metric"].get("upstream"), s["metric"].get("phase")))): float(
            s["value"][1]
        )
        for s in prom.query(expr)
    }


def test_the_stall_panels_show_what_the_engines_did(scene):
    """After the scene above: every stream the stuck engine took is still open and has
    stalled in prefill (its first token never came), the steady and quick engines stalled
    none. The Overview's stall panels, on the same Prometheus, show exactly that."""
    engines, prom, client = scene["engines"], scene["prom"], scene["client"]
    taken = _generations(engines["stuck"])  # the truth: streams the stuck engine holds
    assert taken >= 1

    seen: list = []

    def before_first_scrape() -> float:
        """Stalls counted before Prometheus first scraped the series: increase() cannot
        see those (on a loaded box the first scrape can come after the first stall)."""
        got = prom.query(
            'min_over_time(phasewatch_stalls_total{upstream="stuck", phase="prefill"}[10m])'
        )
        return float(got[0]["value"][1]) if got else 0.0

    def stalled_all() -> bool:
        counted = _panel(prom, "Streams that stalled over the time range")
        now = _panel(prom, "Stalled streams")
        seen[:] = [counted, now, before_first_scrape()]
        # increase() extrapolates a little past the last scrape: a count within half
        return (
            abs(counted.get("stuck prefill", 0) - (taken - seen[2])) < 0.5
            and now.get("stuck") == taken
        )

    # the last streams sent may still be inside their floor: wait for them to stall too
    deadline = time.monotonic() + FLOOR + 60
    while not stalled_all() and time.monotonic() < deadline:
        time.sleep(0.5)
    assert stalled_all(), (taken, sorted(seen[0].items()), seen[1], seen[2])
    counted = _panel(prom, "Streams that stalled over the time range")
    early = before_first_scrape()
    assert round(counted["stuck prefill"]) == taken - early, (counted, early)
    assert counted["stuck decode"] == 0, counted
    for name in ("steady", "good"):  # never stalled: 0, not a blank
        assert counted[f"{name} prefill"] == counted[f"{name} decode"] == 0, counted
    now = _panel(prom, "Stalled streams")
    assert now == {"stuck": taken, "steady": 0, "good": 0}, now
    cards = {u["name"]: u for u in client.get("/phasewatch/api/summary").json()["upstreams"]}
    assert cards["stuck"]["stalled"] == taken
    # the oldest stuck stream has been silent since the first was sent (more than the
    # floor); the others have nothing in flight
    silence = _panel(prom, "Longest silence of a stream in flight")
    assert silence["stuck"] >= FLOOR and silence["good"] < FLOOR, silence
