"""A torch-backed stand-in engine for tests/device/gpu_power_check.py: an OpenAI-compatible
upstream whose prefill and decode put a known load on the GPU for a known time.

Stdlib only (``http.server``): the check runs where no web framework may be installed.
``POST /v1/chat/completions`` takes an extra body field ``standin``:
``{"prefill_s": 0.3, "decode_s": 1.0}``; prefill is a compute-bound burst before the first
token, decode a memory-bound run that emits ``max_tokens`` tokens evenly over
``decode_s`` (the first token ends prefill). Streams are OpenAI SSE chunks, with a usage
chunk when ``stream_options.include_usage`` asks for one. ``GET /v1/models`` lists
:data:`MODEL`; ``GET /health`` answers 200. Every request's truth (monotonic times of
arrival, prefill and decode edges, the last byte) is appended to :attr:`StandinEngine.log`.
GPU work is serialised by one lock: concurrent requests queue inside the engine.
"""

from __future__ import annotations

import json
import threading
import time
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

MODEL = "standin-gpu"
#: prompt tokens reported per second of prefill (any constant: only its presence matters)
PROMPT_TOKENS_PER_S = 10000


class StandinEngine:
    def __init__(self, load: Any, host: str = "127.0.0.1", port: int = 0) -> None:
        self.load = load
        self.log: list[dict] = []
        self.gpu = threading.Lock()
        engine = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, format: str, *args: Any) -> None:
                pass

            def _json(self, status: int, obj: Any) -> None:
                data = json.dumps(obj).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self) -> None:
                path = self.path.split("?")[0]
                if path == "/v1/models":
                    self._json(
                        200,
                        {
                            "object": "list",
                            "data": [{"id": MODEL, "object": "model", "owned_by": "standin"}],
                        },
                    )
                elif path == "/health":
                    self._json(200, {"ok": True})
                else:
                    self._json(404, {"error": "not found"})

            def do_POST(self) -> None:
                t_recv = time.monotonic()
                n = int(self.headers.get("Content-Length") or 0)
                raw = self.rfile.read(n) if n else b""
                try:
                    body = json.loads(raw or b"{}")
                except ValueError:
                    self._json(400, {"error": "bad json"})
                    return
                if not self.path.split("?")[0].endswith("/chat/completions"):
                    self._json(404, {"error": "not found"})
                    return
                engine.serve_chat(self, body, t_recv)

        class Server(ThreadingHTTPServer):
            daemon_threads = True

            def handle_error(self, request: Any, client_address: Any) -> None:
                pass  # a client gone mid-stream (the proxy's probes close at will)

        self.server = Server((host, port), Handler)
        self.port = self.server.server_address[1]
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def start(self) -> StandinEngine:
        self.thread.start()
        return self

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    def serve_chat(self, h: BaseHTTPRequestHandler, body: dict, t_recv: float) -> None:
        opts = body.get("standin") or {}
        prefill_s = float(opts.get("prefill_s", 0.3))
        decode_s = float(opts.get("decode_s", 1.0))
        tokens = max(2, int(body.get("max_tokens") or body.get("max_completion_tokens") or 32))
        stream = bool(body.get("stream"))
        usage_wanted = bool((body.get("stream_options") or {}).get("include_usage"))
        prompt_tokens = max(1, int(prefill_s * PROMPT_TOKENS_PER_S))
        rid = "chatcmpl-" + uuid.uuid4().hex[:16]
        created = int(time.time())
        truth: dict = {"id": rid, "t_recv": t_recv, "prefill_s": prefill_s, "decode_s": decode_s}
        truth["tokens"] = tokens
        truth["usage_requested"] = usage_wanted

        def chunk(delta: dict, finish: str | None = None) -> bytes:
            obj = {
                "id": rid,
                "object": "chat.completion.chunk",
                "created": created,
                "model": MODEL,
                "choices": [{"index": 0, "delta": delta, "finish_reason": finish}],
            }
            return b"data: " + json.dumps(obj).encode() + b"\n\n"

        def send(data: bytes) -> None:
            h.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
            h.wfile.flush()

        if stream:
            h.send_response(200)
            h.send_header("Content-Type", "text/event-stream")
            h.send_header("Cache-Control", "no-cache")
            h.send_header("Transfer-Encoding", "chunked")
            h.end_headers()
            h.wfile.flush()
        with self.gpu:
            truth["t_gpu"] = time.monotonic()
            truth["prefill"] = self.load.burst("compute", prefill_s)
            if stream:
                send(chunk({"role": "assistant", "content": "tok"}))
            truth["t_first"] = time.monotonic()
            sent = [1]

            def tick() -> None:
                if sent[0] < tokens - 1:
                    sent[0] += 1
                    if stream:
                        send(chunk({"content": " tok"}))

            step = decode_s / (tokens - 1)
            truth["decode"] = self.load.burst("memory", decode_s, tick=tick, tick_every=step)
            while sent[0] < tokens - 1:
                tick()
        if stream:
            send(chunk({"content": " tok"}, "length"))
            if usage_wanted:
                usage = {
                    "id": rid,
                    "object": "chat.completion.chunk",
                    "created": created,
                    "model": MODEL,
                    "choices": [],
                    "usage": {
                        "prompt_tokens": prompt_tokens,
                        "completion_tokens": tokens,
                        "total_tokens": prompt_tokens + tokens,
                    },
                }
                send(b"data: " + json.dumps(usage).encode() + b"\n\n")
            send(b"data: [DONE]\n\n")
            h.wfile.write(b"0\r\n\r\n")
            h.wfile.flush()
        else:
            h._json(  # type: ignore[attr-defined]
                200,
                {
                    "id": rid,
                    "object": "chat.completion",
                    "created": created,
                    "model": MODEL,
                    "choices": [
                        {
                            "index": 0,
                            "message": {"role": "assistant", "content": "tok" * tokens},
                            "finish_reason": "length",
                        }
                    ],
                    "usage": {
                        "prompt_tokens": prompt_tokens,
                        "completion_tokens": tokens,
                        "total_tokens": prompt_tokens + tokens,
                    },
                },
            )
        truth["t_done"] = time.monotonic()
        self.log.append(truth)
