"""Streams whose clients never read: their number is capped (--max-stalled-streams).

A stream whose client stopped reading holds what the proxy read from the engine and has
not been able to write (about two upstream reads, some 2 MiB). Past the cap the stream
stalled longest is closed: its request ends as a hang-up, the engine's work is cancelled,
and the proxy's memory stops growing with the number of such clients.
"""

from __future__ import annotations

import json
import socket

import pytest

from ...support.fake_engine import SSE_HEAD, FakeEngine, chunk
from ...support.hostile import (
    MODEL,
    connect,
    fds,
    status_kib,
    token_event,
)
from ...support.servers import metric_samples, sample, start_proxy, wait_for
from .test_hostile_wire import log_lines


@pytest.fixture
def engine():
    """An engine that streams as fast as it is read (80 MB at most)."""

    async def script(req, reader, writer):
        writer.write(SSE_HEAD)
        piece = chunk(token_event("x" * 4000) * 4)
        try:
            for _ in range(5000):  # bounded
                writer.write(piece)
                await writer.drain()
            writer.write(chunk(b"data: [DONE]\n\n") + b"0\r\n\r\n")
            await writer.drain()
        except ConnectionError:
            engine.event("cancelled")
            cancelled.append(1)

    cancelled: list[int] = []
    engine = FakeEngine(models=[MODEL], script=script)
    engine.cancelled = cancelled  # type: ignore[attr-defined]
    yield engine.start()
    engine.stop()


def _stall(url: str, n: int) -> list[socket.socket]:
    """`n` streaming requests whose clients never read a byte."""
    body = json.dumps(
        {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "stream": True}
    ).encode()
    request = (
        b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
        b"content-length: %d\r\n\r\n" % len(body) + body
    )
    socks = []
    for _ in range(n):
        s = connect(url)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        s.sendall(request)
        socks.append(s)
    return socks


def test_streams_whose_clients_never_read_are_capped(engine):
    proxy = start_proxy(
        f"e={engine.url}", args=["--engine", "e=openai", "--max-stalled-streams", "4"]
    )
    socks: list[socket.socket] = []
    try:
        pid = proxy.proc.pid
        base_fds = fds(pid)

        def closed() -> float:
            return sample(
                metric_samples(proxy.url), "phasewatch_rejected_total", reason="stalled_stream"
            )

        socks += _stall(proxy.url, 12)
        wait_for(lambda: closed() == 8, what="all but 4 stalled streams closed")
        first = status_kib(pid, "VmRSS") / 1024
        for batch in range(6):  # 24 more, a few at a time (the cap holds between bursts)
            socks += _stall(proxy.url, 4)
            wait_for(lambda b=batch: closed() == 12 + 4 * b, what="all but 4 stalled closed")
        second = status_kib(pid, "VmRSS") / 1024
        print(f"12 stalled streams: RSS {first:.0f} MiB; 36: {second:.0f} MiB")
        # each stream held ~2 MiB: 24 more uncapped would be ~48 MiB more
        assert second - first < 16, f"RSS grew {second - first:.0f} MiB with 24 more"
        s = metric_samples(proxy.url)
        assert sample(s, "phasewatch_in_flight_requests") == 4
        wait_for(lambda: len(engine.cancelled) == 32, what="the engine's work cancelled")
        assert len(log_lines(proxy, "its client stopped reading")) == 1
        wait_for(lambda: fds(pid) <= base_fds + 4 + 4 + 2, what="closed streams' fds freed")
    finally:
        for s in socks:
            s.close()
        proxy.stop()
