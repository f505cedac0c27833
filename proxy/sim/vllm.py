"""A simulated vLLM 0.32 OpenAI server, byte-faithful to fixtures/vllm-real.

Headers go out at once (before queueing and prefill); the role chunk goes out right
after prefill, then one event per token, the last token riding on the finish chunk;
``system_fingerprint`` sits on the finish chunk, or on the usage chunk when there is
one; errors are plain JSON even for streams.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import time
import uuid

from .asgi import lifespan, loads, read_body, watch
from .choices import Choice, SendLock, run_choices, run_request
from .choices import plans as choice_plans
from .engine import SimEngine, Truth, count_tokens, plan_output, tokenize
from .power import dcgm_metrics
from .tools import ARGS, NAME, ToolCallPlan, vllm_dumps
from .vllm_extras import VLLMStats, inputs, vllm_embeddings_body

VERSION = "0.32.0"


def _dumps(obj) -> bytes:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode()


def _s(text: str) -> str:
    return json.dumps(text, ensure_ascii=False)


def error_body(status: int, message: str, kind: str, param: str | None) -> bytes:
    return _dumps({"error": {"message": message, "type": kind, "param": param, "code": status}})


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
                await _json(send, 405, b'{"detail":"Method Not Allowed"}', [(b"allow", b"POST")])
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
            await _json(send, 200, _dumps({"version": VERSION}))
        elif path == "/v1/models" and method == "GET":
            await _json(send, 200, self.models_body())
        elif path == "/tokenize" and method == "POST":
            await self.tokenize(receive, send)
        elif path == "/v1/embeddings" and method == "POST":
            await self.embeddings(receive, send)
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
            await _json(send, 404, b'{"detail":"Not Found"}')

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
        return _dumps({"object": "list", "data": data})

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
            await _json(
                send,
                400,
                error_body(
                    400, "input must be a string or a list of strings", "Bad Request", "input"
                ),
            )
            return
        name = obj.get("model") or next(iter(self.engine.models))
        if name not in self.engine.models:
            await _json(
                send,
                404,
                error_body(404, f"The model `{name}` does not exist.", "NotFoundError", "model"),
            )
            return
        await _json(send, 200, vllm_embeddings_body(name, texts, self.engine.deterministic))

    async def tokenize(self, receive, send) -> None:
        obj = loads(await read_body(receive))
        if not isinstance(obj, dict):
            await _json(send, 400, error_body(400, "invalid JSON", "Bad Request", "body"))
            return
        text = (
            chat_prompt_text(obj["messages"]) if "messages" in obj else str(obj.get("prompt", ""))
        )
        tokens = tokenize(text)
        name = obj.get("model")
        model = (self.engine.models.get(name) if isinstance(name, str) else None) or next(
            iter(self.engine.models.values())
        )
        await _json(
            send,
            200,
            _dumps(
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
            await _json(send, exc.status, error_body(exc.status, exc.message, exc.kind, exc.param))
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
        writer = _Writer(
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
            await self._generate_choices(receive, writer, me, truth, plans, stream)
            return
        task = asyncio.current_task()
        assert task is not None
        gone = asyncio.Event()
        watcher = asyncio.create_task(watch(receive, task, gone, writer.state))
        key = self.engine.next_key()
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
                    await writer.token(piece, i + 1, plan.finish_reason if last else None, i == 0)
                pieces.append(piece)
                if i == 0:
                    truth.t_first = now
                truth.t_last = now
            if stream:
                await writer.end_stream(n)
            else:
                await writer.whole("".join(pieces), plan.finish_reason, n)
            me.finished_total += 1
        except asyncio.CancelledError:
            # a hang-up (the watch cancels us) or the server stopping: an abort either way
            task.uncancel()
            truth.aborted = True
            me.aborted_total += 1
        finally:
            watcher.cancel()
            if admitted:
                truth.energy_joules = me.release(key)
            truth.t_end = time.monotonic()
            self.engine.write_truth(truth)
            self.stats.observe(truth)

    # --- n choices and tool calls -----------------------------------------------------------

    async def _generate_choices(self, receive, writer, me, truth, plans, stream: bool) -> None:
        """``n`` > 1 or a tool call: each choice a sequence of its own, the role events
        for every index at the first output, then each choice's tokens as they come,
        each choice's finish on its last token; usage counts every choice's tokens."""
        writer.send = SendLock(writer.send)
        choices = [Choice(j, self.engine.next_key(), p) for j, p in enumerate(plans)]
        tool_ids = {
            c.index: "chatcmpl-tool-"
            + (
                hashlib.sha256(f"{writer.ident}|{c.index}".encode()).hexdigest()[:32]
                if self.engine.deterministic
                else uuid.uuid4().hex
            )
            for c in choices
        }
        started = {"roles": False}

        async def on_token(c: Choice, i: int) -> None:
            now = time.monotonic()  # the truth's marks: before the token is written
            last = i == c.length - 1
            plan = c.plan
            visible = True
            if isinstance(plan, ToolCallPlan):
                kind, piece = plan.steps[i]
                visible = kind in (NAME, ARGS)
                finish = _tool_finish(plan) if last else None
                if stream and (visible or last):
                    if not started["roles"]:
                        started["roles"] = True
                        await writer.roles(len(choices))
                    if kind == NAME:
                        delta = (
                            '{"tool_calls":[{"id":"' + tool_ids[c.index] + '","type":"function",'
                            f'"index":0,"function":{{"name":{_s(piece)}}}}}]}}'
                        )
                    elif kind == ARGS:
                        delta = (
                            '{"tool_calls":[{"index":0,"function":{"arguments":'
                            + _s(piece)
                            + "}}]}"
                        )
                    else:
                        delta = "{}"
                    await writer.delta(c.index, delta, c.count, finish)
            elif stream:
                if not started["roles"]:
                    started["roles"] = True
                    await writer.roles(len(choices))
                finish = plan.finish_reason if last else None
                await writer.token(plan.pieces[i], c.count, finish, False, c.index)
            if visible and truth.t_first is None:
                truth.t_first = now
            truth.t_last = now

        async def work() -> None:
            if stream:  # vLLM sends its headers before the request is even queued
                await writer.start_stream()
            await run_choices(me, choices, truth.prompt_tokens, 0, truth, on_token)
            total = sum(c.count for c in choices)
            if stream:
                await writer.end_stream(total)
            else:
                await writer.whole_choices(
                    [(c.index, c.plan, tool_ids[c.index]) for c in choices], total
                )

        await run_request(receive, writer.state, me, self.engine, truth, work)


class _Writer:
    """Serialises one response exactly as vLLM 0.32 does."""

    def __init__(
        self,
        send,
        chat: bool,
        ident: str,
        created: int,
        model: str,
        fingerprint: str,
        prompt_tokens: int,
        include_usage: bool,
        continuous: bool,
    ) -> None:
        self.send = send
        self.chat = chat
        self.head = (
            f'{{"id":"{ident}","object":"{"chat.completion.chunk" if chat else "text_completion"}",'
            f'"created":{created},"model":{_s(model)},'
        )
        self.ident, self.created, self.model = ident, created, model
        self.fingerprint = fingerprint
        self.prompt_tokens = prompt_tokens
        self.include_usage = include_usage
        self.continuous = continuous
        self.state = {"finished": False}  # read by the hang-up watch

    async def start_stream(self) -> None:
        await self.send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [
                    (b"content-type", b"text/event-stream; charset=utf-8"),
                    (b"vary", b"Origin"),
                ],
            }
        )

    def _usage(self, completion: int, details: bool) -> str:
        tail = ',"completion_tokens_details":null' if details else ""
        return (
            f'"usage":{{"prompt_tokens":{self.prompt_tokens},"total_tokens":'
            f'{self.prompt_tokens + completion},"completion_tokens":{completion}{tail}}}'
        )

    async def _event(self, payload: str) -> None:
        await self.send(
            {
                "type": "http.response.body",
                "body": b"data: " + payload.encode() + b"\n\n",
                "more_body": True,
            }
        )

    async def roles(self, n: int) -> None:
        """The first event of every choice, each on its own (n > 1 and tool calls)."""
        for j in range(n):
            if self.chat:
                role_usage = "," + self._usage(0, True) if self.continuous else ""
                await self._event(
                    self.head + f'"choices":[{{"index":{j},"delta":{{"role":"assistant",'
                    '"content":""},"logprobs":null,"finish_reason":null}]'
                    + role_usage
                    + ',"prompt_token_ids":null,"prompt_text":null}'
                )

    async def delta(self, index: int, delta: str, count: int, finish: str | None) -> None:
        """A chat event carrying `delta` (a tool call's header or arguments, or ``{}``)."""
        cont = "," + self._usage(count, True) if self.continuous else ""
        if finish is None:
            choice = (
                f'{{"index":{index},"delta":{delta},"logprobs":null,"finish_reason":null,'
                '"token_ids":null}'
            )
        else:
            choice = (
                f'{{"index":{index},"delta":{delta},"logprobs":null,'
                f'"finish_reason":"{finish}","stop_reason":null,"token_ids":null}}'
            )
        fp = (
            f',"system_fingerprint":"{self.fingerprint}"'
            if finish and not self.include_usage
            else ""
        )
        await self._event(self.head + '"choices":[' + choice + "]" + cont + fp + "}")

    async def token(
        self, piece: str, count: int, finish: str | None, first: bool, index: int = 0
    ) -> None:
        cont = "," + self._usage(count, True) if self.continuous else ""
        if self.chat:
            if first:
                role_usage = "," + self._usage(0, True) if self.continuous else ""
                await self._event(
                    self.head + '"choices":[{"index":0,"delta":{"role":"assistant",'
                    '"content":""},"logprobs":null,"finish_reason":null}]'
                    + role_usage
                    + ',"prompt_token_ids":null,"prompt_text":null}'
                )
            if finish is None:
                choice = (
                    f'{{"index":{index},"delta":{{"content":{_s(piece)}}},"logprobs":null,'
                    '"finish_reason":null,"token_ids":null}'
                )
            else:
                choice = (
                    f'{{"index":{index},"delta":{{"content":{_s(piece)}}},"logprobs":null,'
                    f'"finish_reason":"{finish}","stop_reason":null,"token_ids":null}}'
                )
        else:
            fr = "null" if finish is None else f'"{finish}"'
            choice = (
                f'{{"index":{index},"text":{_s(piece)},"logprobs":null,"finish_reason":{fr},'
                '"stop_reason":null,"prompt_token_ids":null,"token_ids":null}'
            )
        fp = (
            f',"system_fingerprint":"{self.fingerprint}"'
            if finish and not self.include_usage
            else ""
        )
        await self._event(self.head + '"choices":[' + choice + "]" + cont + fp + "}")

    async def end_stream(self, completion: int) -> None:
        if self.include_usage:
            await self._event(
                self.head
                + '"choices":[],'
                + self._usage(completion, False)
                + f',"system_fingerprint":"{self.fingerprint}"}}'
            )
        await self.send(
            {"type": "http.response.body", "body": b"data: [DONE]\n\n", "more_body": True}
        )
        self.state["finished"] = True
        await self.send({"type": "http.response.body", "body": b"", "more_body": False})

    async def whole_choices(self, choices: list, completion: int) -> None:
        """The non-streamed answer of n choices (text or tool calls)."""
        parts = []
        for index, plan, tool_id in choices:
            if isinstance(plan, ToolCallPlan):
                finish = _tool_finish(plan)
                call = (
                    f'{{"id":"{tool_id}","type":"function","function":{{"name":{_s(plan.name)},'
                    f'"arguments":{_s("".join(plan.fragments))}}}}}'
                )
                message = (
                    '{"role":"assistant","content":null,"refusal":null,"annotations":null,'
                    f'"audio":null,"function_call":null,"tool_calls":[{call}],"reasoning":null}}'
                )
            else:
                finish, text = plan.finish_reason, "".join(plan.pieces)
                message = (
                    f'{{"role":"assistant","content":{_s(text)},"refusal":null,'
                    '"annotations":null,"audio":null,"function_call":null,"reasoning":null}'
                )
            if self.chat:
                parts.append(
                    f'{{"index":{index},"message":{message},"logprobs":null,'
                    f'"finish_reason":"{finish}","stop_reason":null,"token_ids":null,'
                    '"routed_experts":null}'
                )
            else:
                parts.append(
                    f'{{"index":{index},"text":{_s("".join(plan.pieces))},"logprobs":null,'
                    f'"finish_reason":"{finish}","stop_reason":null,"token_ids":null,'
                    '"prompt_logprobs":null,"prompt_token_ids":null,"routed_experts":null}'
                )
        usage = (
            f'"usage":{{"prompt_tokens":{self.prompt_tokens},"total_tokens":'
            f'{self.prompt_tokens + completion},"completion_tokens":{completion},'
            '"prompt_tokens_details":null,"completion_tokens_details":null}'
        )
        obj = "chat.completion" if self.chat else "text_completion"
        head = (
            f'{{"id":"{self.ident}","object":"{obj}",'
            f'"created":{self.created},"model":{_s(self.model)},"choices":[{",".join(parts)}],'
            f'"service_tier":null,"system_fingerprint":"{self.fingerprint}",{usage},'
        )
        tail = (
            '"prompt_logprobs":null,"prompt_token_ids":null,"prompt_text":null,'
            '"kv_transfer_params":null,"ec_transfer_params":null,"metrics":null}'
            if self.chat
            else '"kv_transfer_params":null,"ec_transfer_params":null,"metrics":null}'
        )
        self.state["finished"] = True
        await _json(self.send, 200, (head + tail).encode())

    async def whole(self, text: str, finish: str, completion: int) -> None:
        usage = (
            f'"usage":{{"prompt_tokens":{self.prompt_tokens},"total_tokens":'
            f'{self.prompt_tokens + completion},"completion_tokens":{completion},'
            '"prompt_tokens_details":null,"completion_tokens_details":null}'
        )
        if self.chat:
            body = (
                f'{{"id":"{self.ident}","object":"chat.completion","created":{self.created},'
                f'"model":{_s(self.model)},"choices":[{{"index":0,"message":{{"role":"assistant",'
                f'"content":{_s(text)},"refusal":null,"annotations":null,"audio":null,'
                f'"function_call":null,"reasoning":null}},"logprobs":null,"finish_reason":"{finish}",'
                f'"stop_reason":null,"token_ids":null,"routed_experts":null}}],"service_tier":null,'
                f'"system_fingerprint":"{self.fingerprint}",{usage},"prompt_logprobs":null,'
                '"prompt_token_ids":null,"prompt_text":null,"kv_transfer_params":null,'
                '"ec_transfer_params":null,"metrics":null}'
            )
        else:
            body = (
                f'{{"id":"{self.ident}","object":"text_completion","created":{self.created},'
                f'"model":{_s(self.model)},"choices":[{{"index":0,"text":{_s(text)},"logprobs":null,'
                f'"finish_reason":"{finish}","stop_reason":null,"token_ids":null,'
                '"prompt_logprobs":null,"prompt_token_ids":null,"routed_experts":null}],'
                f'"service_tier":null,"system_fingerprint":"{self.fingerprint}",{usage},'
                '"kv_transfer_params":null,"ec_transfer_params":null,"metrics":null}'
            )
        self.state["finished"] = True
        await _json(self.send, 200, body.encode())


def _tool_finish(plan: ToolCallPlan) -> str:
    """vLLM's finish reason for a call: ``tool_calls`` when the model chose to call (auto
    or required), the plain ``stop`` when the request named the function."""
    if plan.finish_reason == "stop" and not plan.forced:
        return "tool_calls"
    return plan.finish_reason


async def _json(send, status: int, body: bytes, extra=None) -> None:
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [
                (b"content-length", str(len(body)).encode()),
                (b"content-type", b"application/json"),
                (b"vary", b"Origin"),
            ]
            + (extra or []),
        }
    )
    await send({"type": "http.response.body", "body": body})
