"""A small OpenAI-compatible engine on loopback, configurable per test: the models it lists,
the usage it reports, a switch to answer 500, and a record of what it was asked.

Where a test needs the engine's exact bytes (resets, short bodies, hostile heads) it uses
the raw-socket engines (:mod:`.fake_engine`, :mod:`.hostile`); where it needs engine
physics and a ground truth, the simulator (:func:`.servers.start_sim`). This one is for
the tests in between: an engine whose model list or health is what the test is about.
"""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class OpenAIEngine:
    """Lists `models` on ``GET /v1/models`` and answers every ``POST`` with a one-token
    chat completion ("ok") reporting `prompt_tokens`; with ``fail`` set, answers 500.
    Counts its model-list reads (``lists``) and records each POST's model (``posts``)."""

    def __init__(self, models: list[str], prompt_tokens: int = 1) -> None:
        self.models = list(models)
        self.lists = 0
        self.posts: list[str | None] = []
        self.fail = False
        engine = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args) -> None:
                pass

            def _answer(self, status: int, obj: dict) -> None:
                body = json.dumps(obj).encode()
                self.send_response(status)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_GET(self) -> None:
                if self.path != "/v1/models":
                    self._answer(404, {"error": "no"})
                    return
                engine.lists += 1
                if engine.fail:
                    self._answer(500, {"error": "broken"})
                    return
                data = [{"id": n, "object": "model"} for n in engine.models]
                self._answer(200, {"object": "list", "data": data})

            def do_POST(self) -> None:
                raw = self.rfile.read(int(self.headers.get("content-length", 0)))
                try:
                    model = json.loads(raw).get("model")
                except (ValueError, AttributeError):
                    model = None
                engine.posts.append(model)
                if engine.fail:
                    self._answer(500, {"error": "broken"})
                    return
                self._answer(200, _completion(model, prompt_tokens))

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        self.url = f"http://127.0.0.1:{self.port}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def _completion(model: str | None, prompt_tokens: int) -> dict:
    return {
        "id": "x",
        "object": "chat.completion",
        "model": model,
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": "ok"},
                "finish_reason": "stop",
            }
        ],
        "usage": {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": 1,
            "total_tokens": prompt_tokens + 1,
        },
    }
