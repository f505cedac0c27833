"""Finding 1 of the third hostile-wire pass: decompression bombs from an engine.

A few KiB of ``Content-Encoding: gzip, gzip`` that decode to 2 GiB of zeros, and a 1 MiB
single-gzip body that decodes to 1 GiB, answered whole and streamed. The proxy on
loopback in front of a byte-level fake engine; memory from ``/proc``; what everyone else
sees (health latency, a paced stream's gaps) compared with a baseline measured in the
same run. The bomb's client reads the engine's coded bytes and drops them (it never
decodes them: that is its own business)."""

from __future__ import annotations

import asyncio
import functools
import json
import threading
import time
import zlib

import httpx
import pytest

from ...support.fake_engine import SSE_HEAD, FakeEngine, Request, chunk
from ...support.hostile import PeakRss
from ...support.servers import metric_samples, sample, start_proxy, wait_for
from ...support.watch import ROUNDS, Seen, Watch, within
from .test_hostile_wire import log_lines

STEADY = "steady"
EVENTS, PACE = 60, 0.025  # the well-behaved stream: 1.5 s of paced events
#: The issue's bounds: beside a baseline of the same run.
SLACK_S = 0.100
RSS_MIB = 48


@functools.cache
def gzip_zeros() -> bytes:
    """1 GiB of zeros, gzipped (about 1 MiB)."""
    z = zlib.compressobj(9, zlib.DEFLATED, 31)
    block = bytes(1 << 20)
    return b"".join(z.compress(block) for _ in range(1024)) + z.flush()


@functools.cache
def stacked_bomb() -> bytes:
    """2 GiB of zeros (two gzip members of 1 GiB), gzipped again: about 4 KiB."""
    z = zlib.compressobj(9, zlib.DEFLATED, 31)
    return z.compress(gzip_zeros() * 2) + z.flush()


def token(text: str, finish: str | None = None) -> bytes:
    obj = {
        "id": "c1",
        "object": "chat.completion.chunk",
        "created": 1,
        "model": STEADY,
        "choices": [{"index": 0, "delta": {"content": text}, "finish_reason": finish}],
    }
    return b"data: " + json.dumps(obj).encode() + b"\n\n"


#: model -> (content coding, streamed, body)
BOMBS = {
    "stacked-whole": (b"gzip, gzip", False, stacked_bomb),
    "single-whole": (b"gzip", False, gzip_zeros),
    "stacked-stream": (b"gzip, gzip", True, stacked_bomb),
    "single-stream": (b"gzip", True, gzip_zeros),
}


async def script(req: Request, reader, writer) -> None:
    model = req.json()["model"]
    if model == STEADY:
        writer.write(SSE_HEAD)
        for i in range(EVENTS):
            writer.write(chunk(token(f"t{i}")))
            await writer.drain()
            await asyncio.sleep(PACE)
        writer.write(chunk(token("", "stop") + b"data: [DONE]\n\n") + b"0\r\n\r\n")
        await writer.drain()
        return
    coding, streamed, make = BOMBS[model]
    body = make()
    if streamed:
        writer.write(SSE_HEAD[:-2] + b"content-encoding: " + coding + b"\r\n\r\n")
        for i in range(0, len(body), 65536):  # as a stream comes: a read at a time
            writer.write(chunk(body[i : i + 65536]))
            await writer.drain()
        writer.write(b"0\r\n\r\n")
    else:
        writer.write(
            b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-encoding: "
            + coding
            + b"\r\ncontent-length: %d\r\n\r\n" % len(body)
            + body
        )
    await writer.drain()


@pytest.fixture(scope="module")
def proxy():
    for make in (gzip_zeros, stacked_bomb):
        make()  # made before any timing starts
    engine = FakeEngine(models=[STEADY, *BOMBS], script=script).start()
    p = start_proxy(f"e={engine.url}", args=["--engine", "e=openai"])
    yield p
    p.stop()
    engine.stop()


def bomb(url: str, model: str) -> int:
    """Ask for `model`'s bomb (with usage asked for, so nothing is injected and the
    engine's bytes pass as they are); read the coded bytes and drop them."""
    body = {"model": model, "messages": [{"role": "user", "content": "x"}]}
    if BOMBS[model][1]:
        body |= {"stream": True, "stream_options": {"include_usage": True}}
    got = 0
    with (
        httpx.Client(timeout=120) as client,
        client.stream("POST", url + "/v1/chat/completions", json=body) as r,
    ):
        assert r.status_code == 200
        for piece in r.iter_raw():
            got += len(piece)
    return got


def decode_limits(url: str) -> float:
    return sample(metric_samples(url), "phasewatch_errors_total", kind="decode_limit")


@pytest.mark.parametrize("model", ["stacked-whole", "single-whole"])
def test_a_whole_body_bomb_leaves_memory_bounded(proxy, model):
    pid = proxy.proc.pid
    before = decode_limits(proxy.url)
    with Watch(proxy.url, STEADY) as warm:  # an ordinary request first: the baseline
        warm.wait()
    done = len(proxy.request_lines())
    with PeakRss(pid) as rss:
        got = bomb(proxy.url, model)
        # the body is decoded after its last byte went out: until the request is recorded
        proxy.request_lines(at_least=done + 1, timeout=120)
    print(f"{model}: {got} coded bytes relayed, peak RSS +{rss.growth_mib:.1f} MiB")
    assert got == len(BOMBS[model][2]())  # the engine's bytes, unchanged
    assert rss.growth_mib <= RSS_MIB
    wait_for(lambda: decode_limits(proxy.url) >= before + 1, what="the refusal counted")
    assert log_lines(proxy, "decodes past its cap" if "single" in model else "stacked content")


def watched(url: str, hostile) -> Seen:
    """The watch's window, with `hostile` run over and over on two threads meanwhile."""
    with Watch(url, STEADY) as watch:
        stop = threading.Event()

        def loop() -> None:
            while watch.running and not stop.is_set():
                hostile()

        threads = [threading.Thread(target=loop, daemon=True) for _ in range(2 if hostile else 0)]
        for t in threads:
            t.start()
        seen = watch.wait()
        stop.set()
        for t in threads:
            t.join(120)
    return seen


@pytest.mark.parametrize("model", ["stacked-stream", "single-stream"])
def test_a_streamed_bomb_does_not_stall_anyone_else(proxy, model):
    before = decode_limits(proxy.url)
    bomb(proxy.url, model)  # warm: the first of each is no slower for the watch
    rounds = []
    for _ in range(ROUNDS):
        base = watched(proxy.url, None)
        t0 = time.monotonic()
        hostile = watched(proxy.url, lambda: bomb(proxy.url, model))
        took = time.monotonic() - t0
        print(f"{model}: baseline {base}; under bombs {hostile} ({took:.1f} s)")
        assert base.events == hostile.events == EVENTS + 2
        rounds.append((base, hostile))
        if within(base, hostile, SLACK_S):
            break
    assert within(base, hostile, SLACK_S), [f"{b} / {h}" for b, h in rounds]
    assert decode_limits(proxy.url) > before + 1  # every bomb refused (or cut) and counted
