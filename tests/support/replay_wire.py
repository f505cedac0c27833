"""Replay upstreams for the Ollama / llama-server wire fixtures and the real llama-server
captures (``tests/fixtures/wire`` and ``tests/fixtures/llama-server/captures``).

- :class:`WireReplay` serves the constructed fixtures of fixtures/wire, chosen by an
  ``x-fixture`` request header (the proxy forwards it). When the request asks for usage
  (``stream_options.include_usage``) it serves the fixture's usage variant, as the engine
  would: that is how injected usage reaches the proxy, which must strip it again.
- :class:`CaptureReplay` serves the real llama-server captures, matched by request (method,
  path, JSON body), with the captured HTTP chunking (one HTTP chunk per write).
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

from .replay import FIXTURES

WIRE = FIXTURES / "wire"
LLAMA = FIXTURES / "llama-server" / "captures"

#: Fixtures that only exist with usage: the plain variant, derived independently by
#: parsing each event (dropping the usage event and every "usage" key) and re-encoding it
#: the way Go does (compact, `<>&` escaped), as fixtures/wire §2.2 says the engine sends it.
DERIVED = {
    "ollama-v1-completions-stream.sse": "ollama-v1-completions-stream-usage.sse",
    "ollama-v1-chat-stream-legacy.sse": "ollama-v1-chat-stream-usage-legacy.sse",
}
#: What the engine sends for the same request once include_usage is on.
USAGE_VARIANT = {
    "ollama-v1-chat-stream.sse": "ollama-v1-chat-stream-usage.sse",
    "ollama-v1-completions-stream.sse": "ollama-v1-completions-stream-usage.sse",
    "ollama-v1-chat-stream-legacy.sse": "ollama-v1-chat-stream-usage-legacy.sse",
    "llamacpp-chat-stream.sse": "llamacpp-chat-stream-usage.sse",
}


def manifest() -> dict[str, dict]:
    data = json.loads((WIRE / "MANIFEST.json").read_text())
    return {f["file"]: f for f in data["fixtures"]}


def go_json(obj) -> bytes:
    text = json.dumps(obj, ensure_ascii=False, separators=(",", ":"))
    return text.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026").encode()


def without_usage(sse: bytes) -> bytes:
    """An Ollama /v1 stream as sent without include_usage, derived from one sent with it."""
    out = []
    for ev in sse.split(b"\n\n"):
        if not ev:
            continue
        payload = ev[len(b"data: ") :]
        if payload == b"[DONE]":
            out.append(ev)
            continue
        obj = json.loads(payload)
        if obj.get("choices") == []:
            continue
        obj.pop("usage", None)
        out.append(b"data: " + go_json(obj))
    return b"".join(e + b"\n\n" for e in out)


def fixture_body(name: str) -> bytes:
    if name in DERIVED:
        return without_usage((WIRE / DERIVED[name]).read_bytes())
    return (WIRE / name).read_bytes()


def split_events(body: bytes, ndjson: bool) -> list[bytes]:
    sep = b"\n" if ndjson else b"\n\n"
    parts = body.split(sep)
    out = [p + sep for p in parts[:-1]]
    if parts[-1]:
        out.append(parts[-1])
    return out


async def _read(receive) -> bytes:
    body = b""
    while True:
        msg = await receive()
        body += msg.get("body", b"")
        if not msg.get("more_body"):
            return body


async def _lifespan(receive, send) -> None:
    while True:
        msg = await receive()
        await send({"type": msg["type"] + ".complete"})
        if msg["type"] == "lifespan.shutdown":
            return


def _wants_usage(body: bytes) -> bool:
    try:
        obj = json.loads(body)
    except ValueError:
        return False
    opts = obj.get("stream_options") if isinstance(obj, dict) else None
    return isinstance(opts, dict) and opts.get("include_usage") is True


class WireReplay:
    """ASGI upstream serving fixtures/wire files; `engine` picks the metadata it serves."""

    def __init__(self, engine: str = "ollama", gap: float = 0.002) -> None:
        self.engine = engine
        self.gap = gap
        self.manifest = manifest()
        self.served: list[str] = []
        self.requests: list[bytes] = []

    def _meta(self, name: str) -> dict:
        return self.manifest.get(name) or self.manifest[DERIVED[name]]

    async def __call__(self, scope, receive, send):
        if scope["type"] == "lifespan":
            await _lifespan(receive, send)
            return
        body = await _read(receive)
        headers = dict(scope["headers"])
        name = headers.get(b"x-fixture", b"").decode()
        path = scope["path"]
        if not name:
            name = {
                ("ollama", "/api/tags"): "ollama-tags.json",
                ("ollama", "/api/ps"): "ollama-ps.json",
                ("ollama", "/api/show"): "ollama-show.json",
                ("ollama", "/v1/models"): "ollama-v1-models.json",
                ("vllm", "/v1/models"): "vllm-models.json",
            }.get((self.engine, path), "")
        if not name and self.engine == "ollama" and path == "/api/version":
            await self._send(
                send,
                200,
                [(b"content-type", b"application/json; charset=utf-8")],
                [b'{"version":"0.12.3"}'],
            )
            return
        if not name:
            await self._send(send, 404, [(b"content-type", b"text/plain")], [b"404 page not found"])
            return
        if _wants_usage(body) and name in USAGE_VARIANT:
            name = USAGE_VARIANT[name]
        self.served.append(name)
        self.requests.append(body)
        meta = self._meta(name)
        ctype = next(v for k, v in meta["headers"].items() if k.lower() == "content-type")
        data = fixture_body(name)
        stream = "chunked" in json.dumps(meta["headers"]).lower()
        events = split_events(data, ctype.startswith("application/x-ndjson")) if stream else [data]
        hdrs = [(b"content-type", ctype.encode())]
        if not stream:
            hdrs.append((b"content-length", str(len(data)).encode()))
        await self._send(send, meta["status"], hdrs, events)

    async def _send(self, send, status, headers, parts):
        await send({"type": "http.response.start", "status": status, "headers": headers})
        for p in parts:
            await send({"type": "http.response.body", "body": p, "more_body": True})
            if len(parts) > 1:
                await asyncio.sleep(self.gap)
        await send({"type": "http.response.body", "body": b"", "more_body": False})


# --- real llama-server captures ----------------------------------------------------------------

_SKIP = {"transfer-encoding", "content-length", "keep-alive", "connection", "date"}


class LlamaCapture:
    def __init__(self, name: str) -> None:
        self.name = name
        raw = (LLAMA / f"{name}.request.http").read_bytes()
        head, _, self.request_body = raw.partition(b"\r\n\r\n")
        self.method, self.path, _ = head.split(b"\r\n", 1)[0].decode().split(" ", 2)
        lines = (LLAMA / f"{name}.response.headers").read_text().splitlines()
        self.status = int(lines[0].split()[1])
        self.headers = []
        for line in lines[1:]:
            if ":" in line:
                k, v = line.split(":", 1)
                if k.strip().lower() not in _SKIP:
                    self.headers.append((k.strip().lower().encode(), v.strip().encode()))
        self.body = (LLAMA / f"{name}.response.body").read_bytes()
        timing = LLAMA / f"{name}.timing.json"
        sizes = (
            [c["size"] for c in json.loads(timing.read_text()).get("chunks", [])]
            if timing.exists()
            else []
        )
        self.chunked = b"chunked" in (LLAMA / f"{name}.response.headers").read_bytes().lower()
        self.parts = []
        if self.chunked and sum(sizes) == len(self.body):
            pos = 0
            for size in sizes:
                self.parts.append(self.body[pos : pos + size])
                pos += size
        else:
            self.parts = [self.body]

    def key(self):
        return _key(self.method, self.path, self.request_body)

    def content_type(self) -> str:
        return dict(self.headers).get(b"content-type", b"").decode()


def _key(method: str, path: str, body: bytes):
    try:
        canonical = json.dumps(json.loads(body), sort_keys=True) if body else ""
    except ValueError:
        canonical = body.decode("latin-1")
    return (method, path, canonical)


def llama_captures() -> dict[str, LlamaCapture]:
    names = sorted({p.name.split(".")[0] for p in LLAMA.glob("*.request.http")})
    return {n: LlamaCapture(n) for n in names if not n.startswith("abort")}


class CaptureReplay:
    """ASGI upstream answering each captured request with the bytes llama-server sent."""

    def __init__(self, gap: float = 0.001) -> None:
        self.captures = llama_captures()
        self.by_key: dict = {}
        for cap in self.captures.values():
            self.by_key.setdefault(cap.key(), cap)
        self.gap = gap
        self.served: list[str] = []

    async def __call__(self, scope, receive, send):
        if scope["type"] == "lifespan":
            await _lifespan(receive, send)
            return
        body = await _read(receive)
        cap = self.by_key.get(_key(scope["method"], scope["path"], body))
        if cap is None:
            payload = b'{"error":{"message":"File Not Found","type":"not_found_error","code":404}}'
            await send(
                {
                    "type": "http.response.start",
                    "status": 404,
                    "headers": [
                        (b"content-type", b"application/json; charset=utf-8"),
                        (b"content-length", str(len(payload)).encode()),
                    ],
                }
            )
            await send({"type": "http.response.body", "body": payload})
            return
        self.served.append(cap.name)
        headers = list(cap.headers)
        if not cap.chunked:
            headers.append((b"content-length", str(len(cap.body)).encode()))
        await send({"type": "http.response.start", "status": cap.status, "headers": headers})
        for part in cap.parts:
            await send({"type": "http.response.body", "body": part, "more_body": True})
            if len(cap.parts) > 1:
                await asyncio.sleep(self.gap)
        await send({"type": "http.response.body", "body": b"", "more_body": False})


def fixture_path(name: str) -> Path:
    return WIRE / name
