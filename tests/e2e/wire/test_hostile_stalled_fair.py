"""The stalled-stream cap is fair between clients: one client holding many streams it
never reads cannot get another client's stream closed.

A legitimate client's stream stalls first (it paused reading); then an attacker opens
many streams it never reads, far past ``--max-stalled-streams``. Each time the cap is
passed, a stream of the client holding the most is closed: the attacker's, never the
legitimate one, which then reads its whole stream to its end. A client is its API key's
name where the key names one, else its address.
"""

from __future__ import annotations

import json
import socket
import time

import pytest

from ...support.fake_engine import SSE_HEAD, FakeEngine, chunk
from ...support.hostile import MODEL, token_event
from ...support.servers import metric_samples, sample, start_proxy, wait_for

PIECES = 2500  # 41 MB a stream: far more than the socket buffers on the way hold


@pytest.fixture
def engine():
    """An engine that streams as fast as it is read, counting what it wrote for each
    request by its prompt."""

    async def script(req, reader, writer):
        who = req.json()["messages"][0]["content"]
        writer.write(SSE_HEAD)
        piece = chunk(token_event("x" * 4000) * 4)
        try:
            for _ in range(PIECES):
                writer.write(piece)
                await writer.drain()
                written[who] = written.get(who, 0) + len(piece)
            writer.write(chunk(b"data: [DONE]\n\n") + b"0\r\n\r\n")
            await writer.drain()
        except ConnectionError:
            pass

    written: dict[str, int] = {}
    engine = FakeEngine(models=[MODEL], script=script)
    engine.written = written  # type: ignore[attr-defined]
    yield engine.start()
    engine.stop()


def stream(url: str, source: str, who: str, key: str | None, small: bool = True) -> socket.socket:
    """A streaming request from address `source` whose client does not read (yet); with
    `small` its receive buffer is small (it stalls soon, and could never read fast)."""
    host, port = url.rsplit("/", 1)[1].split(":")
    s = socket.socket()
    if small:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    s.settimeout(30)
    s.bind((source, 0))
    s.connect((host, int(port)))
    body = json.dumps(
        {"model": MODEL, "messages": [{"role": "user", "content": who}], "stream": True}
    ).encode()
    auth = b"authorization: Bearer %s\r\n" % key.encode() if key else b""
    s.sendall(
        b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
        + auth
        + b"content-length: %d\r\n\r\n" % len(body)
        + body
    )
    return s


def stalled(engine, who: str, quiet: float = 0.3) -> bool:
    """Whether the engine's writes for `who` have stopped growing for `quiet` s (the
    proxy stopped reading them: the client's stream is stalled)."""
    seen = engine.written.get(who, 0)
    state = engine.__dict__.setdefault("seen", {})
    now = time.monotonic()
    last, since = state.get(who, (None, now))
    if last != seen:
        state[who] = (seen, now)
        return False
    return seen > 0 and now - since >= quiet


def read_to_end(s: socket.socket) -> bytes:
    """The rest of the response, read to its last chunk (or the close); returns its tail."""
    tail = b""
    while not tail.endswith(b"0\r\n\r\n"):
        piece = s.recv(1 << 20)
        if not piece:
            break
        tail = (tail + piece)[-4096:]
    return tail


@pytest.mark.parametrize("by", ["address", "key"])
def test_an_attackers_stalled_streams_never_close_a_legitimate_one(engine, by):
    keys = ["--api-key", "victim=kv", "--api-key", "attacker=ka"] if by == "key" else []
    proxy = start_proxy(
        f"e={engine.url}",
        args=["--engine", "e=openai", "--max-stalled-streams", "8", *keys],
    )
    # by address: two loopback addresses, no keys; by key: one address, two named keys
    victim_at, attacker_at = ("127.0.0.3", "127.0.0.2") if by == "address" else ("127.0.0.1",) * 2
    victim_key, attacker_key = ("kv", "ka") if by == "key" else (None, None)
    socks: list[socket.socket] = []
    try:
        victim = stream(proxy.url, victim_at, "victim", victim_key, small=False)
        socks.append(victim)
        wait_for(lambda: stalled(engine, "victim"), what="the victim's stream stalled")

        def closed() -> float:
            samples = metric_samples(proxy.url) if by == "address" else keyed(proxy)
            return sample(samples, "phasewatch_rejected_total", reason="stalled_stream")

        for i in range(20):
            socks.append(stream(proxy.url, attacker_at, f"attacker {i}", attacker_key))
        # 21 stalled, 8 may be: 13 closed, every one the attacker's
        wait_for(lambda: closed() == 13, what="the attacker's streams over the cap closed")
        data = read_to_end(victim)
        assert data.endswith(b"data: [DONE]\n\n\r\n0\r\n\r\n"), data[-200:]
        print(f"by {by}: 13 of the attacker's 20 stalled streams closed, the victim's read whole")
    finally:
        for s in socks:
            s.close()
        proxy.stop()


def keyed(proxy) -> dict:
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(proxy.url + "/metrics", headers={"authorization": "Bearer kv"}).text
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for f in text_string_to_metric_families(text)
        for s in f.samples
    }
