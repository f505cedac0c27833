"""Finding 1 of the fourth hostile pass: what the stall watcher must not call a stall.

- **A client that stops reading.** One streaming request whose client never reads: the
  proxy rightly pauses the upstream read (backpressure), and the stream's output stops
  advancing, but the engine is not silent: its client is. A stuck engine beside it (a
  control, sent later, so silent for less time) is detected; the held stream must change
  neither the stall counter, nor readiness, nor the pool's routing, and is counted in a
  figure of its own (``phasewatch_client_held_streams``).
- **A long prompt after short ones.** A prefill rate learnt on tiny prompts must not set
  the allowance of a 100k-token prompt: the rates are kept per prompt band, and a band
  not measured yet is given the slow fallback rate. The engine holds the long prompt's
  first token until the proxy's own view says the stream has been silent three times the
  allowance the tiny prompts' rate would give it.

The proxy on loopback with ``--stall-floor 1``, byte-level fake engines.
"""

from __future__ import annotations

import asyncio
import json
import threading

import httpx
import pytest

from ...support.fake_engine import SSE_HEAD, FakeEngine, Request, chunk
from ...support.hostile import connect, token_event
from ...support.servers import metric_samples, sample, start_proxy, wait_for

FLOOR = 1.0
POOLED, CONTROL, BIG = "m", "ctl", "big"
BIG_BYTES = 400_000  # some 100k tokens of prompt
ROLE = (
    b'data: {"id":"c1","object":"chat.completion.chunk","created":1,"model":"m",'
    b'"choices":[{"index":0,"delta":{"role":"assistant","content":""},"finish_reason":null}]}'
    b"\n\n"
)
DONE = b"data: [DONE]\n\n"
FILLER = "x" * 4000


def usage(prompt_tokens: int) -> bytes:
    obj = {
        "id": "c1",
        "object": "chat.completion.chunk",
        "created": 1,
        "model": "m",
        "choices": [],
        "usage": {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": 3,
            "total_tokens": prompt_tokens + 3,
        },
    }
    return b"data: " + json.dumps(obj).encode() + b"\n\n"


def _content(req: Request) -> str:
    obj = req.json() or {}
    return str((obj.get("messages") or [{}])[0].get("content", ""))


async def _finish(writer: asyncio.StreamWriter, prompt_tokens: int = 5) -> None:
    for text in ("a", "b", "c"):
        writer.write(chunk(token_event(text)))
    writer.write(chunk(token_event("", finish="stop") + usage(prompt_tokens) + DONE) + b"0\r\n\r\n")
    await writer.drain()


def pooled_script():
    async def script(req: Request, reader, writer) -> None:
        writer.write(SSE_HEAD + chunk(ROLE))
        if _content(req) != "flood":
            await _finish(writer)
            return
        # a long generation, as fast as the proxy takes it
        while True:
            writer.write(chunk(token_event(FILLER)))
            await writer.drain()

    return script


async def stuck_script(req: Request, reader, writer) -> None:
    """The head and a role-only first event, then silence until the proxy hangs up."""
    writer.write(SSE_HEAD + chunk(ROLE))
    await writer.drain()
    while await reader.read(65536):
        pass
    writer.close()


def big_script(engine: list[FakeEngine]):
    async def script(req: Request, reader, writer) -> None:
        writer.write(SSE_HEAD)
        await writer.drain()
        if len(req.body) < BIG_BYTES:
            # a tiny prompt said to be 1,000 tokens, prefilled at once: a fast rate
            writer.write(chunk(ROLE))
            await _finish(writer, prompt_tokens=1000)
            return
        go = engine[0].event("go")
        while not go.is_set():
            await asyncio.sleep(0.01)
        writer.write(chunk(ROLE))
        await _finish(writer, prompt_tokens=100_000)

    return script


@pytest.fixture(scope="module")
def scene():
    holder: list[FakeEngine] = []
    engines = {
        "a": FakeEngine(models=[POOLED], script=pooled_script()).start(),
        "b": FakeEngine(models=[POOLED], script=pooled_script()).start(),
        "c": FakeEngine(models=[CONTROL], script=stuck_script).start(),
        "d": FakeEngine(models=[BIG], script=big_script(holder), keep_bodies_up_to=1 << 20),
    }
    holder.append(engines["d"])
    engines["d"].start()
    args = ["--balance", "round-robin", "--stall-floor", str(FLOOR)]
    for name in engines:
        args += ["--engine", f"{name}=openai"]
    proxy = start_proxy(*(f"{n}={e.url}" for n, e in engines.items()), args=args)
    client = httpx.Client(base_url=proxy.url, timeout=httpx.Timeout(10, read=120))
    threads: list[threading.Thread] = []
    try:
        yield {"engines": engines, "proxy": proxy, "client": client, "bg": threads}
    finally:
        proxy.stop()
        for t in threads:
            t.join(timeout=30)
        client.close()
        for e in engines.values():
            e.stop()


def _chat(model: str, content: str, stream: bool = True) -> dict:
    return {"model": model, "messages": [{"role": "user", "content": content}], "stream": stream}


def _stalls(url: str, upstream: str) -> float:
    return sample(metric_samples(url), "phasewatch_stalls_total", upstream=upstream)


def _posts(engine: FakeEngine) -> int:
    return sum(1 for r in engine.posts() if "chat/completions" in r.target)


def test_a_client_that_stops_reading_is_not_an_engine_stall(scene):
    engines, proxy, client = scene["engines"], scene["proxy"], scene["client"]
    a, b = engines["a"], engines["b"]
    # the held stream: sent, never read
    body = json.dumps(_chat(POOLED, "flood")).encode()
    held = connect(proxy.url)
    held.sendall(
        b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
        b"content-length: %d\r\n\r\n" % len(body) + body
    )
    try:
        wait_for(lambda: _posts(a) + _posts(b) == 1, 10, "the held stream upstream")
        member = "a" if _posts(a) else "b"
        other = "b" if member == "a" else "a"

        # the proxy sees its client hold it back (or, unfixed, calls the engine stalled)
        def held_or_stalled() -> bool:
            s = metric_samples(proxy.url)
            return (
                sample(s, "phasewatch_client_held_streams", upstream=member) >= 1
                or sample(s, "phasewatch_stalls_total", upstream=member) > 0
            )

        wait_for(held_or_stalled, 30, "the stream held back by its client")

        # a stuck engine, sent after: detected first (its silence is the shorter)
        out: list = []

        def control() -> None:
            try:
                with client.stream("POST", "/v1/chat/completions", json=_chat(CONTROL, "hi")) as r:
                    for _ in r.iter_raw():
                        pass
            except httpx.HTTPError as exc:
                out.append(exc)

        t = threading.Thread(target=control, daemon=True)
        t.start()
        scene["bg"].append(t)
        wait_for(lambda: _stalls(proxy.url, "c") >= 1, 30, "the control's stall")

        ready = client.get("/phasewatch/ready").json()
        stalled = {u["name"]: u["stalled"] for u in ready["upstreams"]}
        about = [r for r in ready["reasons"] if f"upstream {member}" in r]
        before = {member: _posts(engines[member]), other: _posts(engines[other])}
        for _ in range(10):
            r = client.post("/v1/chat/completions", json=_chat(POOLED, "hi"))
            assert r.status_code == 200, r.text
        routed = {n: _posts(engines[n]) - before[n] for n in (member, other)}
        samples = metric_samples(proxy.url)
        figures = {
            "stalls_total": sample(samples, "phasewatch_stalls_total", upstream=member),
            "ready_reasons": about,
            "stalled": stalled[member],
            "routed_of_10": routed,
            "client_held": sample(samples, "phasewatch_client_held_streams", upstream=member),
        }
        print(f"held stream on {member}: {figures}")
        assert figures["stalls_total"] == 0, figures
        assert not about and stalled[member] == 0, figures
        assert routed == {member: 5, other: 5}, figures
        assert figures["client_held"] == 1, figures
        assert sample(samples, "phasewatch_stalled_streams", upstream="c") == 1
        cards = {u["name"]: u for u in client.get("/phasewatch/api/summary").json()["upstreams"]}
        assert cards[member]["client_held"] == 1 and cards[member]["stalled"] == 0
    finally:
        held.close()
    # once the client is gone, the figure goes with it
    wait_for(
        lambda: sample(metric_samples(proxy.url), "phasewatch_client_held_streams") == 0,
        30,
        "the held stream's end",
    )


def test_a_long_prompt_is_not_judged_by_a_rate_learnt_on_tiny_ones(scene):
    engines, proxy, client = scene["engines"], scene["proxy"], scene["client"]
    d = engines["d"]
    for _ in range(3):
        with client.stream("POST", "/v1/chat/completions", json=_chat(BIG, "hi")) as r:
            assert r.status_code == 200
            r.read()
    # the tiny prompts' rate, as the proxy measured it (prompt tokens / time to first token)
    s = metric_samples(proxy.url)
    rate_count = sample(s, "phasewatch_prefill_seconds_count", upstream="d")
    assert rate_count >= 3, rate_count

    got: list = []

    def long_prompt() -> None:
        body = _chat(BIG, "word " * (BIG_BYTES // 5))
        try:
            r = client.post("/v1/chat/completions", json=body)
            got.append((r.status_code, r.text))
        except httpx.HTTPError as exc:
            got.append(exc)

    t = threading.Thread(target=long_prompt, daemon=True)
    t.start()
    scene["bg"].append(t)
    try:
        # silent for three times what the tiny prompts' rate (some 500k tokens/s: 1,000
        # tokens in about a millisecond) would allow a 133k-token estimate, floor included
        wait_for(
            lambda: (
                sample(
                    metric_samples(proxy.url),
                    "phasewatch_stream_longest_silence_seconds",
                    upstream="d",
                )
                >= 3 * FLOOR + 1
            ),
            60,
            "a long silence before the first token",
        )
        stalls = _stalls(proxy.url, "d")
        ready = client.get("/phasewatch/ready").json()
    finally:
        d.event("go").set()
    t.join(60)
    print(f"long prompt: stalls {stalls}, ready reasons {ready['reasons']}")
    assert stalls == 0
    assert not [r for r in ready["reasons"] if "upstream d" in r]
    assert got and isinstance(got[0], tuple) and got[0][0] == 200, got
