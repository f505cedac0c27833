"""The relay between a client and an engine on loopback: the proxy served in process
(:class:`~tests.support.in_process.InProcessProxy`, uvicorn with phasewatch's protocol),
the engine a :class:`~tests.support.fake_engine.FakeEngine` whose bytes each test
chooses. What the engine gets, what the client gets, and what is counted, for the cases
an engine can make: a stream, a stream cut, a plain body cut, each failure of the
upstream call, a protocol switch."""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Iterator
from contextlib import contextmanager

import httpx
import pytest

from proxy.measure.metrics import Metrics

from ...support.fake_engine import SSE_HEAD, FakeEngine, Reply, Request, chunk, response
from ...support.hostile import closed_port, connect, full_backlog
from ...support.in_process import InProcessProxy
from ...support.servers import wait_for


def count(metrics: Metrics, name: str, **labels) -> float:
    total = 0.0
    for family in metrics.registry.collect():
        for s in family.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                total += s.value
    return total


def recorded(proxy: InProcessProxy, n: int = 1) -> None:
    """Wait until `n` requests were recorded: the client has its whole answer a moment
    before the proxy counts it, and every figure of a request is counted at once."""
    wait_for(
        lambda: count(proxy.metrics, "phasewatch_requests_total") >= n,
        what=f"{n} recorded request(s)",
    )


@contextmanager
def relay_to(engine: FakeEngine, kind: str = "vllm", **settings) -> Iterator[InProcessProxy]:
    """The proxy in front of `engine` (upstream "eng", serving model "m")."""
    with InProcessProxy.serving(f"eng={engine.url}", engine=[f"eng={kind}"], **settings) as p:
        yield p


def streaming(
    *events: bytes,
    pause: float = 0.0,
    end: bytes = b"0\r\n\r\n",
    hold: bool = False,
    pause_end: float = 0.0,
):
    """A script streaming `events` as chunks of an SSE response (`pause` before each),
    then `end` (the last chunk, `pause_end` later; b"" leaves the body open and closes
    the connection); with `hold`, the body stays open until the proxy closes the
    connection."""

    async def script(req: Request, reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        writer.write(SSE_HEAD)
        for e in events:
            if pause:
                await asyncio.sleep(pause)
            writer.write(chunk(e))
            await writer.drain()
        if hold:
            await asyncio.wait_for(reader.read(1), 30)  # b"": the proxy closed
            writer.close()
        elif end:
            await asyncio.sleep(pause_end)
            writer.write(end)
            await writer.drain()
        else:
            writer.close()

    return script


def body_text(resp: httpx.Response) -> dict:
    return json.loads(resp.content)


CHAT = json.dumps(
    {"model": "m", "stream": True, "stream_options": {"include_usage": True}, "messages": []}
).encode()
EVENTS = [
    b'data: {"choices":[{"index":0,"delta":{"role":"assistant","content":""}}]}\n\n',
    b'data: {"choices":[{"index":0,"delta":{"content":"Hi"}}]}\n\n',
    b'data: {"choices":[{"index":0,"delta":{"content":" there"},"finish_reason":"stop"}]}\n\n',
    b'data: {"choices":[],"usage":{"prompt_tokens":5,"completion_tokens":2,"total_tokens":7}}\n\n',
    b"data: [DONE]\n\n",
]


def chat(proxy: InProcessProxy, body: bytes = CHAT) -> httpx.Response:
    return httpx.post(proxy.url + "/v1/chat/completions", content=body, timeout=30)


def test_exactly_the_clients_end_to_end_headers_reach_the_engine():
    with FakeEngine(models=["m"]) as engine, relay_to(engine) as proxy:
        s = connect(proxy.url)
        s.sendall(
            b"POST /v1/embeddings?a=%20b HTTP/1.1\r\n"
            b"host: proxy.test\r\n"
            b"content-type: application/json\r\n"
            b"connection: keep-alive, x-hop\r\n"
            b"x-hop: dropped\r\n"
            b"x-custom: kept\r\n"
            b"content-length: 2\r\n"
            b"\r\n{}"
        )
        head = b""
        while b"\r\n\r\n" not in head:
            got = s.recv(65536)
            assert got, head
            head += got
        s.close()
        assert head.startswith(b"HTTP/1.1 200 ")
        (req,) = engine.posts()
    # the client's end-to-end headers, with the framing and Host, and the proxy's one
    # field of its own: Via, naming it (a request that comes back with it is a loop)
    via = req.headers.pop(3)
    assert via[0] == "via" and re.fullmatch(r"1\.1 phasewatch-[0-9a-f]{12}", via[1]), via
    assert req.headers == [
        ("Host", engine.url.removeprefix("http://")),
        ("content-type", "application/json"),
        ("x-custom", "kept"),
        ("Content-Length", "2"),
    ]
    assert req.target == "/v1/embeddings?a=%20b"
    assert req.body == b"{}"


def test_a_stream_is_relayed_byte_exact_and_measured():
    with FakeEngine(models=["m"], script=streaming(*EVENTS)) as engine, relay_to(engine) as proxy:
        resp = chat(proxy)
        assert resp.status_code == 200
        assert resp.content == b"".join(EVENTS)
        recorded(proxy)
        assert count(proxy.metrics, "phasewatch_ttft_seconds_count") == 1
        assert count(proxy.metrics, "phasewatch_requests_total", outcome="ok") == 1


def test_an_engine_failing_mid_stream_ends_it_with_an_error_event():
    script = streaming(*EVENTS[:2], end=b"")  # the engine closes the connection mid-body
    with FakeEngine(models=["m"], script=script) as engine, relay_to(engine) as proxy:
        resp = chat(proxy)  # read whole: the relay ends the body properly
        data = resp.content
        assert data.startswith(EVENTS[0] + EVENTS[1])
        last = data[len(EVENTS[0] + EVENTS[1]) :]
        assert last.startswith(b"data: ") and b'"error"' in last and last.endswith(b"\n\n")
        assert json.loads(last[len(b"data: ") :])["error"]["message"]
        recorded(proxy)
        assert count(proxy.metrics, "phasewatch_requests_total", outcome="error") == 1
        assert count(proxy.metrics, "phasewatch_errors_total", kind="midstream") == 1


def test_a_plain_body_cut_short_is_left_cut():
    def answer(req: Request) -> Reply | None:
        if req.target == "/files/big":  # 10,221 bytes declared, 3,000 sent, then FIN
            return Reply(response(200, b"x" * 3000, length=10221), then="close")
        return None

    with FakeEngine(answer, models=["m"]) as engine, relay_to(engine) as proxy:
        got = b""
        with httpx.stream("GET", proxy.url + "/files/big", timeout=30) as resp:
            assert resp.status_code == 200
            # never a whole body: the server closes the connection and the client sees it cut
            with pytest.raises(httpx.RemoteProtocolError):
                for part in resp.iter_raw():
                    got += part
        assert got == b"x" * 3000


@contextmanager
def _refused() -> Iterator[tuple[str, dict]]:
    yield f"http://127.0.0.1:{closed_port()}", {}


@contextmanager
def _connect_slow() -> Iterator[tuple[str, dict]]:
    with full_backlog() as port:
        yield f"http://127.0.0.1:{port}", {"connect_timeout": 0.2}


@contextmanager
def _silent() -> Iterator[tuple[str, dict]]:
    def answer(req: Request) -> Reply | None:
        return Reply(then="hang") if req.method == "POST" else None

    with FakeEngine(answer, models=["m"]) as engine:
        yield engine.url, {"read_timeout": 0.5}


@contextmanager
def _endless_head() -> Iterator[tuple[str, dict]]:
    def answer(req: Request) -> Reply | None:
        return Reply(forever=b"HTTP/1.1 200 OK\r\n") if req.method == "POST" else None

    with FakeEngine(answer, models=["m"]) as engine:
        yield engine.url, {}


@pytest.mark.parametrize(
    ("engine", "status", "kind", "says"),
    [
        (_refused, 502, "connect", "Connection refused"),
        (_connect_slow, 504, "timeout", "timed out"),
        (_silent, 504, "timeout", "upstream sent nothing for 0.5s"),
        (_endless_head, 502, "protocol", "head over 65536 bytes"),
    ],
)
def test_upstream_failures_map_to_clear_answers(engine, status, kind, says):
    with (
        engine() as (url, settings),
        InProcessProxy.serving(f"eng={url}", engine=["eng=vllm"], **settings) as proxy,
    ):
        resp = chat(proxy)
        assert resp.status_code == status
        error = body_text(resp)["error"]
        assert error["type"] == kind and says in error["message"]
        recorded(proxy)
        assert count(proxy.metrics, "phasewatch_errors_total", kind=kind) == 1


def test_no_free_connection_is_a_503():
    """One connection to the engine, held by a stream that hangs: the next request waits
    its pool timeout for it, then gets 503."""

    def answer(req: Request) -> Reply | None:
        return Reply(then="hang") if req.method == "POST" else None

    with FakeEngine(answer, models=["m"]) as engine:
        settings = {"upstream_max_connections": 1, "upstream_pool_timeout": 0.3}
        with relay_to(engine, **settings) as proxy:
            holder = connect(proxy.url)  # its stream takes the one connection and hangs
            holder.sendall(
                b"POST /v1/chat/completions HTTP/1.1\r\nhost: p\r\n"
                b"content-length: %d\r\n\r\n%s" % (len(CHAT), CHAT)
            )
            wait_for(engine.posts, what="the first request at the engine")
            resp = chat(proxy)
            assert resp.status_code == 503
            error = body_text(resp)["error"]
            assert error["type"] == "pool" and "connections busy for 0.3s" in error["message"]
            wait_for(
                lambda: count(proxy.metrics, "phasewatch_errors_total", kind="pool") == 1,
                what="the pool failure counted",
            )
            holder.close()


def test_a_protocol_switch_is_not_relayed():
    def answer(req: Request) -> Reply | None:
        if req.target == "/ws":
            head = b"HTTP/1.1 101 Switching Protocols\r\nConnection: Upgrade\r\nUpgrade: websocket\r\n\r\n"
            return Reply(head, then="close")
        return None

    with FakeEngine(answer, models=["m"]) as engine, relay_to(engine) as proxy:
        resp = httpx.get(proxy.url + "/ws", headers={"upgrade": "websocket"}, timeout=30)
        assert resp.status_code == 502
        assert "101" in body_text(resp)["error"]["message"]
