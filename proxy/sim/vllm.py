"""A simulated vLLM 0.32 OpenAI server, byte-faithful to fixtures/vllm-real.

Headers go out at once (before queueing and prefill); the role chunk goes out right
after prefill, then one event per token, the last token riding on the finish chunk;
``system_fingerprint`` sits on the finish chunk, or on the usage chunk when there is
one; errors are plain JSON even for streams.
"""

from __future__ import annotations

import hashlib
import time
import uuid

from .asgi import lifespan, loads, read_body
from .choices import plans as choice_plans
from .choices import run_request
from .engine import SimEngine, Truth, count_tokens, plan_output, tokenize
from .power import dcgm_metrics, nvml_view
from .tools import ToolCallPlan, vllm_dumps
from .vllm_choices import generate_choices
from .vllm_extras import VLLMStats, inputs, vllm_embeddings_body
from .vllm_wire import Writer, dumps, error_body, json_response

VERSION = "0.32.0"


class BadRequest(Exception):
    def __init__(self, status: int, message: str, kind: str, param: str | None) -> None:
        super().__init__(message)
        self.status, self.message, self.kind, self.param = status, message, kind, param


def chat_prompt_text(messages) -> str:
    parts = []
    for m in messages:
        if not isinstance(m, dict):
            raise BadRequest(
                400,
                "1 validation error:\n  messages items must be objects",
                "Bad Request",
                "body.messages",
            )
        content = m.get("content")
        if isinstance(content, list):
            content = " ".join(str(p.get("text", "")) for p in content if isinstance(p, dict))
        parts.append(f"<|{m.get('role', 'user')}|> {content or ''}")
    return " ".join(parts) + " <|assistant|>"


class VLLMSim:
    """ASGI app speaking vLLM's OpenAI dialect over a :class:`SimEngine`."""

    def __init__(self, engine: SimEngine) -> None:
        self.engine = engine
        digest = hashlib.sha256(",".join(engine.models).encode()).hexdigest()[:8]
        self.fingerprint = f"vllm-{VERSION}-{digest}"
        self.stats = VLLMStats(engine)

    # --- ASGI ---------------------------------------------------------------------------

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "lifespan":
            await lifespan(receive, send, self.engine)
            return
        if scope["type"] != "http":
            return
        method, path = scope["method"], scope["path"]
        if path in ("/v1/chat/completions", "/v1/completions"):
            if method != "POST":
                await json_response(
                    send, 405, b'{"detail":"Method Not Allowed"}', [(b"allow", b"POST")]
                )
                return
            await self.generate(scope, receive, send, chat=path.endswith("chat/completions"))
        elif path == "/health" and method == "GET":
            await send(
                {
                    "type": "http.response.start",
                    "status": 200,
                    "headers": [(b"content-length", b"0"), (b"vary", b"Origin")],
                }
            )
            await send({"type": "http.response.body", "body": b""})
        elif path == "/version" and method == "GET":
            await json_response(send, 200, dumps({"version": VERSION}))
        elif path == "/v1/models" and method == "GET":
            await json_response(send, 200, self.models_body())
        elif path == "/tokenize" and method == "POST":
            await self.tokenize(receive, send)
        elif path == "/v1/embeddings" and method == "POST":
            await self.embeddings(receive, send)
        elif path == "/sim/nvml" and method == "GET":  # for the tests' stand-in pynvml
            await json_response(send, 200, nvml_view(self.engine))
        elif path == "/metrics" and method == "GET":
            body = self.metrics_text().encode()
            await send(
                {
                    "type": "http.response.start",
                    "status": 200,
                    "headers": [
                        (b"content-type", b"text/plain; version=1.0.0; charset=utf-8"),
                        (b"content-length", str(len(body)).encode()),
                    ],
                }
            )
            await send({"type": "http.response.body", "body": body})
        else:
            await json_response(send, 404, b'{"detail":"Not Found"}')

    # --- metadata -------------------------------------------------------------------------

    def models_body(self) -> bytes:
        created = self.engine.started
        data = []
        for mid, me in self.engine.models.items():
            data.append(
                {
                    "id": mid,
                    "object": "model",
                    "created": created,
                    "owned_by": "vllm",
                    "root": f"/models/{mid.split('/')[-1]}-{me.spec.profile.quant}",
                    "parent": None,
                    "max_model_len": me.spec.max_model_len,
                    "permission": [
                        {
                            "id": "modelperm-" + hashlib.md5(mid.encode()).hexdigest()[:16],
                            "object": "model_permission",
                            "created": created,
                            "allow_create_engine": False,
                            "allow_sampling": True,
                            "allow_logprobs": True,
                            "allow_search_indices": False,
                            "allow_view": True,
                            "allow_fine_tuning": False,
                            "organization": "*",
                            "group": None,
                            "is_blocking": False,
                        }
                    ],
                }
            )
        return dumps({"object": "list", "data": data})

    def metrics_text(self) -> str:
        lines = []
        for name, kind, fn in (
            ("vllm:num_requests_running", "gauge", lambda me: len(me.running)),
            ("vllm:num_requests_waiting", "gauge", lambda me: me.waiting),
            (
                "vllm:kv_cache_usage_perc",
                "gauge",
                lambda me: min(1.0, sum(me.running.values()) / 262144),
            ),
            ("vllm:prompt_tokens_total", "counter", lambda me: me.prompt_tokens_total),
            ("vllm:generation_tokens_total", "counter", lambda me: me.generation_tokens_total),
            ("phasewatch_sim_aborted_requests_total", "counter", lambda me: me.aborted_total),
            ("phasewatch_sim_finished_requests_total", "counter", lambda me: me.finished_total),
        ):
            lines.append(f"# TYPE {name} {kind}")
            for mid, me in self.engine.models.items():
                lines.append(f'{name}{{engine="0",model_name="{mid}"}} {float(fn(me))}')
        lines += self.stats.metrics_lines()
        # the simulated GPUs' power, as a dcgm-exporter beside the engine would serve it
        return "\n".join(lines) + "\n" + dcgm_metrics(self.engine)

    async def embeddings(self, receive, send) -> None:
        """/v1/embeddings: one vector per input, usage counting the input tokens."""
        obj = loads(await read_body(receive))
        texts = inputs(obj.get("input")) if isinstance(obj, dict) else None
        if texts is None:
            await json_response(
                send,
                400,
                error_body(
                    400, "input must be a string or a list of strings", "Bad Request", "input"
                ),
            )
            return
        name = obj.get("model") or next(iter(self.engine.models))
        if name not in self.engine.models:
            await json_response(
                send,
                404,
                error_body(404, f"The model `{name}` does not exist.", "NotFoundError", "model"),
            )
            return
        await json_response(send, 200, vllm_embeddings_body(name, texts, self.engine.deterministic))

    async def tokenize(self, receive, send) -> None:
        obj = loads(await read_body(receive))
        if not isinstance(obj, dict):
            await json_response(send, 400, error_body(400, "invalid JSON", "Bad Request", "body"))
            return
        text = (
            chat_prompt_text(obj["messages"]) if "messages" in obj else str(obj.get("prompt", ""))
        )
        tokens = tokenize(text)
        name = obj.get("model")
        model = (self.engine.models.get(name) if isinstance(name, str) else None) or next(
            iter(self.engine.models.values())
        )
        await json_response(
            send,
            200,
            dumps(
                {
                    "count": len(tokens),
                    "max_model_len": model.spec.max_model_len,
                    "tokens": tokens,
                    "token_strs": None,
                }
            ),
        )

    # --- generation ---------------------------------------------------------------------

    def _validate(self, obj, chat: bool):
        if not isinstance(obj, dict):
            raise BadRequest(
                400,
                "1 validation error:\n  {'type': 'json_invalid', 'loc': 'body', "
                "'msg': 'JSON decode error'}",
                "Bad Request",
                "body",
            )
        if chat and not isinstance(obj.get("messages"), list):
            raise BadRequest(
                400,
                "1 validation error:\n  {'type': 'missing', 'loc': "
                "('body', 'messages'), 'msg': 'Field required'}",
                "Bad Request",
                "body.messages",
            )
        if not chat and not isinstance(obj.get("prompt"), (str, list)):
            raise BadRequest(
                400,
                "1 validation error:\n  {'type': 'missing', 'loc': "
                "('body', 'prompt'), 'msg': 'Field required'}",
                "Bad Request",
                "body.prompt",
            )
        model_id = obj.get("model")
        if model_id is None:
            model_id = next(iter(self.engine.models))
        me = self.engine.models.get(model_id)
        if me is None:
            raise BadRequest(
                404,
                f"The model `{model_id}` does not exist. Valid aliases: "
                f"{', '.join(self.engine.models)}.",
                "NotFoundError",
                "model",
            )
        stream = obj.get("stream") is True
        if obj.get("stream_options") is not None and not stream:
            raise BadRequest(
                400,
                "Stream options can only be defined when `stream=True`. (parameter=stream_options)",
                "BadRequestError",
                "stream_options",
            )
        text = (
            chat_prompt_text(obj["messages"])
            if chat
            else (
                obj["prompt"]
                if isinstance(obj["prompt"], str)
                else " ".join(map(str, obj["prompt"]))
            )
        )
        prompt_tokens = count_tokens(text) + (1 if chat else 0)
        limit = me.spec.max_model_len
        if prompt_tokens >= limit:
            raise BadRequest(
                400,
                f"This model's maximum context length is {limit} tokens. However, "
                f"your prompt contains at least {prompt_tokens} input tokens, which "
                "exceeds this limit even without any output tokens. Please reduce "
                "the length of the input prompt. (parameter=input_tokens, "
                f"value={prompt_tokens})",
                "BadRequestError",
                "input_tokens",
            )
        max_tokens = obj.get("max_completion_tokens", obj.get("max_tokens"))
        if max_tokens is not None and (not isinstance(max_tokens, int) or max_tokens < 1):
            raise BadRequest(400, "max_tokens must be at least 1", "BadRequestError", "max_tokens")
        if max_tokens is not None and max_tokens > limit:
            raise BadRequest(
                400,
                f"'max_tokens' or 'max_completion_tokens' is too large: "
                f"{max_tokens}. This model's maximum context length is {limit} "
                f"tokens and your request has {prompt_tokens} input tokens "
                f"({max_tokens} > {limit} - {prompt_tokens}). (parameter=max_tokens, "
                f"value={max_tokens})",
                "BadRequestError",
                "max_tokens",
            )
        n = obj.get("n", 1)
        if n is None:
            n = 1
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise BadRequest(400, "n must be at least 1.", "BadRequestError", "n")
        room = limit - prompt_tokens
        max_tokens = min(max_tokens, room) if max_tokens is not None else room
        return me, model_id, stream, text, prompt_tokens, max_tokens

    async def generate(self, scope, receive, send, chat: bool) -> None:
        t_recv = time.monotonic()
        obj = loads(await read_body(receive))
        try:
            me, model_id, stream, text, prompt_tokens, max_tokens = self._validate(obj, chat)
        except BadRequest as exc:
            await json_response(
                send, exc.status, error_body(exc.status, exc.message, exc.kind, exc.param)
            )
            return
        options = obj.get("stream_options")
        include_usage = (
            isinstance(options, dict) and options.get("include_usage", True) is not False
        )
        continuous = include_usage and bool(options.get("continuous_usage_stats"))
        plan = plan_output(text, max_tokens, bool(obj.get("ignore_eos")), obj.get("seed"))
        plans = choice_plans(obj, obj.get("n") or 1, chat, text, max_tokens, plan, vllm_dumps)
        rid = dict(scope["headers"]).get(b"x-request-id", b"").decode("latin-1") or uuid.uuid4().hex
        if self.engine.deterministic:
            tag = hashlib.sha256(f"{model_id}|{text}|{max_tokens}".encode()).hexdigest()[:16]
            created = 1796012797
        else:
            tag, created = uuid.uuid4().hex[:16], int(time.time())
        ident = ("chatcmpl-" if chat else "cmpl-") + tag
        truth = Truth(
            rid, model_id, me.spec.profile.name, prompt_tokens, t_recv=t_recv, gpu=me.gpu_index
        )
        writer = Writer(
            send,
            chat,
            ident,
            created,
            model_id,
            self.fingerprint,
            prompt_tokens,
            include_usage,
            continuous,
        )
        if len(plans) > 1 or isinstance(plans[0], ToolCallPlan):
            await generate_choices(self, receive, writer, me, truth, plans, stream)
            return
        key = self.engine.next_key()

        async def work() -> None:
            admitted = False
            try:
                if stream:  # vLLM sends its headers before the request is even queued
                    await writer.start_stream()
                await me.admit(key, prompt_tokens)
                admitted = True
                truth.t_admit = time.monotonic()
                me.prompt_tokens_total += prompt_tokens
                await me.prefill(truth.t_admit, prompt_tokens, 0)
                truth.prefill_seconds = time.monotonic() - truth.t_admit
                n = len(plan.pieces)
                pieces = []
                async for i in me.steps(key, prompt_tokens, n):
                    piece, last = plan.pieces[i], i == n - 1
                    truth.completion_tokens = i + 1
                    # the truth's marks are taken as the token is produced, before it is
                    # written: a client necessarily sees it later
                    now = time.monotonic()
                    if stream:
                        finish = plan.finish_reason if last else None
                        await writer.token(piece, i + 1, finish, i == 0)
                    pieces.append(piece)
                    if i == 0:
                        truth.t_first = now
                    truth.t_last = now
                if stream:
                    await writer.end_stream(n)
                else:
                    await writer.whole("".join(pieces), plan.finish_reason, n)
            finally:
                if admitted:
                    truth.energy_joules = me.release(key)

        try:
            await run_request(receive, writer.state, me, self.engine, truth, work)
        finally:
            self.stats.observe(truth)
