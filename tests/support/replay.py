"""A replay upstream: serves recorded engine responses for the requests that produced them.

Captures live in ``tests/fixtures/vllm-real/{raw,raw-words}``: ``NAME.request.http``
(the bytes the recorder sent), ``NAME.headers.txt`` and ``NAME.body`` (what vLLM answered).
A request is matched to a capture by its JSON body (key order ignored), so when the proxy
injects ``stream_options.include_usage`` the replay serves the include_usage capture, just
as the real engine would. Ids and ``created`` are pinned to one value in every capture so
captures of the same request with and without usage can be compared byte for byte.
"""

from __future__ import annotations

import asyncio
import json
import re
import threading
import time
from pathlib import Path

import uvicorn

#: The real-engine captures and wire fixtures this suite reads: all inside the repository.
FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
VLLM_REAL = FIXTURES / "vllm-real"

_ID = re.compile(rb'"id":"(chatcmpl|cmpl)-[0-9a-f]+"')
_CREATED = re.compile(rb'"created":\d+')
_SKIP_HEADERS = {"date", "server", "transfer-encoding", "content-length"}


def pin_ids(body: bytes) -> bytes:
    body = _ID.sub(lambda m: b'"id":"' + m.group(1) + b'-0000000000000000"', body)
    return _CREATED.sub(b'"created":1796012797', body)


class Capture:
    def __init__(self, folder: Path, name: str) -> None:
        self.name = name
        raw = (folder / f"{name}.request.http").read_bytes()
        head, _, body = raw.partition(b"\r\n\r\n")
        request_line = head.split(b"\r\n", 1)[0].decode()
        self.method, self.path, _ = request_line.split(" ", 2)
        self.request_body = body
        lines = (folder / f"{name}.headers.txt").read_text().splitlines()
        self.status = int(lines[0].split()[1])
        self.headers = []
        for line in lines[1:]:
            if ":" in line:
                k, v = line.split(":", 1)
                if k.strip().lower() not in _SKIP_HEADERS:
                    self.headers.append((k.strip().lower().encode(), v.strip().encode()))
        self.body = pin_ids((folder / f"{name}.body").read_bytes())
        self.stream = any(v.startswith(b"text/event-stream") for k, v in self.headers)

    def key(self):
        return _key(self.method, self.path, self.request_body)

    def events(self) -> list[bytes]:
        if not self.stream:
            return [self.body]
        parts = self.body.split(b"\n\n")
        return [p + b"\n\n" for p in parts[:-1]] + ([parts[-1]] if parts[-1] else [])


def _key(method: str, path: str, body: bytes):
    try:
        canonical = json.dumps(json.loads(body), sort_keys=True) if body else ""
    except ValueError:
        canonical = body.decode("latin-1")
    return (method, path, canonical)


def _without_options(body: bytes) -> bytes:
    try:
        obj = json.loads(body)
    except ValueError:
        return body
    if isinstance(obj, dict):
        obj.pop("stream_options", None)
    return json.dumps(obj).encode()


def load_captures(folder: Path) -> dict:
    names = sorted({p.name.split(".")[0] for p in folder.glob("*.request.http")})
    out = {}
    for name in names:
        cap = Capture(folder, name)
        if name.startswith("hangup"):
            continue
        out.setdefault(cap.key(), cap)
    return out


class ReplayApp:
    """ASGI upstream serving captures, one event per write with a small gap."""

    def __init__(self, folder: Path, gap: float = 0.002) -> None:
        self.captures = load_captures(folder)
        self.gap = gap
        self.served: list[str] = []
        self.models_body = (folder / "models.body").read_bytes()

    async def __call__(self, scope, receive, send):
        if scope["type"] == "lifespan":
            while True:
                msg = await receive()
                if msg["type"] == "lifespan.startup":
                    await send({"type": "lifespan.startup.complete"})
                else:
                    await send({"type": "lifespan.shutdown.complete"})
                    return
        body = b""
        while True:
            msg = await receive()
            body += msg.get("body", b"")
            if not msg.get("more_body"):
                break
        cap = self.captures.get(_key(scope["method"], scope["path"], body))
        if cap is None:  # an engine rejects a bad request the same with or without usage
            cap = self.captures.get(_key(scope["method"], scope["path"], _without_options(body)))
            if cap is not None and cap.status < 400:
                cap = None
        if cap is None:
            payload = json.dumps(
                {"error": f"no capture for {scope['method']} {scope['path']} {body[:300]!r}"}
            ).encode()
            await send(
                {
                    "type": "http.response.start",
                    "status": 599,
                    "headers": [(b"content-type", b"application/json")],
                }
            )
            await send({"type": "http.response.body", "body": payload})
            return
        self.served.append(cap.name)
        headers = list(cap.headers)
        if not cap.stream:
            headers.append((b"content-length", str(len(cap.body)).encode()))
        await send({"type": "http.response.start", "status": cap.status, "headers": headers})
        for ev in cap.events():
            await send({"type": "http.response.body", "body": ev, "more_body": True})
            if cap.stream:
                await asyncio.sleep(self.gap)
        await send({"type": "http.response.body", "body": b"", "more_body": False})


class ThreadServer:
    """Run an ASGI app under uvicorn in a background thread (for byte-level tests)."""

    def __init__(self, app, port: int) -> None:
        self.app = app
        self.url = f"http://127.0.0.1:{port}"
        config = uvicorn.Config(
            app, host="127.0.0.1", port=port, log_level="warning", lifespan="on"
        )
        self.server = uvicorn.Server(config)
        self.server.install_signal_handlers = lambda: None
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def start(self) -> ThreadServer:
        self.thread.start()
        deadline = time.monotonic() + 10
        while not self.server.started:
            if time.monotonic() > deadline:
                raise RuntimeError("replay server did not start")
            time.sleep(0.02)
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)
