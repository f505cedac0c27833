"""A simulated TensorRT-LLM OpenAI server (``trtllm-serve``), byte-faithful to the wire
shapes in tests/fixtures/wire/trtllm, over the simulator's physics.

One model per server. Chunks are pydantic dumps without their null fields; the finish
reason rides on the last token's chunk; usage only with ``include_usage`` (on every chunk
with ``continuous_usage_stats``). ``/metrics`` is its JSON list of iteration stats, the
Prometheus text is at ``/prometheus/metrics`` (as with ``return_perf_metrics``), with
``trtllm_model_config_info`` naming the model's dtype and quantization. ``/energy_metrics``
answers the simulated GPU's NVML energy with ``--enable-metrics`` (its energy monitor), 503
without.
"""

from __future__ import annotations

import time

from .power import dcgm_metrics
from .sglang import KV_TOKENS, Request, SGLangSim, Stream, chunk_head, respond
from .vllm_wire import dumps, quoted

VERSION = "1.2.0"
TOKENS_PER_BLOCK = 32

#: (dtype, QuantAlgo) of each simulated precision, as ``trtllm_model_config_info`` labels it.
_CONFIG = {
    "bf16": ("bfloat16", "none"),
    "fp8": ("bfloat16", "FP8"),
    "int4": ("float16", "W4A16_AWQ"),
}


class TRTLLMSim(SGLangSim):
    """ASGI app speaking trtllm-serve's HTTP API over a :class:`SimEngine` (one model)."""

    owned_by = "tensorrt_llm"

    def routes(self) -> dict:
        get = {
            "/health": self.health,
            "/health_generate": self.health,
            "/version": self.version,
            "/v1/models": self.models,
            "/metrics": self.iteration_stats,
            "/prometheus/metrics": self.prometheus,
            "/energy_metrics": self.energy,
            "/sim/nvml": self.nvml,
        }
        out = {("GET", p): h for p, h in get.items()}
        out[("POST", "/v1/chat/completions")] = self.chat
        out[("POST", "/v1/completions")] = self.completions
        return out

    async def version(self, scope, receive, send) -> None:
        await respond(send, 200, dumps({"version": VERSION}))

    async def models(self, scope, receive, send) -> None:
        card = {
            "id": self.model_id,
            "object": "model",
            "created": int(self.engine.started),
            "owned_by": self.owned_by,
        }
        await respond(send, 200, dumps({"object": "list", "data": [card]}))

    async def energy(self, scope, receive, send) -> None:
        if not self.enable_metrics:  # no energy monitor
            await respond(send, 503, dumps({"error": "Energy monitoring is not available"}))
            return
        joules = self.me.sensor.read().energy_mj / 1000
        body = {"total_energy_j": round(joules, 4), "query_time": time.perf_counter()}
        await respond(send, 200, dumps(body))

    async def iteration_stats(self, scope, receive, send) -> None:
        me = self.me
        stat = {
            "numActiveRequests": len(me.running),
            "numQueuedRequests": me.waiting,
            "maxNumActiveRequests": me.max_num_seqs,
            "kvCacheStats": {
                "maxNumBlocks": KV_TOKENS // TOKENS_PER_BLOCK,
                "usedNumBlocks": -(-sum(me.running.values()) // TOKENS_PER_BLOCK),
                "tokensPerBlock": TOKENS_PER_BLOCK,
            },
        }
        await respond(send, 200, dumps([stat]))

    def metrics_text(self) -> str:
        me, labels = self.me, f'engine_type="trtllm",model_name="{self.model_id}"'
        used = sum(me.running.values())
        rows = (
            ("trtllm_num_requests_running", "gauge", len(me.running)),
            ("trtllm_num_requests_waiting", "gauge", me.waiting),
            ("trtllm_kv_cache_utilization", "gauge", min(1.0, used / KV_TOKENS)),
            ("trtllm_kv_cache_max_blocks", "gauge", KV_TOKENS // TOKENS_PER_BLOCK),
            ("trtllm_kv_cache_tokens_per_block", "gauge", TOKENS_PER_BLOCK),
            ("trtllm_prompt_tokens_total", "counter", me.prompt_tokens_total),
            ("trtllm_generation_tokens_total", "counter", me.generation_tokens_total),
        )
        lines = []
        for name, kind, value in rows:
            lines.append(f"# TYPE {name} {kind}")
            lines.append(f"{name}{{{labels}}} {float(value)}")
        dtype, quant = _CONFIG.get(me.spec.profile.name, ("bfloat16", "none"))
        lines.append("# TYPE trtllm_model_config_info gauge")
        lines.append(
            f'trtllm_model_config_info{{{labels},model="{self.model_id}",dtype="{dtype}",'
            f'quantization="{quant}"}} 1.0'
        )
        return "\n".join(lines) + "\n" + dcgm_metrics(self.engine)

    async def prometheus(self, scope, receive, send) -> None:
        body = self.metrics_text().encode()
        await respond(send, 200, body, b"text/plain; version=0.0.4; charset=utf-8")

    def error(self, message: str, status: int = 400) -> bytes:
        return dumps(
            {
                "object": "error",
                "message": message,
                "type": "BadRequestError",
                "param": None,
                "code": status,
            }
        )

    def too_long(self, prompt_tokens: int) -> str | None:
        limit = self.me.spec.max_model_len
        if prompt_tokens < limit:
            return None
        return (
            f"The sum of prompt length ({prompt_tokens}) and max_tokens should not exceed "
            f"max_seq_len ({limit})"
        )

    def parse(self, raw: bytes, chat: bool) -> Request | str:
        req = super().parse(raw, chat)
        if isinstance(req, Request) and req.stream and self.too_long(req.prompt_tokens):
            req.stream = False  # checked before the stream starts: a plain 400
        return req

    def writer(self, req: Request):
        return TRTLLMWriter(req, self.engine.deterministic)


class TRTLLMWriter:
    """Serialises one answer as trtllm-serve's pydantic models dump it (nulls left out)."""

    def __init__(self, req: Request, deterministic: bool) -> None:
        self.req = req
        self.stream = Stream(None)
        prefix = "chatcmpl-" if req.chat else "cmpl-"
        self.ident, self.created, self.head = chunk_head(req, deterministic, prefix)

    def bind(self, send) -> TRTLLMWriter:
        self.stream.send = send
        return self

    def usage(self, completion: int) -> str:
        p = self.req.prompt_tokens
        total = p + completion
        return f'{{"prompt_tokens":{p},"total_tokens":{total},"completion_tokens":{completion}}}'

    def _chunk(self, choice: str, completion: int) -> str:
        tail = f',"usage":{self.usage(completion)}' if self.req.continuous else ""
        return self.head + f'"choices":[{choice}]{tail}}}'

    async def token(self, piece: str, count: int, last: bool, finish: str) -> None:
        ev = self.stream.event
        fr = f',"finish_reason":"{finish}"' if last else ""
        if self.req.chat:
            if count == 1:
                role = '{"index":0,"delta":{"role":"assistant","content":""}}'
                await ev(self._chunk(role, 0))
            choice = f'{{"index":0,"delta":{{"content":{quoted(piece)}}}{fr}}}'
        else:
            choice = f'{{"index":0,"text":{quoted(piece)}{fr}}}'
        await ev(self._chunk(choice, count))

    async def end(self, completion: int, finish: str) -> None:
        if self.req.include_usage:
            await self.stream.event(self.head + f'"choices":[],"usage":{self.usage(completion)}}}')
        await self.stream.done()

    async def whole(self, text: str, finish: str, completion: int) -> None:
        if self.req.chat:
            choice = (
                f'{{"index":0,"message":{{"role":"assistant","content":{quoted(text)}}},'
                f'"finish_reason":"{finish}"}}'
            )
            obj = "chat.completion"
        else:
            choice = f'{{"index":0,"text":{quoted(text)},"finish_reason":"{finish}"}}'
            obj = "text_completion"
        body = (
            f'{{"id":"{self.ident}","object":"{obj}","created":{self.created},'
            f'"model":{quoted(self.req.model)},"choices":[{choice}],'
            f'"usage":{self.usage(completion)}}}'
        )
        self.stream.state["finished"] = True
        await respond(self.stream.send, 200, body.encode())
