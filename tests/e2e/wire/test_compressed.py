"""Engines that compress their answers (or a gateway in front of them that does).

The `openai` SDK sends ``Accept-Encoding: gzip, deflate``. phasewatch never injects what
it cannot remove: when it asks for usage the client did not, it asks the engine for an
unencoded answer (``Accept-Encoding: identity``), and an engine that compresses anyway
has its stream decoded, stripped and sent unencoded. When nothing was injected a
compressed answer passes byte for byte, measured on a decoded copy; a coding phasewatch
cannot decode passes unmeasured, counted. Through uvicorn on loopback, with a raw-socket
engine that gzips its SSE the way a streaming server does (a sync flush per event).
"""

from __future__ import annotations

import asyncio
import gzip
import json
import zlib

import httpx
import openai
import pytest

from proxy.core.coding import (
    PIECE,
    SLICE,
    Decoded,
    Decoder,
    Undecodable,
    codings,
    decodable,
    decode_whole,
    stacked,
)
from proxy.engines.sse import SSETap
from proxy.measure.timeline import Marks

from ...support.fake_engine import FakeEngine, Reply, Request, response
from ...support.servers import metric_samples, sample, start_proxy

#: How each model's engine answers: gzip only when the request accepts it, gzip whatever
#: it accepts, a coding phasewatch does not decode.
HONOUR, ALWAYS, BROTLI, CORRUPT = "gz-honour", "gz-always", "br-always", "gz-corrupt"
TOKENS = ["Hello", " there", ",", " friend"]
PAUSE = 0.25  # between the first token and the rest: a decode phase to measure


def events(model: str, include_usage: bool) -> list[bytes]:
    base = {"id": "chatcmpl-7", "object": "chat.completion.chunk", "created": 1, "model": model}

    def ev(obj: dict) -> bytes:
        return b"data: " + json.dumps({**base, **obj}, separators=(",", ":")).encode() + b"\n\n"

    def choice(delta: dict, finish=None) -> dict:
        return {
            "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}]
        }

    out = [ev(choice({"role": "assistant", "content": ""}))]
    out += [ev(choice({"content": t})) for t in TOKENS]
    out.append(ev(choice({}, "stop")))
    if include_usage:
        usage = {"prompt_tokens": 7, "total_tokens": 7 + len(TOKENS), "completion_tokens": 4}
        out.append(ev({"choices": [], "usage": usage}))
    out.append(b"data: [DONE]\n\n")
    return out


def chunk(data: bytes) -> bytes:
    return f"{len(data):x}\r\n".encode() + data + b"\r\n"


def answer(req: Request) -> Reply:
    if req.target.startswith("/v1/models"):
        ids = [{"id": m, "object": "model"} for m in (HONOUR, ALWAYS, BROTLI, CORRUPT)]
        body = json.dumps({"object": "list", "data": ids}).encode()
        return Reply(response(200, body, [("Content-Type", "application/json")]))
    obj = json.loads(req.body)
    model = obj["model"]
    accept = next((v for k, v in req.headers if k.lower() == "accept-encoding"), "")
    coded = model != HONOUR or "gzip" in accept
    label = "br" if model == BROTLI else "gzip"
    if not obj.get("stream"):
        body = json.dumps(
            {
                "id": "cmpl-1",
                "object": "chat.completion",
                "model": model,
                "choices": [{"index": 0, "message": {"role": "assistant", "content": "Hi"}}],
                "usage": {"prompt_tokens": 7, "completion_tokens": 2, "total_tokens": 9},
            }
        ).encode()
        heads = [("Content-Type", "application/json")]
        if coded:
            body = gzip.compress(body, mtime=0)
            heads.append(("Content-Encoding", label))
        return Reply(response(200, body, heads))
    include = (obj.get("stream_options") or {}).get("include_usage") is True
    evs = events(model, include)
    head = "HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n"
    if coded:
        head += f"Content-Encoding: {label}\r\nVary: Accept-Encoding\r\n"
        z = zlib.compressobj(6, zlib.DEFLATED, 31)
        pieces = [z.compress(e) + z.flush(zlib.Z_SYNC_FLUSH) for e in evs]
        pieces[-1] += z.flush()
        if model == CORRUPT:  # the coded stream breaks after its first token
            pieces[2] = b"\xff not deflate \x00" * 3
    else:
        pieces = evs
    first = head.encode() + b"\r\n" + b"".join(chunk(p) for p in pieces[:2])
    rest = b"".join(chunk(p) for p in pieces[2:]) + b"0\r\n\r\n"
    return Reply(first, later=rest, pause=PAUSE)


@pytest.fixture(scope="module")
def stack():
    with FakeEngine(answer) as engine:
        proxy = start_proxy(engine.url, args=["--metrics-public"])
        try:
            yield engine, proxy
        finally:
            proxy.stop()


def line_of(proxy, rid: str) -> dict:
    def find():
        return next((x for x in proxy.request_lines() if x.get("request_id") == rid), None)

    from ...support.servers import wait_for

    return wait_for(find, what=f"the request line of {rid}")


def engine_request(engine: FakeEngine, rid: str) -> Request:
    return next(r for r in engine.posts() if ("x-request-id", rid) in r.headers)


def sdk_stream(proxy, model: str, rid: str) -> list[str]:
    """What an ordinary SDK client does with each chunk: chunk.choices[0]."""
    client = openai.OpenAI(base_url=proxy.url + "/v1", api_key="unused", max_retries=0)
    text = []
    stream = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "hi"}],
        stream=True,
        extra_headers={"x-request-id": rid},
    )
    for c in stream:
        assert c.usage is None  # the client never asked for usage
        text.append(c.choices[0].delta.content or "")  # IndexError on a usage chunk
    return text


def assert_measured(line: dict, completion: int = 4) -> None:
    assert line["outcome"] == "ok" and "error" not in line, line
    assert int(line["completion_tokens"]) == completion and int(line["prompt_tokens"]) == 7
    assert float(line["ttft_s"]) > 0
    # the decode phase spans the engine's pause between the first token and the rest
    assert float(line["decode_tps"]) > 0, line


def test_sdk_stream_with_injected_usage_asks_for_an_unencoded_answer(stack):
    engine, proxy = stack
    assert "".join(sdk_stream(proxy, HONOUR, "honour-1")) == "".join(TOKENS)
    req = engine_request(engine, "honour-1")
    sent = dict((k.lower(), v) for k, v in req.headers)
    assert sent["accept-encoding"] == "identity"  # the SDK sent gzip, deflate
    assert json.loads(req.body)["stream_options"] == {"include_usage": True}
    assert_measured(line_of(proxy, "honour-1"))


def test_sdk_stream_from_an_engine_that_gzips_anyway_is_decoded_and_stripped(stack):
    engine, proxy = stack
    assert "".join(sdk_stream(proxy, ALWAYS, "always-1")) == "".join(TOKENS)
    assert_measured(line_of(proxy, "always-1"))
    # the client's body is exactly a direct request's (no usage asked), decoded
    body = {"model": ALWAYS, "messages": [{"role": "user", "content": "hi"}], "stream": True}
    h = {"accept-encoding": "gzip, deflate", "x-request-id": "always-2"}
    with httpx.stream("POST", proxy.url + "/v1/chat/completions", json=body, headers=h) as r:
        assert "content-encoding" not in r.headers  # sent unencoded, as decoded
        got = r.read()
    assert got == b"".join(events(ALWAYS, include_usage=False))
    assert_measured(line_of(proxy, "always-2"))


def test_compressed_stream_nothing_injected_passes_byte_exact_and_is_measured(stack):
    engine, proxy = stack
    body = {
        "model": ALWAYS,
        "messages": [{"role": "user", "content": "hi"}],
        "stream": True,
        "stream_options": {"include_usage": True},  # the client's own: nothing to strip
    }
    raw: dict[str, bytes] = {}
    for name, url, rid in (("direct", engine.url, "exact-d"), ("proxy", proxy.url, "exact-p")):
        h = {"accept-encoding": "gzip", "x-request-id": rid}
        with httpx.stream("POST", url + "/v1/chat/completions", json=body, headers=h) as r:
            assert r.headers["content-encoding"] == "gzip"
            raw[name] = b"".join(r.iter_raw())
    assert raw["proxy"] == raw["direct"]  # the engine's compressed bytes, untouched
    assert gzip.decompress(raw["proxy"]) == b"".join(events(ALWAYS, include_usage=True))
    req = engine_request(engine, "exact-p")
    assert ("accept-encoding", "gzip") in req.headers and json.loads(req.body) == body
    assert_measured(line_of(proxy, "exact-p"))


def test_compressed_whole_body_is_read(stack):
    engine, proxy = stack
    body = {"model": ALWAYS, "messages": [{"role": "user", "content": "hi"}]}
    h = {"accept-encoding": "gzip", "x-request-id": "whole-1"}
    r = httpx.post(proxy.url + "/v1/chat/completions", json=body, headers=h)
    assert r.headers["content-encoding"] == "gzip" and r.json()["usage"]["completion_tokens"] == 2
    line = line_of(proxy, "whole-1")
    assert line["outcome"] == "ok" and int(line["completion_tokens"]) == 2, line


def test_a_coding_phasewatch_cannot_decode_passes_unmeasured_and_counted(stack):
    engine, proxy = stack
    before = sample(metric_samples(proxy.url), "phasewatch_errors_total", kind="undecodable")
    body = {
        "model": BROTLI,
        "messages": [{"role": "user", "content": "hi"}],
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    raw: dict[str, bytes] = {}
    for name, url, rid in (("direct", engine.url, "br-d"), ("proxy", proxy.url, "br-p")):
        h = {"accept-encoding": "br", "x-request-id": rid}
        with httpx.stream("POST", url + "/v1/chat/completions", json=body, headers=h) as r:
            assert r.headers["content-encoding"] == "br"
            raw[name] = b"".join(r.iter_raw())
    assert raw["proxy"] == raw["direct"]
    line = line_of(proxy, "br-p")
    assert line["outcome"] == "ok" and "error" not in line, line  # not a protocol error
    after = sample(metric_samples(proxy.url), "phasewatch_errors_total", kind="undecodable")
    assert after == before + 1
    assert "which phasewatch does not decode" in proxy.log()


def test_a_compressed_stream_that_stops_decoding_passes_as_it_came_and_counts_protocol(stack):
    engine, proxy = stack
    body = {
        "model": CORRUPT,
        "messages": [{"role": "user", "content": "hi"}],
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    raw: dict[str, bytes] = {}
    for name, url, rid in (("direct", engine.url, "bad-d"), ("proxy", proxy.url, "bad-p")):
        h = {"accept-encoding": "gzip", "x-request-id": rid}
        with httpx.stream("POST", url + "/v1/chat/completions", json=body, headers=h) as r:
            raw[name] = b"".join(r.iter_raw())
    assert raw["proxy"] == raw["direct"]  # nothing of the proxy's inside a coded body
    line = line_of(proxy, "bad-p")
    assert line["outcome"] == "error" and line["error"] == "protocol", line
    assert float(line["ttft_s"]) > 0  # the first token decoded before the break


# --- the decoder, on its own ---------------------------------------------------------------


def _gzip_stream(parts: list[bytes]) -> bytes:
    z = zlib.compressobj(6, zlib.DEFLATED, 31)
    return b"".join(z.compress(p) + z.flush(zlib.Z_SYNC_FLUSH) for p in parts) + z.flush()


def whole(applied: list[bytes], data: bytes, limit: int) -> tuple[bytes | None, bool]:
    return asyncio.run(decode_whole(applied, data, limit))


def steps(d: Decoded, data: bytes, now: float) -> list[list[bytes]]:
    """`data` decoded through `d` step by step: what the tap let through at each."""
    d.take(data)
    out = []
    while True:
        got, more = d.step(now)
        out.append(got)
        if not more:
            return out


def fed(d: Decoded, data: bytes, now: float) -> bytes:
    """What the client gets of `data` through `d`: the decoded pieces the tap lets
    through, or (exact) `data` itself, measured on the side."""
    got = b"".join(b"".join(step) for step in steps(d, data, now))
    return data if d.exact else got


@pytest.mark.parametrize(
    ("coding", "encode"),
    [
        (b"gzip", lambda d: gzip.compress(d[:300], mtime=0) + gzip.compress(d[300:], mtime=0)),
        (b"deflate", zlib.compress),
        (b"deflate", lambda d: zlib.compress(d, wbits=-15)),  # raw deflate, as some send it
    ],
)
def test_every_split_of_a_coded_body_decodes_to_the_same_bytes(coding, encode):
    plain = b"".join(events(ALWAYS, True)) * 2
    data = encode(plain)
    for cut in range(len(data) + 1):
        dec = Decoder([coding])
        got = b"".join([*dec.decode(data[:cut]), *dec.decode(data[cut:]), *dec.flush()])
        assert got == plain, cut
    dec = Decoder([coding])
    assert b"".join(p for i in range(len(data)) for p in dec.decode(data[i : i + 1])) == plain


def test_a_bomb_is_decoded_a_bounded_piece_at_a_time():
    data = gzip.compress(b"\0" * (64 * PIECE), mtime=0)
    pieces = list(Decoder([b"gzip"]).decode(data))
    assert sum(map(len, pieces)) == 64 * PIECE and max(map(len, pieces)) <= PIECE
    got, over = whole([b"gzip"], data, 3 * PIECE)
    assert got is not None and len(got) == 3 * PIECE and over  # stops at the limit
    assert whole([b"gzip"], gzip.compress(b"abc"), 3) == (b"abc", False)


def test_corrupt_input_and_the_header_list():
    with pytest.raises(Undecodable):
        list(Decoder([b"gzip"]).decode(b"this is not gzip at all"))
    assert whole([b"deflate"], b"\xff" * 40, 1000) == (None, False)
    assert codings([(b"Content-Encoding", b"gzip, identity"), (b"x", b"y")]) == [b"gzip"]
    assert codings([(b"content-encoding", b"identity")]) == []
    # two codings stacked: no engine sends them (a decompression bomb's shape): refused
    two = codings([(b"content-encoding", b"deflate, gzip")])
    assert stacked(two) and not decodable(two) and decodable([b"gzip"])


def test_a_decoded_stream_is_stripped_exactly_for_every_split():
    """The decoded stream the client gets when the engine compressed anyway is the same
    as a direct unencoded answer without usage, however the coded bytes are cut."""
    data = _gzip_stream(events(ALWAYS, include_usage=True))
    want = b"".join(events(ALWAYS, include_usage=False))
    for cut in range(0, len(data) + 1, 3):
        d = Decoded(SSETap(Marks(t_recv=0.0), strip=True), [b"gzip"], exact=False)
        got = fed(d, data[:cut], 1.0) + fed(d, data[cut:], 2.0) + d.end(3.0)
        assert got == want and d.tap.done and d.broken is None, cut
        assert d.tap.usage_payload is not None


def test_a_stream_that_stops_decoding_passes_as_it_came_and_is_marked_broken():
    data = _gzip_stream(events(ALWAYS, include_usage=True))
    bad = data[:60] + b"\x00garbage that is not deflate\xff" * 4 + data[60:]
    d = Decoded(SSETap(Marks(t_recv=0.0)), [b"gzip"], exact=True)
    cuts = [bad[:50], bad[50:90], bad[90:]]
    assert [fed(d, c, 1.0) for c in cuts] == cuts  # the engine's bytes, untouched
    assert d.end(2.0) == b"" and d.broken is not None and not d.tap.done
    stripping = Decoded(SSETap(Marks(t_recv=0.0), strip=True), [b"gzip"], exact=False)
    out = b"".join(fed(stripping, c, 1.0) for c in cuts) + stripping.end(2.0)
    assert stripping.broken is not None
    assert b"".join(events(ALWAYS, False)).startswith(out)  # whole events up to the break


def test_a_small_chunk_that_decodes_to_a_great_deal_is_forwarded_a_piece_at_a_time():
    evs = events(ALWAYS, include_usage=False)
    plain = evs[0] + evs[1] * 20000 + b"".join(evs[2:])  # ~3.4 MB from ~20 KB
    data = gzip.compress(plain, mtime=0)
    assert len(plain) > 100 * len(data)
    d = Decoded(SSETap(Marks(t_recv=0.0), strip=True), [b"gzip"], exact=False)
    stepped = steps(d, data, 1.0)
    out = [piece for step in stepped for piece in step]
    assert b"".join(out) + d.end(2.0) == plain
    assert len(out) > 10 and max(map(len, out)) <= PIECE + len(evs[1])
    # a step decodes a bounded slice: the loop runs between them
    assert len(stepped) > 2 and all(sum(map(len, s)) <= SLICE + PIECE for s in stepped)
    exact = Decoded(SSETap(Marks(t_recv=0.0)), [b"gzip"], exact=True)
    assert fed(exact, data, 1.0) == data and exact.end(2.0) == b"" and exact.tap.done
