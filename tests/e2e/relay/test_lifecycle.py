"""A measured request's lifecycle: whatever ends it (an answer, an upstream failure, a cut
stream, a client that hangs up, a refusal at the gate, a retry to another member of its
pool), its place at the gate is given back, the queued and in-flight gauges return to
zero, the active set empties, and it is counted once. Clients and engines are real peers
on loopback; the proxy runs in process so the test can read its gates."""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager

import httpx

from proxy.fleet import Upstream

from ...support.fake_engine import FakeEngine, Reply, Request, json_bytes, response
from ...support.hostile import closed_port
from ...support.in_process import InProcessProxy
from .test_relay_unit import CHAT, EVENTS, count, recorded, streaming


@contextmanager
def fleet(*urls: str, max_concurrency: int = 0, max_queue: int = 256, **settings):
    """The proxy in front of upstreams e0, e1 ... at `urls`, all serving model "m" (a pool
    when there are several)."""
    names = [f"e{i}" for i in range(len(urls))]
    with InProcessProxy.serving(
        *(f"{n}={url}" for n, url in zip(names, urls, strict=True)),
        engine=[f"{n}=vllm" for n in names],
        max_concurrency=max_concurrency,
        max_queue=max_queue,
        **settings,
    ) as proxy:
        yield proxy, proxy.app.upstreams.all


def request(url: str, leave_after: int | None = None) -> tuple[httpx.Response, bytes]:
    """One POST /v1/chat/completions, read whole, and the bytes read; `leave_after`: the
    client hangs up (closes its connection) once that many events reached it."""
    got = b""
    with httpx.stream("POST", url + "/v1/chat/completions", content=CHAT, timeout=30) as resp:
        for part in resp.iter_raw():
            got += part
            if leave_after is not None and got.count(b"\n\n") >= leave_after:
                break
    return resp, got


def assert_released(proxy: InProcessProxy, *ups: Upstream, held: int = 0) -> None:
    def state() -> list[tuple]:
        return [(u.name, len(u.active), u.gate.active, u.gate.queued) for u in ups]

    assert proxy.call(state) == [(u.name, 0, held, 0) for u in ups]
    assert count(proxy.metrics, "phasewatch_in_flight_requests") == 0
    assert count(proxy.metrics, "phasewatch_queued_requests") == 0


def _500(req: Request) -> Reply | None:
    return Reply(json_bytes(500, b'{"error":"no"}')) if req.method == "POST" else None


@contextmanager
def _engine(case: str) -> Iterator[str]:
    """The upstream's URL for one of the endings."""
    if case == "connect":
        yield f"http://127.0.0.1:{closed_port()}"
        return
    scripts = {
        "ok": streaming(*EVENTS),
        "midstream": streaming(*EVENTS[:2], end=b""),
        "hang-up": streaming(*EVENTS[:2], hold=True),  # open until the client leaves
    }
    if case == "http_500":
        engine = FakeEngine(_500, models=["m"])
    else:
        engine = FakeEngine(models=["m"], script=scripts[case])
    with engine:
        yield engine.url


def test_every_ending_gives_the_place_back_and_counts_once():
    cases = {
        "ok": (None, "ok", None),
        "connect": (None, "error", "connect"),
        "midstream": (None, "error", "midstream"),
        "hang-up": (2, "aborted", None),
        "http_500": (None, "error", "upstream_status"),
    }
    for name, (leave_after, outcome, kind) in cases.items():
        with _engine(name) as url, fleet(url) as (proxy, (u,)):
            resp, _ = request(proxy.url, leave_after=leave_after)
            assert resp.status_code, name
            recorded(proxy)
            assert_released(proxy, u)
            assert count(proxy.metrics, "phasewatch_requests_total") == 1, name
            assert count(proxy.metrics, "phasewatch_requests_total", outcome=outcome) == 1, name
            errors = count(proxy.metrics, "phasewatch_errors_total")
            assert errors == (1 if kind else 0), (name, errors)
            if kind:
                assert count(proxy.metrics, "phasewatch_errors_total", kind=kind) == 1, name
            if name == "hang-up":
                assert count(proxy.metrics, "phasewatch_aborts_total", phase="decode") == 1


def test_a_refusal_at_the_gate_is_answered_once_and_holds_nothing():
    engine = FakeEngine(models=["m"], script=streaming(*EVENTS))
    with engine, fleet(engine.url, max_concurrency=1, max_queue=0) as (proxy, (u,)):
        proxy.call(u.gate.acquire)  # the one slot is taken, no queue
        resp, _ = request(proxy.url)  # read whole: the answer ended
        assert resp.status_code == 429
        assert resp.headers["retry-after"] == "1"
        recorded(proxy)
        assert_released(proxy, u, held=1)
        assert count(proxy.metrics, "phasewatch_requests_total", outcome="rejected") == 1
        proxy.call(u.gate.release)


def _gone_after_listing(req: Request) -> Reply | None:
    """An engine's model list, on a connection it closes: the proxy keeps none to it, so
    once the engine stops its next request is refused before a byte is sent."""
    if req.target.endswith("/v1/models"):
        data = b'{"object":"list","data":[{"id":"m","object":"model"}]}'
        headers = [("content-type", "application/json"), ("connection", "close")]
        return Reply(response(200, data, headers), then="close")
    return None


@contextmanager
def refusing_after_start(*others: FakeEngine, **settings):
    """A pool of e0, which refuses connections once the proxy has read its model list,
    and `others`; e0 is tried first (the others report a busier engine)."""
    with ExitStack() as stack:
        gone = FakeEngine(_gone_after_listing, models=["m"]).start()
        running = [gone]

        def stop() -> None:
            while running:
                running.pop().stop()

        stack.callback(stop)
        urls = [gone.url, *(stack.enter_context(o).url for o in others)]
        proxy, ups = stack.enter_context(fleet(*urls, **settings))
        stop()

        def busier() -> None:
            for u in ups[1:]:
                u.engine_load = (8.0, 0.0, None)

        proxy.call(busier)
        yield proxy, ups


def test_a_request_that_could_not_be_sent_moves_its_admission_to_the_next_member():
    e1 = FakeEngine(models=["m"], script=streaming(*EVENTS))
    with refusing_after_start(e1) as (proxy, (u0, u1)):
        resp, got = request(proxy.url)
        assert resp.status_code == 200 and got == b"".join(EVENTS)
        assert len(e1.posts()) == 1  # refused by e0, sent once to e1
        recorded(proxy)
        assert count(proxy.metrics, "phasewatch_pool_retries_total") == 1
        assert_released(proxy, u0, u1)
        assert count(proxy.metrics, "phasewatch_requests_total", upstream="e1", outcome="ok") == 1
        assert count(proxy.metrics, "phasewatch_requests_total") == 1
        assert count(proxy.metrics, "phasewatch_errors_total") == 0


def test_a_full_next_member_gives_the_client_the_first_failure():
    e1 = FakeEngine(models=["m"])
    with refusing_after_start(e1, max_concurrency=1, max_queue=0) as (proxy, (u0, u1)):
        proxy.call(u1.gate.acquire)  # e1's one slot is taken
        resp, got = request(proxy.url)
        assert resp.status_code == 502
        assert json.loads(got)["error"]["type"] == "connect"
        recorded(proxy)
        assert e1.posts() == []  # a full member is not sent the request
        assert_released(proxy, u0)
        assert_released(proxy, u1, held=1)
        assert count(proxy.metrics, "phasewatch_errors_total", kind="connect") == 1
        assert count(proxy.metrics, "phasewatch_pool_retries_total") == 1
        proxy.call(u1.gate.release)


def test_an_error_that_did_not_fail_the_request_is_counted_by_the_recorder():
    # larger than any one read of a socket: the event is held across reads, whatever the
    # engine's writes and the proxy's reads make of its chunks
    big = b'data: {"choices":[{"index":0,"delta":{"content":"' + b"x" * (1 << 20) + b'"}}]}\n\n'
    pieces = [big[i : i + 65536] for i in range(0, len(big), 65536)]
    events = [EVENTS[0], *pieces, *EVENTS[1:]]
    engine = FakeEngine(models=["m"], script=streaming(*events))
    with engine, fleet(engine.url, max_event_bytes=1024) as (proxy, (u,)):
        _, got = request(proxy.url)
        assert got == b"".join(events)
        recorded(proxy)
        assert count(proxy.metrics, "phasewatch_errors_total", kind="oversized") == 1
        assert count(proxy.metrics, "phasewatch_requests_total", outcome="ok") == 1
        assert_released(proxy, u)
