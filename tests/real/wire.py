"""Raw HTTP helpers for the real-engine tier: capture exact bytes, set aside the fields an
engine varies per request, hang up mid-stream, read Prometheus pages."""

from __future__ import annotations

import json
import re
import socket
import time
from dataclasses import dataclass, field
from urllib.parse import urlsplit

import httpx

#: Connection-level headers (RFC 9110 §7.6.1) and the per-response `date`: everything
#: else is end-to-end and must reach the client unchanged.
HOP = {
    "connection",
    "keep-alive",
    "proxy-connection",
    "te",
    "trailer",
    "transfer-encoding",
    "upgrade",
    "date",
}

_ID = re.compile(rb'"id":"[^"]*"')
_CREATED = re.compile(rb'"created":\d+')
_TIMINGS = re.compile(rb'"timings":\{[^{}]*\}')
_NUMBER = re.compile(rb'":-?[0-9][0-9.eE+-]*')
#: An event that carries generated output (text, reasoning or tool-call delta).
_OUTPUT = re.compile(rb'"(?:content|text|reasoning_content)":"(?!")|"tool_calls":\[\{')


@dataclass
class Captured:
    status: int
    headers: list[tuple[str, str]]  # names lower-cased, in order
    body: bytes
    chunks: list[tuple[float, bytes]] = field(default_factory=list)  # (s since send, bytes)
    t_send: float = 0.0  # time.monotonic() when the request went out

    def end_to_end_headers(self) -> list[tuple[str, str]]:
        """End-to-end headers; content-length as "=body" when it matches the body (its
        value varies with per-request fields such as llama-server's timings)."""
        out = []
        for k, v in self.headers:
            if k in HOP:
                continue
            if k == "content-length" and v == str(len(self.body)):
                v = "=body"
            out.append((k, v))
        return out

    def events(self) -> list[bytes]:
        return sse_events(self.body)

    def json(self):
        return json.loads(self.body)


def capture(
    base: str,
    path: str,
    body: dict | bytes | None = None,
    *,
    method: str = "POST",
    headers: dict | None = None,
    timeout: float = 300.0,
) -> Captured:
    """One request; every byte of the response with the arrival time of each read."""
    content = json.dumps(body).encode() if isinstance(body, dict) else body
    hdrs = (
        {"content-type": "application/json", **(headers or {})}
        if content is not None
        else dict(headers or {})
    )
    with httpx.Client(timeout=httpx.Timeout(timeout, connect=10.0), trust_env=False) as client:
        t0 = time.monotonic()
        with client.stream(method, base + path, content=content, headers=hdrs) as resp:
            chunks = [(time.monotonic() - t0, c) for c in resp.iter_raw()]
            return Captured(
                resp.status_code,
                [(k.decode("latin-1").lower(), v.decode("latin-1")) for k, v in resp.headers.raw],
                b"".join(c for _, c in chunks),
                chunks,
                t0,
            )


def sse_events(body: bytes) -> list[bytes]:
    sep = b"\r\n\r\n" if b"\r\n\r\n" in body else b"\n\n"
    parts = body.split(sep)
    return [p for p in parts if p]


def normalize(body: bytes) -> bytes:
    """Set aside what an engine varies per request: ids, `created`, and the *values* in
    llama-server's `timings` (its keys and their order stay compared)."""
    body = _ID.sub(b'"id":"<id>"', body)
    body = _CREATED.sub(b'"created":0', body)
    return _TIMINGS.sub(lambda m: _NUMBER.sub(b'":0', m.group(0)), body)


def payloads(body: bytes) -> list:
    """The JSON payloads of an SSE body (`[DONE]` kept as the string)."""
    out = []
    for ev in sse_events(body):
        for line in ev.split(b"\n"):
            if line.startswith(b"data: "):
                data = line[6:]
                out.append("[DONE]" if data == b"[DONE]" else json.loads(data))
    return out


def event_times(cap: Captured) -> list[tuple[float, bytes]]:
    """(arrival time in s since send, event) for every SSE event of a captured stream."""
    out, buf = [], b""
    for t, chunk in cap.chunks:
        buf += chunk
        while (i := buf.find(b"\n\n")) >= 0:
            out.append((t, buf[:i]))
            buf = buf[i + 2 :]
    return out


def output_times(cap: Captured) -> list[float]:
    """Arrival times (s since send) of the events that carry generated output."""
    return [t for t, ev in event_times(cap) if _OUTPUT.search(ev)]


def hang_up_after(
    base: str,
    path: str,
    body: dict,
    events: int,
    *,
    headers: dict | None = None,
    timeout: float = 120.0,
    before_close=None,
) -> tuple[bytes, float]:
    """Open a stream with a plain socket, read until `events` output events arrived, call
    `before_close()` (the stream still open), then close the socket (FIN) mid-stream.
    Returns (bytes read, time.monotonic() at close)."""
    u = urlsplit(base)
    raw = json.dumps(body).encode()
    extra = "".join(f"{k}: {v}\r\n" for k, v in (headers or {}).items())
    req = (
        f"POST {path} HTTP/1.1\r\nHost: {u.hostname}:{u.port}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(raw)}\r\n{extra}\r\n"
    ).encode() + raw
    sock = socket.create_connection((u.hostname, u.port), timeout=timeout)
    got = b""
    try:
        sock.sendall(req)
        while len(_OUTPUT.findall(got)) < events:
            data = sock.recv(65536)
            if not data:
                raise AssertionError(
                    f"stream ended before {events} output events:\n{got[-2000:]!r}"
                )
            got += data
        if before_close is not None:
            before_close()
    finally:
        sock.close()
    return got, time.monotonic()


def prom(url: str, path: str = "/metrics") -> dict[tuple[str, tuple], float]:
    """Every sample of a Prometheus page keyed by (name, sorted label items)."""
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(url + path, timeout=10, trust_env=False).text
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def total(samples: dict, name: str, **labels) -> float:
    """Sum of the samples of `name` whose labels include `labels`."""
    return sum(
        v
        for (n, items), v in samples.items()
        if n == name and all(dict(items).get(k) == val for k, val in labels.items())
    )


def wait_for(predicate, timeout: float, interval: float = 0.02, what: str = "condition"):
    """Poll until predicate() is truthy; returns (value, seconds waited)."""
    t0 = time.monotonic()
    while True:
        value = predicate()
        if value:
            return value, time.monotonic() - t0
        if time.monotonic() - t0 > timeout:
            raise AssertionError(f"{what} not reached within {timeout}s")
        time.sleep(interval)
