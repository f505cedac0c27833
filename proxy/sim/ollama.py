"""A simulated Ollama (llama-server runner, v0.12-v0.33 wire), faithful to fixtures/wire §2.

Native ``/api/chat`` and ``/api/generate`` stream NDJSON (``stream`` defaults to true),
headers going out with the first chunk; the final ``done`` line carries the metrics in
nanoseconds, zero ones left out (Go omitempty): ``load_duration`` (cold load on a model's
first use, then the scheduler's lookup), ``prompt_eval_duration`` over the uncached
prompt only while ``prompt_eval_count`` counts it all, ``eval_count`` including EOS,
``total_duration`` including the wait for the runner's semaphore (``num_parallel`` =
``--max-num-seqs``). ``/v1`` re-encodes the same generation as OpenAI SSE (current
layout: role and first text together, a separate finish event, usage only with
include_usage, zero usage inside every /v1/completions event when it is on). Go's JSON:
compact, ``<>&`` escaped. Precision shows as ``details.quantization_level``.

Fault injection for tests: ``"options": {"sim_error_after": N}`` ends a stream after N
chunks with Ollama's error line (native) or an empty chunk and no ``[DONE]`` (/v1).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import time
from datetime import UTC, datetime
from typing import ClassVar

from .asgi import lifespan, loads, read_body
from .choices import run_request
from .engine import SimEngine, plan_output, tokenize
from .gguf import FILE_TYPES, EngineTruth, PrefixCache, chat_text
from .ollama_extras import embeddings_route, shape_info
from .ollama_tools import call_id, native_calls, plan_for, v1_calls
from .power import dcgm_metrics, nvml_view
from .tools import CLOSE

VERSION = "0.12.3"
KEEP_ALIVE = 300.0


def go_json(obj) -> bytes:
    """Go encoding/json: compact, raw UTF-8, ``<>&`` and U+2028/2029 escaped."""
    text = json.dumps(obj, ensure_ascii=False, separators=(",", ":"))
    return (
        text.replace("<", "\\u003c")
        .replace(">", "\\u003e")
        .replace("&", "\\u0026")
        .replace("\u2028", "\\u2028")
        .replace("\u2029", "\\u2029")
    ).encode()


def rfc3339nano(ts_ns: int | None = None) -> str:
    """UTC time as Go's RFC3339Nano: trailing zeros of the fraction trimmed."""
    ts_ns = time.time_ns() if ts_ns is None else ts_ns
    secs, frac = divmod(ts_ns, 1_000_000_000)
    base = datetime.fromtimestamp(secs, UTC).strftime("%Y-%m-%dT%H:%M:%S")
    digits = f"{frac:09d}".rstrip("0")
    return base + ("." + digits if digits else "") + "Z"


def local_time(ts: float) -> str:
    """Local time with offset, as Ollama writes modified_at / expires_at."""
    dt = datetime.fromtimestamp(ts).astimezone()
    text = dt.isoformat(timespec="microseconds")
    main, _, rest = text.partition(".")
    digits, tz = rest[:6].rstrip("0"), rest[6:]
    return main + ("." + digits if digits else "") + ("Z" if tz == "+00:00" else tz)


class _Bad(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status, self.message = status, message


class OllamaSim:
    """ASGI app speaking Ollama's native and /v1 APIs over a :class:`SimEngine`."""

    def __init__(self, engine: SimEngine) -> None:
        self.engine = engine
        self.cache = PrefixCache()
        self.loaded: dict[str, float] = {}  # model -> wall-clock expiry
        self.modified = time.time() - 86400

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "lifespan":
            await lifespan(receive, send, self.engine)
            return
        if scope["type"] != "http":
            return
        method, path = scope["method"], scope["path"]
        if path == "/" and method in ("GET", "HEAD"):
            await _send(send, 200, b"Ollama is running", b"text/plain; charset=utf-8")
        elif path == "/api/version" and method == "GET":
            await _send(send, 200, go_json({"version": VERSION}))
        elif path == "/api/tags" and method in ("GET", "HEAD"):
            await _send(send, 200, go_json({"models": [self._tag(m) for m in self.engine.models]}))
        elif path == "/api/ps" and method == "GET":
            await _send(send, 200, go_json({"models": self._ps()}))
        elif path == "/api/show" and method == "POST":
            await self.show(receive, send)
        elif path in ("/api/embed", "/api/embeddings", "/v1/embeddings") and method == "POST":
            await embeddings_route(self, path, receive, send, go_json, _send)
        elif path == "/sim/nvml" and method == "GET":  # for the tests' stand-in pynvml
            await _send(send, 200, nvml_view(self.engine), b"application/json")
        elif path == "/metrics" and method == "GET":
            # Ollama has no /metrics: this is the dcgm-exporter beside it (simulated power)
            await _send(
                send,
                200,
                dcgm_metrics(self.engine).encode(),
                b"text/plain; version=0.0.4; charset=utf-8",
            )
        elif path == "/v1/models" and method == "GET":
            data = [
                {"id": m, "object": "model", "created": int(self.modified), "owned_by": "library"}
                for m in self.engine.models
            ]
            await _send(
                send, 200, go_json({"object": "list", "data": data}) + b"\n", b"application/json"
            )
        elif path in ("/api/chat", "/api/generate", "/v1/chat/completions", "/v1/completions"):
            if method != "POST":
                await _send(send, 404, b"404 page not found", b"text/plain")
                return
            kind = {
                "/api/chat": "chat",
                "/api/generate": "generate",
                "/v1/chat/completions": "v1chat",
                "/v1/completions": "v1cmpl",
            }[path]
            await self.generate(scope, receive, send, kind)
        else:
            await _send(send, 404, b"404 page not found", b"text/plain")

    # --- metadata -------------------------------------------------------------------------

    def _details(self, model: str) -> dict:
        spec = self.engine.models[model].spec
        return {
            "parent_model": "",
            "format": "gguf",
            "family": "llama",
            "families": ["llama"],
            "parameter_size": f"{spec.params_b:.1f}B",
            "quantization_level": spec.profile.quant,
        }

    def _size(self, model: str) -> int:
        return int(self.engine.models[model].spec.weight_bytes)

    def _digest(self, model: str) -> str:
        return hashlib.sha256(model.encode()).hexdigest()

    def _tag(self, model: str) -> dict:
        return {
            "name": model,
            "model": model,
            "modified_at": local_time(self.modified),
            "size": self._size(model),
            "digest": self._digest(model),
            "details": self._details(model),
        }

    def _ps(self) -> list[dict]:
        now = time.time()
        out = []
        for model, expiry in sorted(self.loaded.items(), key=lambda kv: -kv[1]):
            if expiry <= now:
                continue
            out.append(
                {
                    "name": model,
                    "model": model,
                    "size": self._size(model),
                    "digest": self._digest(model),
                    "details": self._details(model),
                    "expires_at": local_time(expiry),
                    "size_vram": self._size(model),
                    "context_length": 4096,
                }
            )
        return out

    async def show(self, receive, send) -> None:
        obj = loads(await read_body(receive))
        name = obj.get("model", obj.get("name")) if isinstance(obj, dict) else None
        model = self._resolve(name) if isinstance(name, str) else None
        if model is None:
            await _send(send, 404, go_json({"error": f"model '{name}' not found"}))
            return
        spec = self.engine.models[model].spec
        body = {
            "license": "",
            "modelfile": f'# Modelfile generated by "ollama show"\nFROM {model}\n',
            "parameters": "",
            "template": "{{ .Prompt }}",
            "details": self._details(model),
            "model_info": {
                "general.architecture": "llama",
                "general.file_type": FILE_TYPES[spec.profile.quant],
                "general.parameter_count": int(spec.params_b * 1e9),
                "general.quantization_version": 2,
                "llama.block_count": spec.layers,
                "llama.context_length": spec.max_model_len,
                **shape_info(spec),
            },
            "tensors": [],
            "capabilities": ["completion"],
            "modified_at": local_time(self.modified),
        }
        await _send(send, 200, go_json(body))

    def _resolve(self, name: str) -> str | None:
        if name in self.engine.models:
            return name
        if ":" not in name and name + ":latest" in self.engine.models:
            return name + ":latest"
        return None

    # --- generation -----------------------------------------------------------------------

    async def generate(self, scope, receive, send, kind: str) -> None:
        t_recv = time.monotonic()
        start_ns = time.monotonic_ns()
        obj = loads(await read_body(receive))
        v1 = kind.startswith("v1")
        try:
            model, name, text, _stream, opts = self._validate(obj, kind)
        except _Bad as exc:
            if v1:
                kinds = {400: "invalid_request_error", 404: "not_found_error"}
                body = (
                    go_json(
                        {
                            "error": {
                                "message": exc.message,
                                "type": kinds.get(exc.status, "api_error"),
                                "param": None,
                                "code": None,
                            }
                        }
                    )
                    + b"\n"
                )
                await _send(send, exc.status, body, b"application/json")
            else:
                await _send(send, exc.status, go_json({"error": exc.message}))
            return
        if text is None:  # a load (or unload) request: no generation
            reason = "unload" if obj.get("keep_alive") in (0, "0", "0s") else "load"
            await self._load(model, send_nothing=True)
            if reason == "unload":
                self.loaded.pop(model, None)
            else:
                self.loaded[model] = time.time() + KEEP_ALIVE
            head = {"model": name, "created_at": rfc3339nano()}
            head.update(
                {"message": {"role": "assistant", "content": ""}}
                if kind == "chat"
                else {"response": ""}
            )
            head.update({"done": True, "done_reason": reason})
            await _send(send, 200, go_json(head))
            return
        me = self.engine.models[model]
        tokens = tokenize(text)
        prompt_tokens = max(1, len(tokens))
        max_tokens = opts.get("num_predict") if not v1 else obj.get("max_tokens")
        max_tokens = max_tokens if isinstance(max_tokens, int) and max_tokens > 0 else None
        plan = plan_output(text, max_tokens, False, opts.get("seed"))
        call = plan_for(obj, kind, text, max_tokens)  # a tool call instead of text
        rid = (
            dict(scope["headers"]).get(b"x-request-id", b"").decode("latin-1")
            or hashlib.md5(str(time.time_ns()).encode()).hexdigest()
        )
        truth = EngineTruth(
            rid, model, me.spec.profile.name, prompt_tokens, t_recv=t_recv, gpu=me.gpu_index
        )
        writer = _Writer(send, kind, name, obj, self.engine.deterministic, text)
        if call is not None:
            ident = call_id(self.engine.deterministic, f"{name}|{text}")
            writer.tool_calls = (native_calls(call, ident), v1_calls(call, ident))
        error_after = opts.get("sim_error_after")
        key = self.engine.next_key()

        async def work() -> None:
            admitted = False
            try:
                await self._load(model)
                loaded_ns = time.monotonic_ns()
                truth.load_seconds = (loaded_ns - start_ns) / 1e9
                await me.admit(key, prompt_tokens)  # the runner's semaphore (num_parallel)
                admitted = True
                admit_ns = time.monotonic_ns()
                truth.t_admit = admit_ns / 1e9
                truth.engine_wait_seconds = (admit_ns - loaded_ns) / 1e9
                cached = self.cache.hit(model, tokens)
                truth.cached_tokens = cached
                me.prompt_tokens_total += prompt_tokens - cached
                await me.prefill(truth.t_admit, prompt_tokens - cached, cached)
                prefill_end = time.monotonic_ns()
                truth.prefill_seconds = (prefill_end - admit_ns) / 1e9
                n = len(plan.pieces) if call is None else len(call.steps)
                first_ns = None
                async for i in me.steps(key, prompt_tokens, n):
                    piece = plan.pieces[i] if call is None else ""
                    now_ns = time.monotonic_ns()
                    first_ns = first_ns or now_ns
                    truth.completion_tokens = i + 1
                    if error_after is not None and i >= error_after:
                        await writer.error(
                            "model runner has unexpectedly stopped, this may be due "
                            "to resource limitations or an internal error, check "
                            "ollama server logs for details"
                        )
                        truth.aborted = True
                        return
                    now = time.monotonic()  # the truth's marks: before the token is written
                    if call is not None:  # the parser holds the call back until it is whole
                        if call.steps[i][0] == CLOSE:
                            await writer.tool_chunk()
                            truth.t_first = now
                    elif piece or i < n - 1:
                        await writer.chunk(piece)
                        if truth.t_first is None:
                            truth.t_first = now
                    truth.t_last = now
                end_ns = time.monotonic_ns()
                metrics = {
                    "total_duration": end_ns - start_ns,
                    "load_duration": loaded_ns - start_ns,
                    "prompt_eval_count": prompt_tokens,
                    "prompt_eval_duration": prefill_end - admit_ns,
                    "eval_count": n,
                    "eval_duration": end_ns - (first_ns or end_ns),
                }
                truth.reported = dict(metrics)
                context = tokens + tokenize("".join(plan.pieces)) if kind == "generate" else None
                if call is None:
                    await writer.done(plan.finish_reason, "".join(plan.pieces), metrics, context)
                else:
                    await writer.done(call.finish_reason, "", metrics, context)
                self.loaded[model] = time.time() + KEEP_ALIVE
            finally:
                if admitted:
                    truth.energy_joules = me.release(key)

        await run_request(receive, writer.state, me, self.engine, truth, work)

    async def _load(self, model: str, send_nothing: bool = False) -> None:
        """A model's first use loads it (weights at ~12 GB/s), charged to load_duration."""
        if self.loaded.get(model, 0.0) > time.time():
            await asyncio.sleep(0.0005 / self.engine.models[model].speed)  # scheduler lookup
            return
        me = self.engine.models[model]
        await asyncio.sleep(me.spec.weight_bytes / 12e9 / me.speed)
        self.loaded[model] = time.time() + KEEP_ALIVE

    def _validate(self, obj, kind: str):
        if not isinstance(obj, dict):
            raise _Bad(
                400,
                "invalid character '}' looking for beginning of object key string"
                if obj is None
                else "missing request body",
            )
        name = obj.get("model", obj.get("name"))
        if not isinstance(name, str) or not name:
            raise _Bad(400, "model is required")
        model = self._resolve(name)
        if model is None:
            raise _Bad(404, f"model '{name}' not found")
        given = obj.get("options")
        opts: dict = given if isinstance(given, dict) else {}
        if kind in ("chat", "v1chat"):
            messages = obj.get("messages")
            if kind == "v1chat" and not messages:
                raise _Bad(400, "[] is too short - 'messages'")
            text = chat_text(messages) if messages else None
        else:
            prompt = obj.get("prompt")
            if kind == "v1cmpl" and not isinstance(prompt, str):
                raise _Bad(400, "invalid prompt")
            text = prompt if isinstance(prompt, str) and prompt else None
        stream = (
            obj.get("stream") is not False
            if not kind.startswith("v1")
            else obj.get("stream") is True
        )
        if kind.startswith("v1"):
            opts = {**opts, "seed": obj.get("seed")}
        return model, name, text, stream, opts


class _Writer:
    """Serialises one generation as Ollama writes it (native or through /v1)."""

    def __init__(
        self, send, kind: str, name: str, obj: dict, deterministic: bool, text: str
    ) -> None:
        self.send = send
        self.kind = kind
        self.name = name
        self.state: dict = {"finished": False}
        self.started = False
        v1 = kind.startswith("v1")
        self.stream = obj.get("stream") is True if v1 else obj.get("stream") is not False
        opts = obj.get("stream_options")
        self.include_usage = isinstance(opts, dict) and opts.get("include_usage") is True
        n = (
            int(hashlib.md5(f"{name}|{text}".encode()).hexdigest(), 16) % 999
            if deterministic
            else time.time_ns() % 999
        )
        self.ident = ("chatcmpl-" if kind == "v1chat" else "cmpl-") + str(n)
        self.created = 1755800000 if deterministic else int(time.time())
        self.first = True
        self.pieces: list[str] = []
        self.tool_calls: tuple[list, list] | None = None  # (native, /v1) when the model calls
        self.tool_sent = False

    async def _start(self, ctype: bytes) -> None:
        if not self.started:
            self.started = True
            await self.send(
                {
                    "type": "http.response.start",
                    "status": 200,
                    "headers": [(b"content-type", ctype)],
                }
            )

    async def _write(self, data: bytes) -> None:
        await self.send({"type": "http.response.body", "body": data, "more_body": True})

    def _native(self, piece: str) -> dict:
        head: dict[str, object] = {"model": self.name, "created_at": rfc3339nano()}
        if self.kind == "chat":
            head["message"] = {"role": "assistant", "content": piece}
        else:
            head["response"] = piece
        return head

    def _v1_chat(self, delta: dict, finish: str | None, choices=True) -> dict:
        return {
            "id": self.ident,
            "object": "chat.completion.chunk",
            "created": self.created,
            "model": self.name,
            "system_fingerprint": "fp_ollama",
            "choices": [{"index": 0, "delta": delta, "finish_reason": finish}] if choices else [],
        }

    def _v1_cmpl(self, text: str | None, finish: str | None, usage: dict | None) -> bytes:
        chunk = {
            "id": self.ident,
            "object": "text_completion",
            "created": self.created,
            "choices": []
            if text is None
            else [{"text": text, "index": 0, "finish_reason": finish}],
            "model": self.name,
            "system_fingerprint": "fp_ollama",
        }
        if usage is not None:
            chunk["usage"] = usage
        return b"data: " + go_json(chunk) + b"\n\n"

    _ZERO: ClassVar[dict[str, int]] = {
        "prompt_tokens": 0,
        "completion_tokens": 0,
        "total_tokens": 0,
    }

    async def chunk(self, piece: str) -> None:
        self.pieces.append(piece)
        if not self.stream:
            return
        if self.kind in ("chat", "generate"):
            await self._start(b"application/x-ndjson")
            d = self._native(piece)
            d["done"] = False
            await self._write(go_json(d) + b"\n")
        elif self.kind == "v1chat":
            await self._start(b"text/event-stream")
            delta = {"role": "assistant", "content": piece} if self.first else {"content": piece}
            await self._write(b"data: " + go_json(self._v1_chat(delta, None)) + b"\n\n")
        else:
            await self._start(b"text/event-stream")
            await self._write(
                self._v1_cmpl(piece, None, self._ZERO if self.include_usage else None)
            )
        self.first = False

    async def tool_chunk(self) -> None:
        """The model's tool call, whole, as one chunk (held back when not streaming)."""
        assert self.tool_calls is not None
        self.tool_sent = True
        if not self.stream:
            return
        if self.kind == "chat":
            await self._start(b"application/x-ndjson")
            d = self._native("")
            d["message"]["tool_calls"] = self.tool_calls[0]
            d["done"] = False
            await self._write(go_json(d) + b"\n")
        else:
            await self._start(b"text/event-stream")
            delta: dict = {"role": "assistant", "content": ""} if self.first else {"content": ""}
            delta["tool_calls"] = self.tool_calls[1]
            await self._write(b"data: " + go_json(self._v1_chat(delta, None)) + b"\n\n")
        self.first = False

    async def error(self, message: str) -> None:
        if self.kind in ("chat", "generate"):
            if not self.started:
                self.state["finished"] = True
                await _send(self.send, 500, go_json({"error": message}))
                return
            await self._write(go_json({"error": message}) + b"\n")
        elif self.started:  # /v1 swallows it: an empty chunk, then the end, no [DONE]
            if self.kind == "v1chat":
                chunk = self._v1_chat({"content": ""}, None)
                chunk["model"] = ""
                await self._write(b"data: " + go_json(chunk) + b"\n\n")
            else:
                await self._write(
                    self._v1_cmpl("", None, None).replace(go_json(self.name), b'""', 1)
                )
        else:
            self.state["finished"] = True
            body = (
                go_json(
                    {
                        "error": {
                            "message": message,
                            "type": "api_error",
                            "param": None,
                            "code": None,
                        }
                    }
                )
                + b"\n"
            )
            await _send(self.send, 500, body, b"application/json")
            return
        self.state["finished"] = True
        await self.send({"type": "http.response.body", "body": b"", "more_body": False})

    async def done(self, reason: str, text: str, metrics: dict, context) -> None:
        m = {k: v for k, v in metrics.items() if v}  # omitempty
        if self.kind in ("chat", "generate"):
            d = self._native(text if not self.stream else "")
            if self.tool_sent and not self.stream and self.tool_calls is not None:
                d["message"]["tool_calls"] = self.tool_calls[0]
            d["done"] = True
            d["done_reason"] = reason
            if context is not None:
                d["context"] = context
            d.update(m)
            self.state["finished"] = True
            if self.stream:
                await self._start(b"application/x-ndjson")
                await self.send(
                    {"type": "http.response.body", "body": go_json(d) + b"\n", "more_body": False}
                )
            else:
                await _send(self.send, 200, go_json(d))
            return
        usage = {
            "prompt_tokens": metrics["prompt_eval_count"],
            "completion_tokens": metrics["eval_count"],
            "total_tokens": metrics["prompt_eval_count"] + metrics["eval_count"],
        }
        if self.tool_sent and reason == "stop":
            reason = "tool_calls"
        if not self.stream:
            if self.kind == "v1chat":
                message: dict = {"role": "assistant", "content": text}
                if self.tool_sent and self.tool_calls is not None:
                    message["tool_calls"] = self.tool_calls[1]
                body = {
                    "id": self.ident,
                    "object": "chat.completion",
                    "created": self.created,
                    "model": self.name,
                    "system_fingerprint": "fp_ollama",
                    "choices": [
                        {
                            "index": 0,
                            "message": message,
                            "finish_reason": reason,
                        }
                    ],
                    "usage": usage,
                }
            else:
                body = {
                    "id": self.ident,
                    "object": "text_completion",
                    "created": self.created,
                    "choices": [{"text": text, "index": 0, "finish_reason": reason}],
                    "model": self.name,
                    "system_fingerprint": "fp_ollama",
                    "usage": usage,
                }
            self.state["finished"] = True
            await _send(self.send, 200, go_json(body) + b"\n", b"application/json")
            return
        await self._start(b"text/event-stream")
        if self.kind == "v1chat":
            out = b"data: " + go_json(self._v1_chat({}, reason)) + b"\n\n"
            if self.include_usage:
                chunk = self._v1_chat({}, reason, choices=False)
                chunk["usage"] = usage
                out += b"data: " + go_json(chunk) + b"\n\n"
        else:
            out = self._v1_cmpl("", reason, self._ZERO if self.include_usage else None)
            if self.include_usage:
                out += self._v1_cmpl(None, None, usage)
        out += b"data: [DONE]\n\n"
        self.state["finished"] = True
        await self.send({"type": "http.response.body", "body": out, "more_body": False})


async def _send(
    send, status: int, body: bytes, ctype: bytes = b"application/json; charset=utf-8"
) -> None:
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [(b"content-type", ctype), (b"content-length", str(len(body)).encode())],
        }
    )
    await send({"type": "http.response.body", "body": body})
