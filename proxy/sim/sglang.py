"""A simulated SGLang server (``python -m sglang.launch_server``), byte-faithful to the
wire shapes in tests/fixtures/wire/sglang, over the simulator's physics.

One model per server, as SGLang serves it: the request's ``model`` is echoed, not checked.
Headers go out at once (Starlette's StreamingResponse); the first token brings the role
chunk, each token a content chunk, the finish reason a chunk of its own with an empty
delta, then the usage chunk (``include_usage``) and ``[DONE]``. ``continuous_usage_stats``
puts the usage so far on every content and finish chunk. A prompt too long for the
context, streamed, fails inside the 200 stream (``data: {"error": ...}`` then ``[DONE]``);
``POST /abort_request {"rid"}`` ends a running request with ``finish_reason: "abort"``.
``/metrics`` only with ``--enable-metrics``. ``/get_model_info`` and ``/get_server_info``
answer as the new names do; their calls are counted (SGLang logs a warning on each), and
so are ``/health``'s (SGLang may generate a token for each) and ``/v1/models``':
``GET /sim/calls``.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import time
import uuid

from .asgi import lifespan, loads, read_body
from .choices import run_request
from .engine import ModelEngine, SimEngine, Truth, count_tokens, plan_output
from .power import dcgm_metrics, nvml_view
from .vllm import chat_prompt_text
from .vllm_wire import dumps, quoted

VERSION = "0.5.5"
#: The id of Llama 3's end-of-turn token: SGLang's ``matched_stop`` for an EOS stop.
EOS_ID = 128009
KV_TOKENS = 262144
_NULL_DELTA = '{"role":null,"content":null,"reasoning_content":null,"tool_calls":null}'


def _headers(content_type: bytes, body: bytes | None = None) -> list:
    out = [(b"content-type", content_type)]
    if body is not None:
        out.insert(0, (b"content-length", str(len(body)).encode()))
    return out


async def respond(send, status: int, body: bytes, content_type: bytes = b"application/json"):
    await send(
        {"type": "http.response.start", "status": status, "headers": _headers(content_type, body)}
    )
    await send({"type": "http.response.body", "body": body})


class Stream:
    """One streamed answer: its framing, and whether it reached its end (the hang-up watch
    reads ``state``)."""

    def __init__(self, send) -> None:
        self.send = send
        self.state = {"finished": False}

    async def start(self) -> None:
        await self.send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": _headers(b"text/event-stream; charset=utf-8"),
            }
        )

    async def event(self, payload: str) -> None:
        body = b"data: " + payload.encode() + b"\n\n"
        await self.send({"type": "http.response.body", "body": body, "more_body": True})

    async def done(self) -> None:
        await self.send(
            {"type": "http.response.body", "body": b"data: [DONE]\n\n", "more_body": True}
        )
        self.state["finished"] = True
        await self.send({"type": "http.response.body", "body": b"", "more_body": False})


class Request:
    """What one OpenAI-style request asks (parsed and checked by the server)."""

    def __init__(self, obj: dict, chat: bool, model: str, text: str, prompt_tokens: int) -> None:
        self.obj, self.chat, self.model, self.text = obj, chat, model, text
        self.prompt_tokens = prompt_tokens
        self.stream = obj.get("stream") is True
        options = obj.get("stream_options") if self.stream else None
        options = options if isinstance(options, dict) else {}
        self.include_usage = options.get("include_usage") is True
        self.continuous = options.get("continuous_usage_stats") is True
        self.sglext = obj.get("return_cached_tokens_details") is True
        rid = obj.get("rid")
        self.rid = rid if isinstance(rid, str) and rid else ""

    def adopt_id(self, scope) -> None:
        """The request's id: its ``rid``, else the ``x-request-id`` header (the truth log
        is matched to the proxy's lines by it), else a fresh one."""
        if not self.rid:
            header = dict(scope["headers"]).get(b"x-request-id", b"").decode("latin-1")
            self.rid = header[:128] or uuid.uuid4().hex


class SGLangSim:
    """ASGI app speaking SGLang's HTTP API over a :class:`SimEngine` serving one model."""

    owned_by = "sglang"

    def __init__(
        self, engine: SimEngine, enable_metrics: bool = False, model_dir: str | None = None
    ) -> None:
        self.engine = engine
        self.enable_metrics = enable_metrics
        self.model_dir = model_dir
        self.model_id, self.me = next(iter(engine.models.items()))
        self.calls = {"get_model_info": 0, "get_server_info": 0, "health": 0, "models": 0}
        self.aborts: dict[str, asyncio.Event] = {}

    # --- ASGI ---------------------------------------------------------------------------

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "lifespan":
            await lifespan(receive, send, self.engine)
            return
        if scope["type"] != "http":
            return
        method, path = scope["method"], scope["path"]
        handler = self.routes().get((method, path))
        if handler is None:
            await respond(send, 404, b'{"detail":"Not Found"}')
            return
        await handler(scope, receive, send)

    def routes(self) -> dict:
        get = {
            "/health": self.health,
            "/health_generate": self.health,
            "/ping": self.health,
            "/model_info": self.model_info,
            "/get_model_info": self.model_info,
            "/server_info": self.server_info,
            "/get_server_info": self.server_info,
            "/v1/models": self.models,
            "/metrics": self.metrics,
            "/sim/nvml": self.nvml,
            "/sim/calls": self.counted_calls,
        }
        post = {
            "/v1/chat/completions": self.chat,
            "/v1/completions": self.completions,
            "/generate": self.native,
            "/abort_request": self.abort_request,
        }
        out = {("GET", p): h for p, h in get.items()}
        out.update({("POST", p): h for p, h in post.items()})
        out[("PUT", "/generate")] = self.native
        return out

    # --- metadata -------------------------------------------------------------------------

    async def health(self, scope, receive, send) -> None:
        if scope["path"] in ("/health", "/health_generate"):
            self.calls["health"] += 1
        await respond(send, 200, b"", b"text/plain; charset=utf-8")

    async def nvml(self, scope, receive, send) -> None:
        await respond(send, 200, nvml_view(self.engine))

    async def counted_calls(self, scope, receive, send) -> None:
        await respond(send, 200, dumps(self.calls))

    async def model_info(self, scope, receive, send) -> None:
        if scope["path"] == "/get_model_info":
            self.calls["get_model_info"] += 1
        body = {
            "model_path": self.model_id,
            "tokenizer_path": self.model_id,
            "is_generation": True,
            "preferred_sampling_params": None,
            "weight_version": "default",
            "has_image_understanding": False,
            "has_audio_understanding": False,
            "model_type": "llama",
            "architectures": ["LlamaForCausalLM"],
        }
        await respond(send, 200, dumps(body))

    def quantization(self) -> str | None:
        """``--quantization`` as the simulated operator passed it: fp8 for the FP8 model
        (SGLang's online FP8), nothing otherwise (an AWQ checkpoint says so itself)."""
        return "fp8" if self.me.spec.profile.name == "fp8" else None

    async def server_info(self, scope, receive, send) -> None:
        if scope["path"] == "/get_server_info":
            self.calls["get_server_info"] += 1
        spec = self.me.spec
        body = {
            "model_path": self.model_id,
            "tokenizer_path": self.model_id,
            "tokenizer_mode": "auto",
            "skip_tokenizer_init": False,
            "load_format": "auto",
            "trust_remote_code": False,
            "context_length": None,
            "is_embedding": False,
            "revision": None,
            "host": "127.0.0.1",
            "port": 30000,
            "dtype": "auto",
            "kv_cache_dtype": spec.kv_cache_dtype,
            "quantization": self.quantization(),
            "served_model_name": self.model_id,
            "api_key": None,
            "max_running_requests": self.me.max_num_seqs,
            "max_total_num_tokens": KV_TOKENS,
            "chunked_prefill_size": 8192,
            "enable_metrics": self.enable_metrics,
            "enable_cache_report": False,
            "internal_states": [
                {"last_gen_throughput": 0.0, "memory_usage": {"weight": 15.0, "kvcache": 32.0}}
            ],
            "version": VERSION,
        }
        await respond(send, 200, dumps(body))

    async def models(self, scope, receive, send) -> None:
        self.calls["models"] += 1
        card = {
            "id": self.model_id,
            "object": "model",
            "created": int(self.engine.started),
            "owned_by": self.owned_by,
            "root": self.model_id,
            "parent": None,
            "max_model_len": self.me.spec.max_model_len,
        }
        await respond(send, 200, dumps({"object": "list", "data": [card]}))

    def metrics_text(self) -> str:
        me, labels = self.me, f'engine_type="unified",model_name="{self.model_id}",tp_rank="0"'
        rows = (
            ("sglang:num_running_reqs", "gauge", len(me.running)),
            ("sglang:num_queue_reqs", "gauge", me.waiting),
            ("sglang:token_usage", "gauge", min(1.0, sum(me.running.values()) / KV_TOKENS)),
            ("sglang:cache_hit_rate", "gauge", 0.0),
            ("sglang:prompt_tokens_total", "counter", me.prompt_tokens_total),
            ("sglang:generation_tokens_total", "counter", me.generation_tokens_total),
        )
        lines = []
        for name, kind, value in rows:
            lines.append(f"# TYPE {name} {kind}")
            lines.append(f"{name}{{{labels}}} {float(value)}")
        return "\n".join(lines) + "\n" + dcgm_metrics(self.engine)

    async def metrics(self, scope, receive, send) -> None:
        if not self.enable_metrics:
            await respond(send, 404, b'{"detail":"Not Found"}')
            return
        body = self.metrics_text().encode()
        await respond(send, 200, body, b"text/plain; version=0.0.4; charset=utf-8")

    async def abort_request(self, scope, receive, send) -> None:
        obj = loads(await read_body(receive))
        rid = obj.get("rid") if isinstance(obj, dict) else None
        event = self.aborts.get(rid) if isinstance(rid, str) else None
        if event is not None:
            event.set()
        await respond(send, 200, b"", b"text/plain; charset=utf-8")

    # --- errors -------------------------------------------------------------------------

    def error(self, message: str, status: int = 400) -> bytes:
        return dumps(
            {
                "object": "error",
                "message": message,
                "type": "BadRequest",
                "param": None,
                "code": status,
            }
        )

    def stream_error(self, message: str) -> str:
        """SGLang's in-stream error: ``json.dumps`` (spaced) of its ErrorResponse."""
        err = {"object": "error", "message": message, "type": "BadRequestError", "param": None}
        return json.dumps({"error": {**err, "code": 400}})

    def too_long(self, prompt_tokens: int) -> str | None:
        limit = self.me.spec.max_model_len
        if prompt_tokens < limit:
            return None
        return (
            f"The input ({prompt_tokens} tokens) is longer than the model's context length "
            f"({limit} tokens)."
        )

    # --- the OpenAI API -------------------------------------------------------------------

    async def chat(self, scope, receive, send) -> None:
        await self.openai(scope, receive, send, chat=True)

    async def completions(self, scope, receive, send) -> None:
        await self.openai(scope, receive, send, chat=False)

    def parse(self, raw: bytes, chat: bool) -> Request | str:
        obj = loads(raw)
        if not isinstance(obj, dict):
            return "Invalid JSON body"
        if chat and not isinstance(obj.get("messages"), list):
            return "1 validation error: messages Field required"
        if not chat and not isinstance(obj.get("prompt"), (str, list)):
            return "1 validation error: prompt Field required"
        if obj.get("n") not in (None, 1) or obj.get("tools"):
            return "the simulated SGLang serves n=1 without tools"
        if chat:
            text = chat_prompt_text(obj["messages"])
        else:
            prompt = obj["prompt"]
            text = prompt if isinstance(prompt, str) else " ".join(map(str, prompt))
        model = obj.get("model")
        model = model if isinstance(model, str) else "default"
        return Request(obj, chat, model, text, count_tokens(text) + (1 if chat else 0))

    async def openai(self, scope, receive, send, chat: bool) -> None:
        t_recv = time.monotonic()
        req = self.parse(await read_body(receive), chat)
        if isinstance(req, str):
            await respond(send, 400, self.error(req))
            return
        req.adopt_id(scope)
        limit = req.obj.get("max_completion_tokens", req.obj.get("max_tokens"))
        if limit is not None and (not isinstance(limit, int) or limit < 1):
            await respond(send, 400, self.error("max_tokens must be positive"))
            return
        too_long = self.too_long(req.prompt_tokens)
        if too_long is not None and not req.stream:
            await respond(send, 400, self.error(too_long))
            return
        room = self.me.spec.max_model_len - req.prompt_tokens
        max_tokens = min(limit, room) if limit is not None else (16 if not chat else room)
        writer = self.writer(req).bind(send)
        truth = Truth(
            req.rid, self.model_id, self.me.spec.profile.name, req.prompt_tokens, t_recv=t_recv
        )
        truth.gpu = self.me.gpu_index
        if too_long is not None:  # SGLang checks the length inside the stream
            truth.aborted = True

            async def fail() -> None:
                await writer.stream.start()
                await writer.stream.event(self.stream_error(too_long))
                await writer.stream.done()

            await run_request(receive, writer.stream.state, self.me, self.engine, truth, fail)
            return
        plan = plan_output(
            req.text, max_tokens, bool(req.obj.get("ignore_eos")), req.obj.get("seed")
        )

        async def work() -> None:
            if req.stream:
                await writer.stream.start()
            n, pieces, finish = await self.run(req, truth, plan, writer)
            if req.stream:
                await writer.end(n, finish)
            else:
                await writer.whole("".join(pieces), finish, n)

        await run_request(receive, writer.stream.state, self.me, self.engine, truth, work)

    def writer(self, req: Request):
        return SGLangWriter(req, self.engine.deterministic)

    async def run(self, req: Request, truth: Truth, plan, writer) -> tuple[int, list[str], str]:
        """Admit, prefill and decode `plan`, writing each token as it is produced; the
        tokens produced, their text and the finish reason (``abort`` when aborted)."""
        me: ModelEngine = self.me
        key = self.engine.next_key()
        abort = self.aborts.setdefault(req.rid, asyncio.Event())
        admitted, pieces, finish = False, [], plan.finish_reason
        try:
            await me.admit(key, req.prompt_tokens)
            admitted = True
            truth.t_admit = time.monotonic()
            me.prompt_tokens_total += req.prompt_tokens
            await me.prefill(truth.t_admit, req.prompt_tokens, 0)
            truth.prefill_seconds = time.monotonic() - truth.t_admit
            n = len(plan.pieces)
            async for i in me.steps(key, req.prompt_tokens, n):
                if abort.is_set():
                    finish = "abort"
                    break
                now = time.monotonic()
                truth.completion_tokens = i + 1
                if i == 0:
                    truth.t_first = now
                truth.t_last = now
                piece = plan.pieces[i]
                pieces.append(piece)
                if req.stream:
                    await writer.token(piece, i + 1, i == n - 1, finish)
        finally:
            self.aborts.pop(req.rid, None)
            if admitted:
                truth.energy_joules = me.release(key)
        if finish == "abort":
            truth.aborted = True
        return truth.completion_tokens, pieces, finish

    # --- the native /generate -------------------------------------------------------------

    async def native(self, scope, receive, send) -> None:
        t_recv = time.monotonic()
        obj = loads(await read_body(receive))
        text = obj.get("text") if isinstance(obj, dict) else None
        if not isinstance(text, str):
            await respond(send, 400, dumps({"error": {"message": "text must be a string"}}))
            return
        params = obj.get("sampling_params") if isinstance(obj.get("sampling_params"), dict) else {}
        prompt_tokens = count_tokens(text)
        too_long = self.too_long(prompt_tokens)
        if too_long is not None:
            await respond(send, 400, dumps({"error": {"message": too_long}}))
            return
        limit = params.get("max_new_tokens", 128)
        limit = limit if isinstance(limit, int) and limit > 0 else 128
        req = Request(
            {**obj, "stream": obj.get("stream") is True}, False, self.model_id, text, prompt_tokens
        )
        req.adopt_id(scope)
        plan = plan_output(text, limit, bool(params.get("ignore_eos")), None)
        truth = Truth(
            req.rid, self.model_id, self.me.spec.profile.name, prompt_tokens, t_recv=t_recv
        )
        truth.gpu = self.me.gpu_index
        writer = GenerateWriter(req, t_recv).bind(send)

        async def work() -> None:
            if req.stream:
                await writer.stream.start()
            n, pieces, finish = await self.run(req, truth, plan, writer)
            if req.stream:
                await writer.stream.done()
            else:
                await writer.whole("".join(pieces), n, finish)

        await run_request(receive, writer.stream.state, self.me, self.engine, truth, work)


def _finish(finish: str, count: int) -> str:
    """``meta_info.finish_reason`` as SGLang writes it."""
    if finish == "length":
        return f'{{"type":"length","length":{count}}}'
    if finish == "abort":
        return '{"type":"abort","message":"Abort in waiting queue","status_code":499}'
    return f'{{"type":"stop","matched":{EOS_ID}}}'


class GenerateWriter:
    """The native /generate: each event the whole text so far and its ``meta_info``."""

    def __init__(self, req: Request, t_recv: float) -> None:
        self.req, self.t_recv = req, t_recv
        self.stream = Stream(None)
        self.text: list[str] = []
        self.ids: list[int] = []

    def bind(self, send) -> GenerateWriter:
        self.stream.send = send
        return self

    def body(self, count: int, finish: str | None) -> str:
        fr = "null" if finish is None else _finish(finish, count)
        ids = json.dumps(self.ids, separators=(",", ":"))
        return (
            f'{{"text":{quoted("".join(self.text))},"output_ids":{ids},'
            f'"meta_info":{{"id":"{self.req.rid}","finish_reason":{fr},'
            f'"prompt_tokens":{self.req.prompt_tokens},"weight_version":"default",'
            f'"completion_tokens":{count},"cached_tokens":0,'
            f'"e2e_latency":{time.monotonic() - self.t_recv:.6f}}}}}'
        )

    async def token(self, piece: str, count: int, last: bool, finish: str) -> None:
        self.text.append(piece)
        digest = int(hashlib.sha256(piece.encode()).hexdigest()[:8], 16)
        self.ids.append(1000 + digest % 30000 if piece else EOS_ID)
        await self.stream.event(self.body(count, finish if last else None))

    async def whole(self, text: str, count: int, finish: str) -> None:
        self.text = [text]
        self.stream.state["finished"] = True
        await respond(self.stream.send, 200, self.body(count, finish).encode())


def chunk_head(req: Request, deterministic: bool, prefix: str) -> tuple[str, int, str]:
    """An OpenAI-style answer's id, created time and the start of each chunk's JSON (id,
    object, created, model), as SGLang and trtllm-serve dump them; `deterministic` ties
    the id to the request, so that a replayed answer is byte for byte the same."""
    if deterministic:
        tag = hashlib.sha256(f"{req.model}|{req.text}".encode()).hexdigest()[:32]
        created = 1796012797
    else:
        tag, created = uuid.uuid4().hex, int(time.time())
    ident = prefix + tag
    kind = "chat.completion.chunk" if req.chat else "text_completion"
    head = f'{{"id":"{ident}","object":"{kind}","created":{created},"model":{quoted(req.model)},'
    return ident, created, head


class SGLangWriter:
    """Serialises one OpenAI-style answer as SGLang's pydantic models dump it."""

    def __init__(self, req: Request, deterministic: bool) -> None:
        self.req = req
        self.stream = Stream(None)
        self.ident, self.created, self.head = chunk_head(req, deterministic, "")

    def bind(self, send) -> SGLangWriter:
        self.stream.send = send
        return self

    def usage(self, completion: int) -> str:
        p = self.req.prompt_tokens
        return (
            f'{{"prompt_tokens":{p},"total_tokens":{p + completion},'
            f'"completion_tokens":{completion},"prompt_tokens_details":null,"reasoning_tokens":0}}'
        )

    def _usage_field(self, completion: int) -> str:
        return self.usage(completion) if self.req.continuous else "null"

    def _chunk(self, choice: str, completion: int, sglext: bool = False) -> str:
        ext = (
            ',"sglext":{"cached_tokens_details":{"device":0,"host":0}}'
            if sglext and self.req.sglext
            else ""
        )
        return self.head + f'"choices":[{choice}],"usage":{self._usage_field(completion)}{ext}}}'

    async def token(self, piece: str, count: int, last: bool, finish: str) -> None:
        ev = self.stream.event
        if self.req.chat:
            if count == 1:
                role = (
                    '{"index":0,"delta":{"role":"assistant","content":"","reasoning_content":null,'
                    '"tool_calls":null},"logprobs":null,"finish_reason":null,"matched_stop":null}'
                )
                await ev(self.head + f'"choices":[{role}],"usage":null}}')
            if piece:  # the EOS token has no text: no content chunk
                delta = (
                    f'{{"role":null,"content":{quoted(piece)},"reasoning_content":null,'
                    '"tool_calls":null}'
                )
                choice = (
                    f'{{"index":0,"delta":{delta},"logprobs":null,"finish_reason":null,'
                    '"matched_stop":null}'
                )
                await ev(self._chunk(choice, count))
        else:
            fr, matched = ("null", "null")
            if last:
                fr, matched = f'"{finish}"', (str(EOS_ID) if finish == "stop" else "null")
            choice = (
                f'{{"index":0,"text":{quoted(piece)},"logprobs":null,"finish_reason":{fr},'
                f'"matched_stop":{matched}}}'
            )
            await ev(self._chunk(choice, count, sglext=last))

    async def end(self, completion: int, finish: str) -> None:
        ev = self.stream.event
        if self.req.chat:
            matched = str(EOS_ID) if finish == "stop" else "null"
            choice = (
                f'{{"index":0,"delta":{_NULL_DELTA},"logprobs":null,'
                f'"finish_reason":"{finish}","matched_stop":{matched}}}'
            )
            await ev(self._chunk(choice, completion, sglext=True))
        elif finish == "abort":  # cut before its last token: the finish rides alone
            choice = (
                '{"index":0,"text":"","logprobs":null,"finish_reason":"abort","matched_stop":null}'
            )
            await ev(self._chunk(choice, completion, sglext=True))
        if self.req.include_usage:
            await ev(self.head + f'"choices":[],"usage":{self.usage(completion)}}}')
        await self.stream.done()

    async def whole(self, text: str, finish: str, completion: int) -> None:
        matched = str(EOS_ID) if finish == "stop" else "null"
        if self.req.chat:
            message = (
                f'{{"role":"assistant","content":{quoted(text)},"reasoning_content":null,'
                '"tool_calls":null}'
            )
            choice = (
                f'{{"index":0,"message":{message},"logprobs":null,"finish_reason":"{finish}",'
                f'"matched_stop":{matched}}}'
            )
            obj = "chat.completion"
        else:
            choice = (
                f'{{"index":0,"text":{quoted(text)},"logprobs":null,"finish_reason":"{finish}",'
                f'"matched_stop":{matched}}}'
            )
            obj = "text_completion"
        body = (
            f'{{"id":"{self.ident}","object":"{obj}","created":{self.created},'
            f'"model":{quoted(self.req.model)},"choices":[{choice}],'
            f'"usage":{self.usage(completion)},"metadata":{{"weight_version":"default"}}}}'
        )
        self.stream.state["finished"] = True
        await respond(self.stream.send, 200, body.encode())
