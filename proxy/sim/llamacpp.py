"""A simulated llama.cpp ``llama-server``, faithful to the real captures
(fixtures/llama-server) and fixtures/wire §4.

One model under its alias, ``--parallel`` slots = ``--max-num-seqs``. Streams send their
headers when a slot starts the request (before prefill); the first chat write holds the
role event (``"content":null``) and the first token; one event per token after that; the
finish event has ``"delta":{}``; ``timings`` ride on the last JSON event (the usage event
when ``include_usage`` is on); ``[DONE]`` is its own write. ``/v1/completions`` always
carries usage on its last event; native ``/completion`` ends after its ``"stop":true``
event with no ``[DONE]``. ``timings`` come from the simulator's physics: ``prompt_ms`` is
the prefill of the uncached prompt (``cache_n`` tokens re-used from the slot's last
prompt), ``predicted_ms`` first to last token, ``predicted_per_second`` =
``(predicted_n - 1) / predicted_ms`` as this build computes it. Precision shows as
``model_ftype`` / ``meta.ftype`` ("Q4_K - Medium") and in the GGUF file name.

Fault injection for tests: ``"sim_error_after": N`` in the request ends a stream after N
tokens with ``data: {"error":...}`` and no ``[DONE]``.
"""

from __future__ import annotations

import hashlib
import json
import string
import time

from .asgi import lifespan, loads, read_body
from .choices import run_request
from .engine import SimEngine, plan_output, tokenize
from .gguf import FTYPE_NAMES, LLAMACPP_PATH, EngineTruth, PrefixCache, chat_text
from .llamacpp_choices import generate_choices, plans_for, too_many
from .llamacpp_extras import embeddings_route, model_file
from .llamacpp_tokens import (
    BadRequest,
    Vocabulary,
    apply_template_body,
    detokenize_body,
    tokenize_body,
)
from .llamacpp_wire import BUILD, _send, nl_json, timings
from .power import dcgm_metrics, nvml_view
from .tools import ToolCallPlan

#: Context of each slot in the real captures (``-c 16384 -np 4``); ``--ctx-size`` sets it.
N_CTX = 4096
_ALNUM = string.ascii_letters + string.digits


class _Bad(Exception):
    def __init__(self, status: int, body: dict) -> None:
        super().__init__(str(body))
        self.status, self.body = status, body


class LlamaServerSim:
    """ASGI app speaking llama-server's HTTP API over a :class:`SimEngine` (one model)."""

    def __init__(self, engine: SimEngine, n_ctx: int = N_CTX, alias: bool = True) -> None:
        self.engine = engine
        self.n_ctx = n_ctx
        self.alias, self.me = next(iter(engine.models.items()))
        #: the model's GGUF file (its metadata; the simulator has no tensors)
        self.model_path = model_file(self.me.spec, LLAMACPP_PATH)
        if not alias:  # started without -a: the model goes by its file's path
            self.alias = self.model_path
        self.cache = PrefixCache()
        self.vocab = Vocabulary()
        self.slots: list[dict] = [
            {"id": i, "n_ctx": n_ctx, "speculative": False, "is_processing": False}
            for i in range(self.me.max_num_seqs)
        ]
        self.counters = {
            "prompt_tokens_total": 0,
            "prompt_tokens_cached_total": 0,
            "prompt_seconds_total": 0.0,
            "tokens_predicted_total": 0,
            "tokens_predicted_seconds_total": 0.0,
        }

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "lifespan":
            await lifespan(receive, send, self.engine)
            return
        if scope["type"] != "http":
            return
        method, path = scope["method"], scope["path"]
        routes = {
            "/v1/chat/completions": "chat",
            "/chat/completions": "chat",
            "/v1/completions": "cmpl",
            "/completions": "cmpl",
            "/completion": "native",
        }
        if path in routes and method == "POST":
            await self.generate(scope, receive, send, routes[path])
        elif path in ("/v1/embeddings", "/embeddings", "/embedding") and method == "POST":
            await embeddings_route(self, path, receive, send)
        elif path == "/health" and method == "GET":
            await _send(send, 200, b'{"status":"ok"}')
        elif path == "/props" and method == "GET":
            await _send(send, 200, nl_json(self.props()))
        elif path in ("/v1/models", "/models") and method == "GET":
            await _send(send, 200, nl_json(self.models()))
        elif path == "/slots" and method == "GET":
            await _send(send, 200, nl_json(self.slots))
        elif path in ("/tokenize", "/detokenize", "/apply-template") and method == "POST":
            await self.tokenizer(path, receive, send)
        elif path == "/sim/nvml" and method == "GET":  # for the tests' stand-in pynvml
            await _send(send, 200, nvml_view(self.engine), b"application/json")
        elif path == "/metrics" and method == "GET":
            await _send(send, 200, self.metrics().encode(), b"text/plain; version=0.0.4")
        else:
            await _send(
                send,
                404,
                b'{"error":{"message":"File Not Found","type":"not_found_error","code":404}}',
                close=True,
            )

    # --- metadata -------------------------------------------------------------------------

    def props(self) -> dict:
        return {
            "default_generation_settings": {
                "id": 0,
                "n_ctx": self.n_ctx,
                "speculative": False,
                "is_processing": False,
            },
            "total_slots": len(self.slots),
            "model_alias": self.alias,
            "model_ftype": FTYPE_NAMES[self.me.spec.profile.quant],
            "model_path": self.model_path,
            "modalities": {"vision": False, "video": False, "audio": False},
            "endpoint_slots": True,
            "endpoint_props": False,
            "endpoint_metrics": True,
            "chat_template": "{{ messages }}",
            "bos_token": "<bos>",
            "eos_token": "<eos>",
            "build_info": BUILD,
            "is_sleeping": False,
        }

    def models(self) -> dict:
        spec = self.me.spec
        return {
            "models": [
                {
                    "name": self.alias,
                    "model": self.alias,
                    "modified_at": "",
                    "size": "",
                    "digest": "",
                    "type": "model",
                    "description": "",
                    "tags": [""],
                    "capabilities": ["completion"],
                    "parameters": "",
                    "details": {
                        "parent_model": "",
                        "format": "gguf",
                        "family": "",
                        "families": [""],
                        "parameter_size": "",
                        "quantization_level": "",
                    },
                }
            ],
            "object": "list",
            "data": [
                {
                    "id": self.alias,
                    "aliases": [self.alias],
                    "tags": [],
                    "object": "model",
                    "created": self.engine.started,
                    "owned_by": "llamacpp",
                    "meta": {
                        "vocab_type": 2,
                        "n_vocab": 152064,
                        "n_ctx": self.n_ctx,
                        "n_ctx_train": spec.max_model_len,
                        "n_embd": spec.hidden,
                        "n_params": int(spec.params_b * 1e9),
                        "size": int(spec.weight_bytes),
                        "ftype": FTYPE_NAMES[spec.profile.quant],
                    },
                }
            ],
        }

    def metrics(self) -> str:
        c = self.counters
        busy = sum(1 for s in self.slots if s["is_processing"])
        rows = [
            ("prompt_tokens_total", "counter", c["prompt_tokens_total"]),
            ("prompt_tokens_cached_total", "counter", c["prompt_tokens_cached_total"]),
            ("prompt_seconds_total", "counter", c["prompt_seconds_total"]),
            ("tokens_predicted_total", "counter", c["tokens_predicted_total"]),
            ("tokens_predicted_seconds_total", "counter", c["tokens_predicted_seconds_total"]),
            ("requests_processing", "gauge", busy),
            ("requests_deferred", "gauge", self.me.waiting),
        ]
        out = []
        for name, kind, value in rows:
            out += [
                f"# HELP llamacpp:{name} {name}",
                f"# TYPE llamacpp:{name} {kind}",
                f"llamacpp:{name} {value:g}",
            ]
        # the simulated GPUs' power, as a dcgm-exporter beside the engine would serve it
        return "\n".join(out) + "\n" + dcgm_metrics(self.engine)

    async def tokenizer(self, path: str, receive, send) -> None:
        """/tokenize, /detokenize and /apply-template."""
        obj = loads(await read_body(receive))
        try:
            if path == "/tokenize":
                body = tokenize_body(self.vocab, obj)
            elif path == "/detokenize":
                body = detokenize_body(self.vocab, obj)
            else:
                body = apply_template_body(obj, chat_text)
        except BadRequest as exc:
            err = {"error": {"code": 400, "message": str(exc), "type": "invalid_request_error"}}
            await _send(send, 400, nl_json(err), close=True)
            return
        await _send(send, 200, nl_json(body))

    # --- generation -----------------------------------------------------------------------

    def _ident(self, text: str) -> tuple[str, int]:
        if self.engine.deterministic:
            h = hashlib.sha256(text.encode()).digest()
            return "chatcmpl-" + "".join(_ALNUM[b % 62] for b in h[:32]), 1796008928
        h = hashlib.sha256(str(time.time_ns()).encode()).digest()
        return "chatcmpl-" + "".join(_ALNUM[b % 62] for b in h[:32]), int(time.time())

    def _validate(self, obj, kind: str):
        if not isinstance(obj, dict):
            raise _Bad(
                400,
                {
                    "error": {
                        "code": 400,
                        "message": "[json.exception.parse_error.101] parse error: syntax error",
                        "type": "invalid_request_error",
                    }
                },
            )
        if kind == "chat":
            if not isinstance(obj.get("messages"), list):
                raise _Bad(
                    400,
                    {
                        "error": {
                            "code": 400,
                            "message": "'messages' is required",
                            "type": "invalid_request_error",
                        }
                    },
                )
            text = chat_text(obj["messages"])
        else:
            prompt = obj.get("prompt")
            if not isinstance(prompt, str):
                raise _Bad(
                    400,
                    {
                        "error": {
                            "code": 400,
                            "message": '"prompt" must be a string',
                            "type": "invalid_request_error",
                        }
                    },
                )
            text = prompt
        tokens = [2] + tokenize(text)  # <bos>
        if len(tokens) >= self.n_ctx:
            raise _Bad(
                400,
                {
                    "error": {
                        "code": 400,
                        "message": f"request ({len(tokens)} tokens) "
                        f"exceeds the available context size ({self.n_ctx} tokens), try "
                        "increasing it",
                        "type": "exceed_context_size_error",
                        "n_prompt_tokens": len(tokens),
                        "n_ctx": self.n_ctx,
                    }
                },
            )
        limit = (
            obj.get("n_predict")
            if kind == "native"
            else obj.get("max_completion_tokens", obj.get("max_tokens"))
        )
        limit = max(1, limit) if isinstance(limit, int) and limit >= 0 else None
        return text, tokens, limit

    async def generate(self, scope, receive, send, kind: str) -> None:
        t_recv = time.monotonic()
        obj = loads(await read_body(receive))
        try:
            text, tokens, limit = self._validate(obj, kind)
        except _Bad as exc:
            await _send(send, exc.status, nl_json(exc.body), close=True)
            return
        me = self.me
        stream = obj.get("stream") is True
        opts = obj.get("stream_options")
        include_usage = isinstance(opts, dict) and opts.get("include_usage") is True
        plan = plan_output(text, limit, bool(obj.get("ignore_eos")), obj.get("seed"))
        ident, created = self._ident(f"{kind}|{text}|{limit}")
        rid = dict(scope["headers"]).get(b"x-request-id", b"").decode("latin-1") or ident
        prompt_total = len(tokens)
        truth = EngineTruth(
            rid, self.alias, me.spec.profile.name, prompt_total, t_recv=t_recv, gpu=me.gpu_index
        )
        w = _Writer(send, kind, self.alias, ident, created, include_usage, stream)
        plans = plans_for(obj, kind, text, limit, plan)
        if len(plans) > 1 or isinstance(plans[0], ToolCallPlan):
            refused = too_many(len(plans), len(self.slots))
            if refused is not None:
                await _send(send, 400, nl_json(refused), close=True)
                return
            await generate_choices(self, w, truth, plans, tokens, text, stream, receive)
            return
        error_after = obj.get("sim_error_after")
        key = self.engine.next_key()
        slot = None

        async def work() -> None:
            nonlocal slot
            try:
                await me.admit(key, prompt_total)
                slot = next(s for s in self.slots if not s["is_processing"])
                slot.update(
                    is_processing=True,
                    id_task=key,
                    n_prompt_tokens=prompt_total,
                    next_token=[{"has_next_token": True, "n_remain": -1, "n_decoded": 0}],
                )
                admit_ns = time.monotonic_ns()
                truth.t_admit = admit_ns / 1e9
                truth.engine_wait_seconds = truth.t_admit - t_recv
                if stream:  # the slot started: headers go out now, before prefill
                    await w.start()
                cached = self.cache.hit(self.alias, tokens)
                truth.cached_tokens = cached
                prompt_n = prompt_total - cached
                await me.prefill(truth.t_admit, prompt_n, cached)
                prefill_end = time.monotonic_ns()
                prompt_ms = (prefill_end - admit_ns) / 1e6
                truth.prefill_seconds = prompt_ms / 1e3
                me.prompt_tokens_total += prompt_n
                n = len(plan.pieces)
                first_ns = None
                async for i in me.steps(key, prompt_total, n):
                    piece = plan.pieces[i]
                    slot["next_token"][0]["n_decoded"] = i + 1
                    now_ns = time.monotonic_ns()
                    first_ns = first_ns or now_ns
                    truth.completion_tokens = i + 1
                    if error_after is not None and i >= error_after and stream:
                        await w.error("Internal error: simulated failure")
                        truth.aborted = True
                        return
                    eos = plan.finish_reason == "stop" and i == n - 1
                    now = time.monotonic()  # the truth's marks: before the token is written
                    if not eos:
                        await w.token(piece, tokenize(piece or "x")[0], i + 1, prompt_total)
                        if truth.t_first is None:
                            truth.t_first = now
                    truth.t_last = now
                end_ns = time.monotonic_ns()
                t = timings(cached, prompt_n, prompt_ms, n, (end_ns - (first_ns or end_ns)) / 1e6)
                truth.reported = t
                c = self.counters
                c["prompt_tokens_total"] += prompt_n
                c["prompt_tokens_cached_total"] += cached
                c["prompt_seconds_total"] += t["prompt_ms"] / 1e3
                c["tokens_predicted_total"] += n
                c["tokens_predicted_seconds_total"] += t["predicted_ms"] / 1e3
                usage = {
                    "completion_tokens": n,
                    "prompt_tokens": prompt_total,
                    "total_tokens": prompt_total + n,
                    "prompt_tokens_details": {"cached_tokens": cached},
                }
                stop_type = "eos" if plan.finish_reason == "stop" else "limit"
                await w.finish(
                    plan.finish_reason,
                    "".join(plan.pieces),
                    usage,
                    t,
                    {
                        "slot": slot["id"],
                        "prompt": "<bos>" + text,
                        "stop_type": stop_type,
                        "tokens_evaluated": prompt_total,
                        "n": n,
                    },
                )
            finally:
                if slot is not None:
                    slot["is_processing"] = False
                    slot.pop("next_token", None)
                if truth.t_admit is not None:
                    truth.energy_joules = me.release(key)

        await run_request(receive, w.state, me, self.engine, truth, work)


class _Writer:
    """Serialises one llama-server response."""

    def __init__(
        self,
        send,
        kind: str,
        alias: str,
        ident: str,
        created: int,
        include_usage: bool,
        stream: bool,
    ) -> None:
        self.send, self.kind, self.alias = send, kind, alias
        self.ident, self.created = ident, created
        self.include_usage, self.stream = include_usage, stream
        self.state: dict = {"finished": False}
        self.first = True

    async def start(self) -> None:
        await self.send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [
                    (b"access-control-allow-origin", b""),
                    (b"x-accel-buffering", b"no"),
                    (b"content-type", b"text/event-stream"),
                ],
            }
        )

    async def _write(self, data: bytes, more: bool = True) -> None:
        await self.send({"type": "http.response.body", "body": data, "more_body": more})

    def _tail(self, obj: str) -> str:
        return (
            f',"created":{self.created},"id":"{self.ident}","model":{json.dumps(self.alias)},'
            f'"system_fingerprint":"{BUILD}","object":"{obj}"'
        )

    def _chat(self, choice: str, extra: str = "") -> bytes:
        return (
            b'data: {"choices":['
            + choice.encode()
            + b"]"
            + self._tail("chat.completion.chunk").encode()
            + extra.encode()
            + b"}\n\n"
        )

    def _cmpl(self, text: str, finish: str | None, extra_usage: str = "", extra: str = "") -> bytes:
        fr = "null" if finish is None else f'"{finish}"'
        text_json = json.dumps(text, ensure_ascii=False)
        choice = f'{{"text":{text_json},"index":0,"logprobs":null,"finish_reason":{fr}}}'
        model = json.dumps(self.alias)
        return (
            f'data: {{"choices":[{choice}],"created":{self.created},"model":{model},'
            f'"system_fingerprint":"{BUILD}","object":"text_completion"{extra_usage},'
            f'"id":"{self.ident}"{extra}}}\n\n'
        ).encode()

    async def token(self, piece: str, token_id: int, predicted: int, evaluated: int) -> None:
        if not self.stream:
            return
        content = json.dumps(piece, ensure_ascii=False)
        if self.kind == "chat":
            out = b""
            if self.first:
                out = self._chat(
                    '{"finish_reason":null,"index":0,"delta":{"role":"assistant","content":null}}'
                )
            out += self._chat(f'{{"finish_reason":null,"index":0,"delta":{{"content":{content}}}}}')
        elif self.kind == "cmpl":
            out = self._cmpl(piece, None)
        else:
            out = (
                f'data: {{"index":0,"content":{content},"tokens":[{token_id}],"stop":false,'
                f'"id_slot":-1,"tokens_predicted":{predicted},"tokens_evaluated":{evaluated}}}\n\n'
            ).encode()
        self.first = False
        await self._write(out)

    async def error(self, message: str) -> None:
        body = nl_json({"error": {"code": 500, "message": message, "type": "server_error"}})
        self.state["finished"] = True
        await self._write(b"data: " + body + b"\n\n", more=False)

    async def finish(self, reason: str, text: str, usage: dict, t: dict, info: dict) -> None:
        u, tm = nl_json(usage).decode(), nl_json(t).decode()
        if not self.stream:
            if self.kind == "chat":
                body = (
                    f'{{"choices":[{{"finish_reason":"{reason}","index":0,"message":{{"role":'
                    f'"assistant","content":{json.dumps(text, ensure_ascii=False)}}}}}],'
                    f'"created":{self.created},"model":{json.dumps(self.alias)},'
                    f'"system_fingerprint":"{BUILD}","object":"chat.completion","usage":{u},'
                    f'"id":"{self.ident}","timings":{tm}}}'
                )
            elif self.kind == "cmpl":
                body = (
                    f'{{"choices":[{{"text":{json.dumps(text, ensure_ascii=False)},"index":0,'
                    f'"logprobs":null,"finish_reason":"{reason}"}}],"created":{self.created},'
                    f'"model":{json.dumps(self.alias)},"system_fingerprint":"{BUILD}",'
                    f'"object":"text_completion","usage":{u},"id":"{self.ident}","timings":{tm}}}'
                )
            else:
                body = nl_json(self._native_last(text, info, t)).decode()
            self.state["finished"] = True
            await _send(self.send, 200, body.encode())
            return
        if self.kind == "chat":
            fin = f'{{"finish_reason":"{reason}","index":0,"delta":{{}}}}'
            if self.include_usage:
                out = self._chat(fin) + (
                    b'data: {"choices":[]'
                    + self._tail("chat.completion.chunk").encode()
                    + f',"usage":{u},"timings":{tm}}}\n\n'.encode()
                )
            else:
                out = self._chat(fin, f',"timings":{tm}')
            await self._write(out)
            self.state["finished"] = True
            await self._write(b"data: [DONE]\n\n", more=False)
        elif self.kind == "cmpl":
            await self._write(self._cmpl("", reason, f',"usage":{u}', f',"timings":{tm}'))
            self.state["finished"] = True
            await self._write(b"data: [DONE]\n\n", more=False)
        else:
            self.state["finished"] = True
            await self._write(
                b"data: " + nl_json(self._native_last("", info, t)) + b"\n\n", more=False
            )

    def _native_last(self, content: str, info: dict, t: dict) -> dict:
        return {
            "index": 0,
            "content": content,
            "tokens": [],
            "id_slot": info["slot"],
            "stop": True,
            "model": self.alias,
            "tokens_predicted": info["n"],
            "tokens_evaluated": info["tokens_evaluated"],
            "generation_settings": {"n_predict": -1, "stream": self.stream},
            "prompt": info["prompt"],
            "has_new_line": "\n" in content,
            "truncated": False,
            "stop_type": info["stop_type"],
            "stopping_word": "",
            "tokens_cached": info["tokens_evaluated"] + info["n"],
            "timings": t,
        }
