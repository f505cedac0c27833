"""A deliberately cheap OpenAI-style SSE upstream for the relay benchmark (raw asyncio).

Not the simulator: no physics, no FastAPI, so it is never the bottleneck. It speaks
HTTP/1.1 with keep-alive, answers ``GET /v1/models`` and ``GET /health``, and streams
``POST /v1/chat/completions`` as vLLM does (role-only first event, one event per token,
finish reason on the last token, a usage event when asked, ``data: [DONE]``), each
event its own chunk. Pacing comes from the request body: ``"x_interval": seconds``
between tokens (0 = as fast as the reader takes them).

    python tests/bench/sse_upstream.py PORT [PROCS]
"""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys

MODEL = "bench-model"

_HEAD_SSE = (
    b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
    b"cache-control: no-cache\r\ntransfer-encoding: chunked\r\n\r\n"
)


def _chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


def _event(obj) -> bytes:
    return _chunk(b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n")


_ID = "chatcmpl-bench0123456789abcdef"
_BASE = {"id": _ID, "object": "chat.completion.chunk", "created": 1700000000, "model": MODEL}
ROLE = _event(
    {
        **_BASE,
        "choices": [
            {
                "index": 0,
                "delta": {"role": "assistant", "content": ""},
                "logprobs": None,
                "finish_reason": None,
            }
        ],
    }
)
TOKEN = _event(
    {
        **_BASE,
        "choices": [
            {"index": 0, "delta": {"content": " tok"}, "logprobs": None, "finish_reason": None}
        ],
    }
)
LAST = _event(
    {
        **_BASE,
        "choices": [
            {"index": 0, "delta": {"content": " end"}, "logprobs": None, "finish_reason": "length"}
        ],
    }
)
DONE = _chunk(b"data: [DONE]\n\n") + b"0\r\n\r\n"


def usage_event(prompt: int, completion: int) -> bytes:
    return _event(
        {
            **_BASE,
            "choices": [],
            "usage": {
                "prompt_tokens": prompt,
                "total_tokens": prompt + completion,
                "completion_tokens": completion,
            },
        }
    )


def _plain(status: str, body: bytes, ctype: bytes = b"application/json") -> bytes:
    return b"HTTP/1.1 %s\r\ncontent-type: %s\r\ncontent-length: %d\r\n\r\n%s" % (
        status.encode(),
        ctype,
        len(body),
        body,
    )


MODELS = _plain(
    "200 OK",
    json.dumps(
        {
            "object": "list",
            "data": [{"id": MODEL, "object": "model", "owned_by": "bench", "root": MODEL}],
        }
    ).encode(),
)


class Conn(asyncio.Protocol):
    def __init__(self) -> None:
        self.buf = b""
        self.transport: asyncio.Transport | None = None
        self.busy = False
        self.task: asyncio.Task | None = None
        self.can_write: asyncio.Future | None = None

    def connection_made(self, transport) -> None:
        self.transport = transport

    def connection_lost(self, exc) -> None:
        if self.task is not None:
            self.task.cancel()
        if self.can_write is not None and not self.can_write.done():
            self.can_write.set_result(None)

    def pause_writing(self) -> None:
        self.can_write = asyncio.get_running_loop().create_future()

    def resume_writing(self) -> None:
        if self.can_write is not None and not self.can_write.done():
            self.can_write.set_result(None)
        self.can_write = None

    def data_received(self, data: bytes) -> None:
        self.buf += data
        if not self.busy:
            self._next()

    def _next(self) -> None:
        end = self.buf.find(b"\r\n\r\n")
        if end < 0:
            return
        head = self.buf[:end].decode("latin-1").split("\r\n")
        length = 0
        for line in head[1:]:
            k, _, v = line.partition(":")
            if k.strip().lower() == "content-length":
                length = int(v)
        if len(self.buf) < end + 4 + length:
            return
        body = self.buf[end + 4 : end + 4 + length]
        self.buf = self.buf[end + 4 + length :]
        method, path = head[0].split(" ")[:2]
        if method == "POST" and path.startswith("/v1/chat/completions"):
            self.busy = True
            self.task = asyncio.ensure_future(self._stream(json.loads(body)))
        elif path.startswith("/v1/models"):
            self.transport.write(MODELS)
            self._next()
        elif path.startswith("/health"):
            self.transport.write(_plain("200 OK", b"ok", b"text/plain"))
            self._next()
        else:
            self.transport.write(_plain("404 Not Found", b'{"error":"not found"}'))
            self._next()

    async def _stream(self, req: dict) -> None:
        n = max(1, int(req.get("max_tokens") or 16))
        interval = float(req.get("x_interval") or 0.0)
        opts = req.get("stream_options")
        usage = isinstance(opts, dict) and opts.get("include_usage") is not False
        write = self.transport.write
        loop = asyncio.get_running_loop()
        write(_HEAD_SSE + ROLE)
        try:
            if interval > 0:
                # Absolute schedule, so timer slack does not accumulate into a slower rate.
                t = loop.time()
                for i in range(n):
                    t += interval
                    await asyncio.sleep(t - loop.time())
                    write(LAST if i == n - 1 else TOKEN)
            else:
                for i in range(n):
                    if self.can_write is not None:
                        await self.can_write
                    write(LAST if i == n - 1 else TOKEN)
                    if i % 4 == 3:  # let other streams interleave, as an engine's steps do
                        await asyncio.sleep(0)
            write((usage_event(8, n) if usage else b"") + DONE)
        except asyncio.CancelledError:
            return
        if self.transport.is_closing():
            return
        self.busy = False
        self.task = None
        self._next()


def _stop(*_) -> None:
    raise KeyboardInterrupt


def _die_with_parent() -> None:
    """A sibling ends with the process that started it, however that one ends (Linux)."""
    try:
        import ctypes

        ctypes.CDLL(None).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def main() -> None:
    """``PORT [PROCS]``: PROCS processes share the port (SO_REUSEPORT), so that the
    upstream is not the ceiling when a many-core machine runs several proxy workers;
    ``PROCS`` 0 is one of those siblings (started by the first, stopped with it)."""
    port = int(sys.argv[1])
    procs = int(sys.argv[2]) if len(sys.argv) > 2 else 1
    siblings = [
        subprocess.Popen([sys.executable, __file__, str(port), "0"]) for _ in range(procs - 1)
    ]
    signal.signal(signal.SIGTERM, _stop)
    if procs == 0:
        _die_with_parent()
    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass

    async def serve() -> None:
        loop = asyncio.get_running_loop()
        server = await loop.create_server(
            Conn, "127.0.0.1", port, backlog=2048, reuse_port=procs != 1
        )
        async with server:
            await server.serve_forever()

    try:
        asyncio.run(serve())
    except KeyboardInterrupt:
        pass
    finally:
        for p in siblings:
            p.terminate()
        for p in siblings:
            p.wait()


if __name__ == "__main__":
    main()
