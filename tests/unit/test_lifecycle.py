"""A measured request's lifecycle, in process: whatever ends it (an answer, an upstream
failure, a cut stream, a client that hangs up, a refusal at the gate, a retry to another
member of its pool), its place at the gate is given back, the queued and in-flight
gauges return to zero, the active set empties, and it is counted once."""

from __future__ import annotations

import asyncio

import httpx

from proxy.core import Relay, RelayOptions
from proxy.fleet import Upstream, UpstreamOptions, Upstreams, UpstreamSpec
from proxy.measure.metrics import Metrics
from proxy.measure.recorder import Recorder
from proxy.transport import ClientOptions

from .test_relay_unit import CHAT, EVENTS, body_of, count, streamed


def stream_response(*events: bytes, cut: bool = False, pause: float = 0.0) -> httpx.Response:
    async def body():
        for e in events:
            if pause:
                await asyncio.sleep(pause)
            yield e
        if cut:
            raise httpx.RemoteProtocolError("upstream closed the connection")

    return httpx.Response(200, headers={"content-type": "text/event-stream"}, content=body())


def fleet(*handlers, max_concurrency: int = 0, max_queue: int = 256, **relay_args):
    """Upstreams e0, e1 ... all serving model "m" (a pool when there are several)."""
    metrics = Metrics()
    ups = []
    for i, handler in enumerate(handlers):
        options = UpstreamOptions(
            client=ClientOptions(transport=httpx.MockTransport(handler)),
            max_concurrency=max_concurrency,
            max_queue=max_queue,
        )
        u = Upstream(UpstreamSpec(f"e{i}", f"http://e{i}.test", engine="vllm"), options, metrics)
        u.models = {"m"}
        u.routable = {"m"}
        ups.append(u)
    upstreams = Upstreams(ups)
    upstreams.probed = True
    options = RelayOptions(inject_usage=True, max_body_bytes=1 << 20, **relay_args)
    relay = Relay(upstreams, Recorder(metrics, access_lines=False), options)
    return relay, metrics, ups


async def request(relay: Relay, body: bytes = CHAT, leave_after: int | None = None) -> list[dict]:
    """One POST /v1/chat/completions; `leave_after`: the client hangs up once that many
    body messages reached it."""
    scope = {"type": "http", "method": "POST", "path": "/v1/chat/completions",
             "raw_path": b"/v1/chat/completions", "query_string": b"", "headers": []}  # fmt: skip
    sent: list[dict] = []
    gone = asyncio.Event()
    first = True

    async def receive() -> dict:
        nonlocal first
        if first:
            first = False
            return {"type": "http.request", "body": body, "more_body": False}
        await gone.wait()
        return {"type": "http.disconnect"}

    async def send(msg: dict) -> None:
        sent.append(msg)
        bodies = sum(1 for m in sent if m["type"] == "http.response.body")
        if leave_after is not None and bodies >= leave_after:
            gone.set()

    await relay(scope, receive, send)
    return sent


def assert_released(metrics: Metrics, *ups: Upstream, held: int = 0) -> None:
    for u in ups:
        assert not u.active, u.name
        assert u.gate.active == held and u.gate.queued == 0, (u.name, u.gate.active)
    assert count(metrics, "phasewatch_in_flight_requests") == 0
    assert count(metrics, "phasewatch_queued_requests") == 0


def _refuses(request: httpx.Request) -> httpx.Response:
    raise httpx.ConnectError("refused")


async def test_every_ending_gives_the_place_back_and_counts_once():
    cases = {
        "ok": (lambda r: stream_response(*EVENTS), None, "ok", None),
        "connect": (_refuses, None, "error", "connect"),
        "midstream": (lambda r: stream_response(*EVENTS[:2], cut=True), None, "error", "midstream"),
        "hang-up": (lambda r: stream_response(*EVENTS, pause=0.05), 2, "aborted", None),
        "http_500": (
            lambda r: httpx.Response(500, content=streamed(b'{"error":"no"}')),
            None,
            "error",
            "upstream_status",
        ),
    }
    for name, (handler, leave_after, outcome, kind) in cases.items():
        relay, metrics, (u,) = fleet(handler)
        sent = await request(relay, leave_after=leave_after)
        assert sent, name
        assert_released(metrics, u)
        assert count(metrics, "phasewatch_requests_total") == 1, name
        assert count(metrics, "phasewatch_requests_total", outcome=outcome) == 1, name
        errors = count(metrics, "phasewatch_errors_total")
        assert errors == (1 if kind else 0), (name, errors)
        if kind:
            assert count(metrics, "phasewatch_errors_total", kind=kind) == 1, name
        if name == "hang-up":
            assert count(metrics, "phasewatch_aborts_total", phase="decode") == 1


async def test_a_refusal_at_the_gate_is_answered_once_and_holds_nothing():
    relay, metrics, (u,) = fleet(lambda r: stream_response(*EVENTS), max_concurrency=1, max_queue=0)
    await u.gate.acquire()  # the one slot is taken, no queue
    sent = await request(relay)
    assert sent[0]["status"] == 429 and sent[-1]["more_body"] is False
    assert (b"retry-after", b"1") in sent[0]["headers"]
    assert_released(metrics, u, held=1)
    assert count(metrics, "phasewatch_requests_total", outcome="rejected") == 1
    u.gate.release()


def _first_call_refused():
    """A handler that refuses its first connection (nothing sent) and then answers."""
    calls: list[str] = []

    def handler(request: httpx.Request) -> httpx.Response:
        calls.append(request.url.host)
        if len(calls) == 1:
            raise httpx.ConnectError("refused")
        return stream_response(*EVENTS)

    return handler, calls


async def test_a_request_that_could_not_be_sent_moves_its_admission_to_the_next_member():
    handler, calls = _first_call_refused()
    relay, metrics, (e0, e1) = fleet(handler, handler)
    sent = await request(relay)
    assert sent[0]["status"] == 200 and body_of(sent) == b"".join(EVENTS)
    assert len(calls) == 2 and calls[0] != calls[1]  # one member each, never sent twice
    assert count(metrics, "phasewatch_pool_retries_total") == 1
    assert_released(metrics, e0, e1)
    answered = calls[1].split(".")[0]
    assert count(metrics, "phasewatch_requests_total", upstream=answered, outcome="ok") == 1
    assert count(metrics, "phasewatch_requests_total") == 1
    assert count(metrics, "phasewatch_errors_total") == 0


async def test_a_full_next_member_gives_the_client_the_first_failure():
    def refused(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("refused")

    def never(request: httpx.Request) -> httpx.Response:
        raise AssertionError("a full member must not be sent the request")

    relay, metrics, (e0, e1) = fleet(refused, never, max_concurrency=1, max_queue=0)
    e1.engine_load = (8.0, 0.0, None)  # busier: e0 is tried first
    await e1.gate.acquire()  # e1's one slot is taken
    sent = await request(relay)
    assert sent[0]["status"] == 502
    assert b'"connect"' in body_of(sent)
    assert e0.gate.active == 0 and e1.gate.active == 1 and not e0.active and not e1.active
    assert count(metrics, "phasewatch_in_flight_requests") == 0
    assert count(metrics, "phasewatch_errors_total", kind="connect") == 1
    assert count(metrics, "phasewatch_pool_retries_total") == 1
    e1.gate.release()


async def test_an_error_that_did_not_fail_the_request_is_counted_by_the_recorder():
    big = b'data: {"choices":[{"index":0,"delta":{"content":"' + b"x" * 4096 + b'"}}]}\n\n'
    pieces = [big[i : i + 512] for i in range(0, len(big), 512)]  # held across chunks
    events = [EVENTS[0], *pieces, *EVENTS[1:]]
    relay, metrics, (u,) = fleet(lambda r: stream_response(*events), max_event_bytes=1024)
    sent = await request(relay)
    assert body_of(sent) == b"".join(events)
    assert count(metrics, "phasewatch_errors_total", kind="oversized") == 1
    assert count(metrics, "phasewatch_requests_total", outcome="ok") == 1
    assert_released(metrics, u)
