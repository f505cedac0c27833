"""Hostile wire: nothing a client or an engine sends can exhaust the proxy, slip past its
gate, corrupt a stream or forge a log line.

Every test runs the real proxy (``python -m proxy serve``) on loopback in front of a
byte-level fake engine (:class:`tests.support.fake_engine.FakeEngine` with a script), speaks
to it over raw sockets or the real SDKs, and asserts the exact bytes the client receives and the counters. Memory
bounds are read from ``/proc`` (the growth of the proxy's peak RSS under the hostile load);
CPU comparisons are same-run ratios. Every loop is bounded.
"""

from __future__ import annotations

import asyncio
import hashlib
import http
import json
import os
import re
import socket
import subprocess
import sys
import threading
import time
from urllib.parse import quote

import httpx
import ollama
import openai
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ...support.fake_engine import SSE_HEAD, FakeEngine, Request, chunk, wants_usage
from ...support.hostile import (
    MODEL,
    PeakRss,
    connect,
    cpu_seconds,
    fds,
    read_all,
    read_response,
    token_event,
    usage_event,
)
from ...support.servers import ROOT, free_port, sample, start_proxy, wait_for

MiB = 1024 * 1024
KEY = {"authorization": "Bearer k1"}


def answer(status: int, message: str, kind: str, extra: bytes = b"", close: bool = False) -> bytes:
    """The exact bytes of an error the proxy answers itself (OpenAI's shape)."""
    body = json.dumps(
        {"error": {"message": message, "type": kind, "param": None, "code": status}}
    ).encode()
    return (
        b"HTTP/1.1 %d %s\r\ncontent-type: application/json\r\ncontent-length: %d\r\n"
        % (status, http.HTTPStatus(status).phrase.encode(), len(body))
        + extra
        + (b"connection: close\r\n" if close else b"")
        + b"\r\n"
        + body
    )


def metrics(proxy, headers=None) -> dict:
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(proxy.url + "/metrics", headers=headers, timeout=10).text
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def log_lines(proxy, needle: str) -> list[str]:
    return [line for line in proxy.log().splitlines() if needle in line]


def dechunk(data: bytes) -> bytes:
    """The body of a chunked HTTP/1.1 message body."""
    out = []
    while True:
        size_line, _, data = data.partition(b"\r\n")
        size = int(size_line.split(b";")[0], 16)
        if size == 0:
            return b"".join(out)
        out.append(data[:size])
        data = data[size + 2 :]


@pytest.fixture
def engine():
    e = FakeEngine(models=[MODEL]).start()
    yield e
    e.stop()


def chat(stream: bool = True, text: str = "hi") -> bytes:
    return json.dumps(
        {"model": MODEL, "messages": [{"role": "user", "content": text}], "stream": stream}
    ).encode()


def raw(url: str, request: bytes) -> bytes:
    """Send `request` as it is (no client normalises its path) and read the answer."""
    s = connect(url, timeout=30)
    try:
        s.sendall(request)
        return read_response(s)
    finally:
        s.close()


def get(path: str, extra: bytes = b"") -> bytes:
    return b"GET %s HTTP/1.1\r\nhost: x\r\n" % path.encode() + extra + b"\r\n"


def status_of(response: bytes) -> int:
    return int(response.split(b" ", 2)[1])


def post(path: str, body: bytes, extra: bytes = b"") -> bytes:
    return (
        b"POST %s HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
        b"content-length: %d\r\n" % (path.encode(), len(body)) + extra + b"\r\n" + body
    )


# --- 1. request heads: a size limit and a deadline, before any application code --------------


def _flood_head(url: str, piece: bytes, total: int, prefix: bytes) -> bytes:
    """Send a request head that never ends (`total` bytes of `piece`), then read."""
    s = connect(url)
    try:
        s.sendall(prefix)
        sent = 0
        while sent < total:  # bounded: at most total / len(piece) sends
            try:
                s.sendall(piece)
            except (BrokenPipeError, ConnectionResetError):
                break
            sent += len(piece)
        try:
            s.shutdown(socket.SHUT_WR)
        except OSError:
            pass
        return read_all(s)
    finally:
        s.close()


def test_a_huge_request_head_gets_431_before_the_key_check_and_costs_no_memory(engine):
    proxy = start_proxy(f"e={engine.url}", args=["--api-key", "k1", "--engine", "e=openai"])
    try:
        pid = proxy.proc.pid
        expected = answer(
            431, "request head over 65536 bytes", "request_header_too_large", close=True
        )
        head = b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\n"
        # 100 MiB of small headers; then one header whose value is 100 MiB
        for prefix, piece in (
            (head, b"x-pad: " + b"a" * 1017 + b"\r\n"),
            (head + b"x-big: ", b"b" * 65536),
        ):
            with PeakRss(pid) as rss:
                got = _flood_head(proxy.url, piece * (65536 // len(piece)), 100 * MiB, prefix)
            print(f"100 MiB head offered: proxy peak RSS grew {rss.growth_mib:.1f} MiB")
            assert got == expected
            assert rss.growth_mib < 24, f"RSS grew {rss.growth_mib:.0f} MiB"
        # the answer comes as soon as the limit is passed, without waiting for more bytes
        s = connect(proxy.url)
        s.sendall(head + b"x-big: " + b"c" * 65536)
        assert read_response(s) == expected
        s.close()
        assert not [r for r in engine.requests if r.method == "POST"]
        m = metrics(proxy, KEY)
        assert sample(m, "phasewatch_rejected_total", reason="head_too_large") == 3
        assert len(log_lines(proxy, "refused a request head over 65536 bytes")) == 1
        # the proxy still serves
        assert httpx.get(proxy.url + "/phasewatch/health").status_code == 200
    finally:
        proxy.stop()


def test_slow_request_heads_get_408_at_the_header_deadline(engine):
    proxy = start_proxy(f"e={engine.url}", args=["--header-timeout", "1", "--engine", "e=openai"])
    try:
        pid = proxy.proc.pid
        base_fds = fds(pid)
        slow = [connect(proxy.url) for _ in range(300)]
        idle = [connect(proxy.url) for _ in range(20)]  # connect and send nothing
        for s in slow:
            s.sendall(b"GET /phasewatch/health HTTP/1.1\r\nho")
        for s in slow + idle:
            s.setblocking(False)
        got = {s: b"" for s in slow + idle}
        closed: set[socket.socket] = set()
        deadline = time.monotonic() + 30  # bounded: 30 times the deadline
        while len(closed) < len(got) and time.monotonic() < deadline:
            for s in got:
                if s in closed:
                    continue
                try:
                    data = s.recv(4096)
                except BlockingIOError:
                    if s in slow and not got[s]:
                        try:
                            s.send(b"s")  # one more byte of a header name that never ends
                        except OSError:
                            closed.add(s)
                    continue
                except OSError:
                    closed.add(s)
                    continue
                if data:
                    got[s] += data
                    if s in slow:
                        s.shutdown(socket.SHUT_WR)  # answered: stop sending
                else:
                    closed.add(s)
            # meanwhile a well-behaved client is served
            assert httpx.get(proxy.url + "/phasewatch/health", timeout=10).status_code == 200
            time.sleep(0.2)
        assert len(closed) == len(got), f"{len(got) - len(closed)} connections still open"
        expected = answer(408, "request head not complete within 1s", "request_timeout", close=True)
        assert all(got[s] == expected for s in slow)
        assert all(got[s] == b"" for s in idle)
        for s in got:
            s.close()
        m = metrics(proxy)
        assert sample(m, "phasewatch_rejected_total", reason="header_timeout") == 320
        assert len(log_lines(proxy, "no complete request head within 1s")) == 1
        wait_for(lambda: fds(pid) <= base_fds + 2)
    finally:
        proxy.stop()


# --- 2. CRLF-framed SSE ------------------------------------------------------------------------


def _crlf_script(release: threading.Event):
    """sse-starlette's framing (events end with \\r\\n\\r\\n), cut so that the first body
    read holds no CRLF and a later cut falls between a \\r and its \\n."""

    async def script(req: Request, reader, writer):
        events = [
            token_event("Hel", nl=b"\r\n"),
            token_event("lo", nl=b"\r\n"),
            token_event("", finish="stop", nl=b"\r\n"),
        ]
        if wants_usage(req):
            events.append(usage_event(nl=b"\r\n"))
        events.append(b"data: [DONE]\r\n\r\n")
        stream = b"".join(events)
        first = len(events[0])
        writer.write(SSE_HEAD + chunk(stream[:20]))  # no CRLF in the first read
        await writer.drain()
        await asyncio.sleep(0.05)
        writer.write(chunk(stream[20:first]))
        await writer.drain()
        # the rest only once the client has shown it got the first event
        await asyncio.get_running_loop().run_in_executor(None, release.wait, 10)
        cut = first + len(events[1]) - 1  # between the last \r and its \n
        writer.write(chunk(stream[first:cut]))
        await writer.drain()
        await asyncio.sleep(0.05)
        writer.write(chunk(stream[cut:]) + b"0\r\n\r\n")
        await writer.drain()

    return script


def test_crlf_framed_sse_streams_event_by_event_and_strips_usage(engine):
    release = threading.Event()
    engine.script = _crlf_script(release)
    proxy = start_proxy(f"e={engine.url}", args=["--engine", "e=openai"])
    try:
        expected = (
            token_event("Hel", nl=b"\r\n")
            + token_event("lo", nl=b"\r\n")
            + token_event("", finish="stop", nl=b"\r\n")
            + b"data: [DONE]\r\n\r\n"
        )
        got = b""
        first_before_release = False
        with httpx.stream(
            "POST", proxy.url + "/v1/chat/completions", content=chat(), timeout=30
        ) as resp:
            for piece in resp.iter_raw():
                got += piece
                if not release.is_set() and b"\r\n\r\n" in got:
                    first_before_release = True
                    release.set()
        assert first_before_release, "the first event was held back until the stream ended"
        assert got == expected  # no usage event the client did not ask for, no error
        # the openai SDK reads it whole
        release.clear()
        threading.Timer(0.5, release.set).start()
        client = openai.OpenAI(base_url=proxy.url + "/v1", api_key="x", max_retries=0)
        text = "".join(
            c.choices[0].delta.content or ""
            for c in client.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "hi"}], stream=True
            )
        )
        assert text == "Hello"
        m = metrics(proxy)
        assert sample(m, "phasewatch_requests_total", outcome="ok") == 2
        assert sample(m, "phasewatch_ttft_seconds_count") == 2
        assert sample(m, "phasewatch_errors_total") == 0
        assert all(line["outcome"] == "ok" for line in proxy.request_lines(at_least=2))
    finally:
        proxy.stop()


def _spec_events(data: bytes) -> list[list[bytes]]:
    """The data lines of each event dispatched by a spec-following SSE parser."""
    events, current = [], []
    for line in re.split(rb"\r\n|\r|\n", data)[:-1]:  # the last piece has no terminator
        if not line:
            if current:
                events.append(current)
            current = []
        elif line.startswith(b"data:"):
            current.append(line)
    return events


_LINES = st.lists(
    st.tuples(
        st.sampled_from([b"data: a", b"data: {}", b": ping", b"data:", b"event: x", b""]),
        st.sampled_from([b"\n", b"\r\n", b"\r"]),
    ),
    max_size=30,
)


@settings(max_examples=300, deadline=None)
@given(_LINES, st.lists(st.integers(min_value=0, max_value=400), max_size=12))
def test_event_boundaries_follow_the_sse_line_rules_for_any_split(lines, cuts):
    from proxy.engines.framing import Framer

    data = b"".join(text + end for text, end in lines)
    cuts = sorted({c % (len(data) + 1) for c in cuts})
    fr = Framer(limit=1 << 20)
    pieces = []
    prev = 0
    for c in [*cuts, len(data)]:
        pieces += fr.split(data[prev:c])
        prev = c
    rest = fr.take()
    assert b"".join(pieces) + rest == data  # nothing lost, nothing added
    ours = [d for ev in pieces if (d := _spec_events(ev + b"\n"))]
    assert [e for group in ours for e in group] == _spec_events(data)
    for ev in pieces:  # every piece is one whole event: it ends with a blank line
        assert len(_spec_events(ev)) <= 1 and re.search(rb"(\r\n|\r|\n)(\r\n|\r|\n)$", ev)


def test_an_oversized_event_passes_through_raw_and_the_next_is_found():
    from proxy.engines.framing import Framer, Raw

    fr = Framer(limit=1000)
    big = b"data: " + b"x" * 5000 + b"\r\n\r\n"
    small = b"data: y\r\n\r\n"
    out = []
    for i in range(0, len(big + small), 333):
        out += fr.split((big + small)[i : i + 333])
    assert b"".join(out) == big + small
    assert out[-1] == small and type(out[-1]) is bytes
    assert all(type(p) is Raw for p in out[:-1]) and fr.oversized == 1


# --- 3. dot segments: the gate, the metrics and the base path ------------------------------


def test_dot_segments_and_encodings_go_through_the_gate_and_the_metrics(engine):
    release = threading.Event()
    holding = []

    async def script(req, reader, writer):
        holding.append(req.target)
        await asyncio.get_running_loop().run_in_executor(None, release.wait, 20)
        body = b'{"choices":[],"usage":{"prompt_tokens":1,"completion_tokens":1}}'
        writer.write(
            b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n"
            % len(body)
            + body
        )
        await writer.drain()

    engine.script = script
    proxy = start_proxy(
        f"e={engine.url}",
        args=["--engine", "e=openai", "--max-concurrency", "1", "--max-queue", "0"],
    )
    try:
        total = 0
        for path in (
            "/v1/chat/completions",
            "/v1/./chat/completions",
            "/v1/chat/%63ompletions",
            "//v1//chat/completions",
            "/v1/x/../chat/completions",
        ):
            release.clear()
            holding.clear()
            statuses: list[int] = []
            request = post(path, chat(False))
            threads = [
                threading.Thread(
                    target=lambda r=request: statuses.append(status_of(raw(proxy.url, r)))
                )
                for _ in range(4)
            ]
            for t in threads:
                t.start()
            try:
                wait_for(lambda: len(statuses) >= 3 and holding, timeout=10)
            finally:
                release.set()
                for t in threads:
                    t.join(30)
            assert sorted(statuses) == [200, 429, 429, 429], path
            assert holding == ["/v1/chat/completions"], path  # what the engine was sent
            total += 4
            m = metrics(proxy)
            assert sample(m, "phasewatch_requests_total") == total, path
            assert sample(m, "phasewatch_requests_total", outcome="rejected") == total * 3 / 4
    finally:
        release.set()
        proxy.stop()


def test_a_path_never_leaves_the_upstream_base_path(engine):
    proxy = start_proxy(
        f"e={engine.url}/tenant-a",
        args=["--engine", "e=vllm", "--engine-scrape", "0.2", "--model-refresh", "0.5"],
    )
    try:
        for path in ("/v1/../../admin", "/v1/%2e%2E/%2E%2e/admin", "/./../admin"):
            engine.requests.clear()
            raw(proxy.url, get(path))
            assert [r.target for r in engine.requests if "admin" in r.target] == ["/tenant-a/admin"]
        before = len(engine.requests)
        for path in ("/v1/..%2F..%2Fadmin", "/v1/..%5c..%5cadmin", "/v1/..\\..\\admin"):
            assert raw(proxy.url, get(path)) == answer(
                400,
                "the request path hides a dot segment in an encoded slash; not relayed",
                "invalid_request",
            )
        assert not [r for r in engine.requests[before:] if "admin" in r.target]
        assert sample(metrics(proxy), "phasewatch_rejected_total", reason="bad_path") == 3
        # the proxy's own calls keep the base path too: model refresh and engine scrape
        wait_for(lambda: any(r.target == "/tenant-a/metrics" for r in engine.requests))
        wait_for(lambda: any(r.target == "/tenant-a/v1/models" for r in engine.requests))
        assert not [r for r in engine.requests if not r.target.startswith("/tenant-a/")]
    finally:
        proxy.stop()


# --- 4. the mid-stream error event starts on an event boundary ---------------------------------


async def _die_mid_event(req, reader, writer):
    writer.write(SSE_HEAD + chunk(token_event("Hel") + token_event("lo")))
    await writer.drain()
    await asyncio.sleep(0.05)
    writer.write(chunk(b'data: {"id":"c1","object":"chat.completion.chunk","choi'))
    await writer.drain()
    await asyncio.sleep(0.05)
    writer.transport.abort()  # a crash: the connection is reset mid-event


def test_a_stream_broken_mid_event_ends_with_a_clean_error_event_the_openai_sdk_raises(engine):
    engine.script = _die_mid_event
    proxy = start_proxy(f"e={engine.url}", args=["--engine", "e=openai"])
    try:
        got = httpx.post(proxy.url + "/v1/chat/completions", content=chat(), timeout=30).content
        head = token_event("Hel") + token_event("lo")
        assert got.startswith(head)
        error = got[len(head) :]
        assert error.startswith(b"data: ") and error.endswith(b"\n\n")
        assert error.count(b"\n") == 2  # one event: the partial one was dropped
        err = json.loads(error[6:])["error"]
        assert err["message"].startswith("upstream e failed mid-response")
        assert err["code"] == 502
        client = openai.OpenAI(base_url=proxy.url + "/v1", api_key="x", max_retries=0)
        text = ""
        with pytest.raises(openai.APIError) as info:
            for c in client.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "hi"}], stream=True
            ):
                text += c.choices[0].delta.content or ""
        assert text == "Hello"
        assert "failed mid-response" in str(info.value)
        m = metrics(proxy)
        assert sample(m, "phasewatch_errors_total", kind="midstream") == 2
    finally:
        proxy.stop()


async def _ollama_dies_mid_line(req, reader, writer):
    def line(text: str) -> bytes:
        obj = {
            "model": MODEL,
            "created_at": "2025-01-01T00:00:00Z",
            "message": {"role": "assistant", "content": text},
            "done": False,
        }
        return json.dumps(obj, separators=(",", ":")).encode() + b"\n"

    writer.write(
        b"HTTP/1.1 200 OK\r\ncontent-type: application/x-ndjson\r\n"
        b"transfer-encoding: chunked\r\n\r\n" + chunk(line("Hel") + line("lo"))
    )
    await writer.drain()
    await asyncio.sleep(0.05)
    writer.write(chunk(b'{"model":"m","created_at":"2025-01-01T00:00:00Z","message":{"ro'))
    await writer.drain()
    await asyncio.sleep(0.05)
    writer.transport.abort()


def test_a_native_ollama_stream_broken_mid_line_ends_with_an_error_line_the_sdk_raises(engine):
    engine.script = _ollama_dies_mid_line
    proxy = start_proxy(f"e={engine.url}", args=["--engine", "e=ollama"])
    try:
        client = ollama.Client(host=proxy.url)
        text = ""
        with pytest.raises(ollama.ResponseError) as info:
            for part in client.chat(
                model=MODEL, messages=[{"role": "user", "content": "hi"}], stream=True
            ):
                text += part["message"]["content"]
        assert text == "Hello"
        assert "failed mid-response" in str(info.value)
        got = httpx.post(
            proxy.url + "/api/chat",
            content=json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "x"}]}),
            timeout=30,
        ).content
        lines = got.split(b"\n")
        assert len(lines) == 4 and lines[-1] == b""  # two lines, the error line, no partial
        assert json.loads(lines[2])["error"].startswith("upstream e failed mid-response")
        assert sample(metrics(proxy), "phasewatch_errors_total", kind="midstream") == 2
    finally:
        proxy.stop()


# --- 5. request bodies: one memory budget, 503 beyond it ---------------------------------------


def test_request_bodies_share_one_memory_budget(engine):
    release = threading.Event()

    async def hold(req, reader, writer):
        await asyncio.get_running_loop().run_in_executor(None, release.wait, 60)
        writer.write(
            b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 2\r\n\r\n{}"
        )
        await writer.drain()

    engine.script = hold
    budget = 48 * MiB
    proxy = start_proxy(
        f"e={engine.url}",
        args=[
            "--engine",
            "e=openai",
            "--max-body-bytes",
            str(budget),
            "--max-body-memory",
            str(budget),
        ],
    )
    try:
        pid = proxy.proc.pid
        text = "a" * (40 * MiB)
        body = chat(False, text)
        request = post("/v1/chat/completions", body)
        del text
        answers: list[bytes] = []

        def client():
            s = connect(proxy.url, timeout=60)
            try:
                s.sendall(request)
                answers.append(read_response(s))
            finally:
                s.close()

        threads = [threading.Thread(target=client) for _ in range(8)]
        with PeakRss(pid) as rss:
            for t in threads:
                t.start()
            wait_for(lambda: len(answers) >= 7, timeout=60)
            release.set()
            for t in threads:
                t.join(60)
        refused = answer(
            503,
            f"request bodies in memory are at --max-body-memory ({budget} bytes); retry later",
            "unavailable",
            extra=b"retry-after: 1\r\n",
        )
        ok = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 2\r\n\r\n{}"
        assert sorted(answers) == sorted([ok] + [refused] * 7)
        print(f"8 x 40 MiB bodies, 48 MiB budget: proxy peak RSS grew {rss.growth_mib:.0f} MiB")
        # one body held at a time (~40 MiB, joined once, parsed once) instead of eight
        assert rss.growth_mib < 3 * budget / MiB, f"RSS grew {rss.growth_mib:.0f} MiB"
        m = metrics(proxy)
        assert sample(m, "phasewatch_rejected_total", reason="body_memory") == 7
        assert len(log_lines(proxy, "--max-body-memory")) == 1
        # the budget is given back: the next body is taken
        release.set()
        s = connect(proxy.url, timeout=60)
        s.sendall(request)
        assert read_response(s) == ok
        s.close()
    finally:
        release.set()
        proxy.stop()


def test_a_promised_or_stalled_body_cannot_hold_the_budget(engine):
    """The budget counts bytes that arrived, not a Content-Length; a body that stops
    arriving is given up at the stall deadline (408), and what it held is freed."""
    proxy = start_proxy(
        f"e={engine.url}",
        args=[
            "--engine",
            "e=openai",
            "--max-body-bytes",
            str(MiB),
            "--max-body-memory",
            str(MiB),
            "--body-timeout",
            "1",
        ],
    )
    try:
        head = b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-length: %d\r\n\r\n"
        stalled = []
        for _ in range(5):  # each promises the whole budget, sends 128 KiB, then stalls
            s = connect(proxy.url, timeout=30)
            s.sendall(head % MiB + b"x" * (128 * 1024))
            stalled.append(s)
        # five promises of the whole budget hold 640 KiB of it: a small request is served
        assert status_of(raw(proxy.url, post("/v1/chat/completions", chat(False)))) == 200
        expected = answer(408, "no byte of the request body arrived for 1s", "request_timeout")
        answers = [read_response(s) for s in stalled]
        for s in stalled:
            s.close()
        assert answers == [expected] * 5
        assert sample(metrics(proxy), "phasewatch_rejected_total", reason="body_timeout") == 5
        # what they held was given back: a body of nearly the whole budget is taken
        got = raw(proxy.url, post("/v1/chat/completions", chat(False, "a" * (MiB - 200))))
        assert status_of(got) == 200, got
    finally:
        proxy.stop()


# --- 6. a very long SSE line: linear, bounded, passed through unmeasured ------------------------


def _stream_of(events: list[bytes]):
    async def script(req, reader, writer):
        writer.write(SSE_HEAD)
        data = b"".join(events)
        for i in range(0, len(data), 65536):
            writer.write(chunk(data[i : i + 65536]))
            await writer.drain()
        writer.write(b"0\r\n\r\n")
        await writer.drain()

    return script


def test_a_very_long_sse_line_costs_linear_time_and_bounded_memory(engine):
    size = 48 * MiB
    long_event = (
        b'data: {"choices":[{"index":0,"delta":{"content":"'
        + b"x" * size
        + b'"},"finish_reason":null}]}\n\n'
    )
    small = token_event("y" * 4000)
    many = [small] * (len(long_event) // len(small))
    done = [token_event("", finish="stop"), b"data: [DONE]\n\n"]
    proxy = start_proxy(f"e={engine.url}", args=["--engine", "e=openai"])
    try:
        pid = proxy.proc.pid
        cpu = {}
        for name, events in (("many", many), ("long", [long_event])):
            engine.script = _stream_of([token_event("a"), *events, *done])
            expected = hashlib.sha256(b"".join([token_event("a"), *events, *done])).hexdigest()
            before = cpu_seconds(pid)
            with PeakRss(pid) as rss:
                h = hashlib.sha256()
                with httpx.stream(
                    "POST", proxy.url + "/v1/chat/completions", content=chat(), timeout=120
                ) as resp:
                    for piece in resp.iter_raw():
                        h.update(piece)
            cpu[name] = cpu_seconds(pid) - before
            print(f"{name}: proxy CPU {cpu[name]:.2f} s, peak RSS grew {rss.growth_mib:.1f} MiB")
            assert h.hexdigest() == expected, name  # every byte, in order
            assert rss.growth_mib < 32, f"{name}: RSS grew {rss.growth_mib:.0f} MiB"
        # linear: one 48 MiB line costs no more than the same bytes in 4 KiB events
        assert cpu["long"] <= 2 * cpu["many"] + 0.05, cpu
        m = metrics(proxy)
        assert sample(m, "phasewatch_errors_total", kind="oversized") == 1
        assert sample(m, "phasewatch_requests_total", outcome="ok") == 2
        assert len(log_lines(proxy, "passed through unmeasured")) == 1
    finally:
        proxy.stop()


# --- 7. a stream framed by Content-Length, changed by the proxy --------------------------------


def test_an_sse_stream_with_content_length_is_reframed_when_usage_is_stripped(engine):
    async def script(req, reader, writer):
        events = token_event("Hel") + token_event("lo", finish="stop")
        if wants_usage(req):
            events += usage_event()
        events += b"data: [DONE]\n\n"
        writer.write(
            b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ncontent-length: %d\r\n\r\n"
            % len(events)
            + events
        )
        await writer.drain()

    engine.script = script
    proxy = start_proxy(f"e={engine.url}", args=["--engine", "e=openai"])
    try:
        s = connect(proxy.url)
        s.sendall(post("/v1/chat/completions", chat(), b"connection: close\r\n"))
        got = read_all(s)
        s.close()
        head, _, body = got.partition(b"\r\n\r\n")
        assert head == (
            b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\nconnection: close\r\n"
            b"transfer-encoding: chunked"
        )
        assert dechunk(body) == token_event("Hel") + token_event("lo", finish="stop") + (
            b"data: [DONE]\n\n"
        )
        m = metrics(proxy)
        assert sample(m, "phasewatch_requests_total", outcome="ok") == 1
        assert sample(m, "phasewatch_errors_total") == 0
    finally:
        proxy.stop()


# --- 8. log lines: every value from the wire escaped ----------------------------------------


@pytest.mark.parametrize("fmt", ["json", "logfmt"])
def test_a_path_cannot_forge_a_log_line(engine, fmt):
    async def cut(req, reader, writer):
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/plain\r\ncontent-length: 100\r\n\r\n")
        writer.write(b"0123456789")
        await writer.drain()
        await asyncio.sleep(0.05)
        writer.transport.abort()

    engine.script = cut
    proxy = start_proxy(f"e={engine.url}", args=["--engine", "e=openai", "--log-format", fmt])
    try:
        forged = quote(
            "/v1/files/a\r\nts=2025 level=warning msg=request request_id=forged\n"
            '{"level":"warning","request_id":"forged"}\u2028request_id=forged\x85'
            "\x1b[31mforged\u2029\x0brequest_id=forged",
            safe="/",
        )
        s = connect(proxy.url)
        s.sendall(get(forged))
        read_all(s)
        s.close()
        wait_for(lambda: log_lines(proxy, "failed mid-response"))
        text = proxy.log()
        lines = text.splitlines()  # Python's: also splits at U+2028, U+0085, \v, \x1c ...
        assert len(lines) == text.count("\n")
        for line in lines:
            if fmt == "json":
                json.loads(line)
            else:
                assert line.startswith("ts="), line
            assert "\x1b" not in line
        assert not [ln for ln in lines if ln.lstrip('{"').startswith(("request_id", "ts=2025"))]
    finally:
        proxy.stop()


# --- 9. authentication ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("args", "env"),
    [
        (["--api-key", ""], {}),
        (["--api-key", " "], {}),
        ([], {"PHASEWATCH_API_KEY": ""}),
        ([], {"PHASEWATCH_API_KEY": ","}),
        ([], {"PHASEWATCH_API_KEY": " , "}),
    ],
)
def test_an_empty_proxy_key_is_a_start_up_error(args, env):
    port = free_port()
    cmd = [sys.executable, "-m", "proxy", "serve", "--upstream", "http://127.0.0.1:9", "--port"]
    proc = subprocess.Popen(
        [*cmd, str(port), *args],
        cwd=ROOT,
        env={**os.environ, **env},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        out, err = proc.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        raise AssertionError("an empty key started an open proxy") from None
    assert proc.returncode == 2
    assert err.count("\n") == 1 and err.startswith("phasewatch: error: ")
    assert "empty key" in err


def test_own_routes_need_the_key_however_their_path_is_spelled(engine):
    proxy = start_proxy(f"e={engine.url}", args=["--api-key", "k1", "--engine", "e=openai"])

    def relayed() -> int:
        return len([r for r in engine.requests if not r.target.endswith("/v1/models")])

    try:
        unauthorized_page = b"HTTP/1.1 401 Unauthorized\r\n"
        for path, marker in (
            ("/v1/../phasewatch/debug", b'"tasks"'),
            ("/phasewatch/./api/summary", b'"upstreams"'),
            ("//phasewatch//debug", b'"tasks"'),
            ("/phasewatch/x/../api/summary", b'"upstreams"'),
            ("//metrics", b"phasewatch_requests_total"),
            ("/v1/%2e%2e/metrics", b"phasewatch_requests_total"),
        ):
            before = relayed()
            assert raw(proxy.url, get(path)).startswith(unauthorized_page), path
            got = raw(proxy.url, get(path, b"authorization: Bearer k1\r\n"))
            assert status_of(got) == 200 and marker in got, path
            assert relayed() == before, path  # phasewatch answered, not the engine
        for path in ("/phasewatch//health", "/phasewatch/./ready"):
            assert status_of(raw(proxy.url, get(path))) == 200, path
    finally:
        proxy.stop()


# --- 10. the smaller items ---------------------------------------------------------------------


def test_options_star_is_answered_by_the_proxy(engine):
    proxy = start_proxy(f"e={engine.url}/tenant-a", args=["--engine", "e=openai"])
    try:
        before = len(engine.requests)
        s = connect(proxy.url)
        s.sendall(b"OPTIONS * HTTP/1.1\r\nhost: x\r\n\r\n")
        assert read_response(s) == (
            b"HTTP/1.1 200 OK\r\nallow: GET, HEAD, POST, PUT, PATCH, DELETE, OPTIONS\r\n"
            b"content-length: 0\r\n\r\n"
        )
        s.close()
        assert len(engine.requests) == before
    finally:
        proxy.stop()


def test_a_websocket_upgrade_gets_a_clear_501(engine):
    proxy = start_proxy(f"e={engine.url}", args=["--engine", "e=openai"])
    try:
        s = connect(proxy.url)
        s.sendall(
            b"GET /v1/realtime HTTP/1.1\r\nhost: x\r\nconnection: Upgrade\r\nupgrade: websocket\r\n"
            b"sec-websocket-version: 13\r\nsec-websocket-key: dGhlIHNhbXBsZSBub25jZQ==\r\n\r\n"
        )
        got = read_all(s)
        s.close()
        assert got == answer(
            501, "phasewatch does not relay websocket upgrades", "unsupported", close=True
        )
        assert not [r for r in engine.requests if "realtime" in r.target]
        assert sample(metrics(proxy), "phasewatch_rejected_total", reason="upgrade") == 1
    finally:
        proxy.stop()


def test_a_client_that_half_closes_gets_its_answer_and_one_that_closes_is_a_hang_up(engine):
    gone = threading.Event()

    async def script(req, reader, writer):
        if req.target == "/v1/hold":
            if not await reader.read(1):  # the proxy closed the request: the hang-up
                gone.set()
            return
        body = b'{"ok":true}'
        if req.target == "/v1/chat/completions":
            body = b'{"choices":[],"usage":{"prompt_tokens":1,"completion_tokens":1}}'
        writer.write(
            b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n"
            % len(body)
            + body
        )
        await writer.drain()

    engine.script = script
    proxy = start_proxy(f"e={engine.url}", args=["--engine", "e=openai"])
    try:
        for request, body in (
            (b"GET /v1/things HTTP/1.1\r\nhost: x\r\n\r\n", b'{"ok":true}'),
            (
                post("/v1/chat/completions", chat(False)),
                b'{"choices":[],"usage":{"prompt_tokens":1,"completion_tokens":1}}',
            ),
        ):
            s = connect(proxy.url)
            s.sendall(request)
            s.shutdown(socket.SHUT_WR)  # a half-close: the client still reads
            assert read_all(s) == (
                b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 200 OK\r\ncontent-type: application/json"
                b"\r\ncontent-length: %d\r\nconnection: close\r\n\r\n" % len(body) + body
            )
            s.close()
        assert sample(metrics(proxy), "phasewatch_requests_total", outcome="ok") == 1
        # a client that closes (not half-closes) is gone: its request is cancelled at once
        s = connect(proxy.url)
        s.sendall(b"GET /v1/hold HTTP/1.1\r\nhost: x\r\n\r\n")
        wait_for(lambda: any(r.target == "/v1/hold" for r in engine.requests))
        s.close()
        assert gone.wait(5), "the engine never saw the hang-up"
    finally:
        proxy.stop()


def test_an_over_limit_body_sent_with_connection_close_gets_the_413(engine):
    proxy = start_proxy(f"e={engine.url}", args=["--engine", "e=openai"])
    try:
        size = 64 * MiB + 1
        expected = answer(
            413, f"request body over {64 * MiB} bytes", "request_too_large", close=True
        )
        for framing in ("length", "chunked"):
            s = connect(proxy.url, timeout=30)
            head = b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\nconnection: close\r\n"
            if framing == "length":
                s.sendall(head + b"content-length: %d\r\n\r\n" % size)
            else:
                s.sendall(head + b"transfer-encoding: chunked\r\n\r\n")
            piece = b"a" * (1 << 20)
            sent = 0
            while sent < size:  # bounded: 65 sends
                data = piece if framing == "length" else chunk(piece)
                try:
                    s.sendall(data[: size - sent] if framing == "length" else data)
                except (BrokenPipeError, ConnectionResetError):
                    break
                sent += len(piece)
            try:
                s.shutdown(socket.SHUT_WR)
            except OSError:
                pass
            assert read_all(s) == expected, framing
            s.close()
        assert not [r for r in engine.requests if r.method == "POST"]
        assert sample(metrics(proxy), "phasewatch_rejected_total", reason="body_too_large") == 2
    finally:
        proxy.stop()


def test_a_204_on_a_generation_endpoint_is_not_a_protocol_error(engine):
    async def script(req, reader, writer):
        writer.write(b"HTTP/1.1 204 No Content\r\n\r\n")
        await writer.drain()

    engine.script = script
    proxy = start_proxy(f"e={engine.url}", args=["--engine", "e=openai"])
    try:
        s = connect(proxy.url)
        s.sendall(post("/v1/chat/completions", chat(False)))
        assert read_response(s) == b"HTTP/1.1 204 No Content\r\n\r\n"
        s.close()
        m = metrics(proxy)
        assert sample(m, "phasewatch_requests_total", outcome="ok") == 1
        assert sample(m, "phasewatch_errors_total") == 0
    finally:
        proxy.stop()


def test_the_client_request_id_is_forwarded_and_none_is_added(engine):
    proxy = start_proxy(f"e={engine.url}", args=["--engine", "e=openai"])
    try:
        httpx.post(
            proxy.url + "/v1/chat/completions",
            content=chat(False),
            headers={"x-request-id": "client-1"},
        )
        httpx.post(proxy.url + "/v1/chat/completions", content=chat(False))
        posts = [r for r in engine.requests if r.method == "POST"]
        assert posts[0].header("x-request-id") == "client-1"
        assert "x-request-id" not in posts[1].header_names()
        ids = [line["request_id"] for line in proxy.request_lines(at_least=2)]
        assert ids[0] == "client-1" and re.fullmatch(r"[0-9a-f]{32}", ids[1])
    finally:
        proxy.stop()
