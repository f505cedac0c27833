"""How the simulated vLLM's answers are written, byte for byte as vLLM 0.32 writes them:
JSON dumps, error bodies, the streamed and whole answers; shared by :mod:`.vllm` and
:mod:`.vllm_choices`."""

from __future__ import annotations

import json

from .tools import ToolCallPlan


def dumps(obj) -> bytes:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode()


def quoted(text: str) -> str:
    return json.dumps(text, ensure_ascii=False)


def error_body(status: int, message: str, kind: str, param: str | None) -> bytes:
    return dumps({"error": {"message": message, "type": kind, "param": param, "code": status}})


class Writer:
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
            f'"created":{created},"model":{quoted(model)},'
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
                    f'{{"index":{index},"delta":{{"content":{quoted(piece)}}},"logprobs":null,'
                    '"finish_reason":null,"token_ids":null}'
                )
            else:
                choice = (
                    f'{{"index":{index},"delta":{{"content":{quoted(piece)}}},"logprobs":null,'
                    f'"finish_reason":"{finish}","stop_reason":null,"token_ids":null}}'
                )
        else:
            fr = "null" if finish is None else f'"{finish}"'
            choice = (
                f'{{"index":{index},"text":{quoted(piece)},"logprobs":null,"finish_reason":{fr},'
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
                finish = tool_finish(plan)
                call = (
                    f'{{"id":"{tool_id}","type":"function","function":{{"name":{quoted(plan.name)},'
                    f'"arguments":{quoted("".join(plan.fragments))}}}}}'
                )
                message = (
                    '{"role":"assistant","content":null,"refusal":null,"annotations":null,'
                    f'"audio":null,"function_call":null,"tool_calls":[{call}],"reasoning":null}}'
                )
            else:
                finish, text = plan.finish_reason, "".join(plan.pieces)
                message = (
                    f'{{"role":"assistant","content":{quoted(text)},"refusal":null,'
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
                    f'{{"index":{index},"text":{quoted("".join(plan.pieces))},"logprobs":null,'
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
            f'"created":{self.created},"model":{quoted(self.model)},"choices":[{",".join(parts)}],'
            f'"service_tier":null,"system_fingerprint":"{self.fingerprint}",{usage},'
        )
        tail = (
            '"prompt_logprobs":null,"prompt_token_ids":null,"prompt_text":null,'
            '"kv_transfer_params":null,"ec_transfer_params":null,"metrics":null}'
            if self.chat
            else '"kv_transfer_params":null,"ec_transfer_params":null,"metrics":null}'
        )
        self.state["finished"] = True
        await json_response(self.send, 200, (head + tail).encode())

    async def whole(self, text: str, finish: str, completion: int) -> None:
        usage = (
            f'"usage":{{"prompt_tokens":{self.prompt_tokens},"total_tokens":'
            f'{self.prompt_tokens + completion},"completion_tokens":{completion},'
            '"prompt_tokens_details":null,"completion_tokens_details":null}'
        )
        if self.chat:
            body = (
                f'{{"id":"{self.ident}","object":"chat.completion","created":{self.created},'
                f'"model":{quoted(self.model)},"choices":[{{"index":0,"message":{{"role":"assistant",'
                f'"content":{quoted(text)},"refusal":null,"annotations":null,"audio":null,'
                f'"function_call":null,"reasoning":null}},"logprobs":null,"finish_reason":"{finish}",'
                f'"stop_reason":null,"token_ids":null,"routed_experts":null}}],"service_tier":null,'
                f'"system_fingerprint":"{self.fingerprint}",{usage},"prompt_logprobs":null,'
                '"prompt_token_ids":null,"prompt_text":null,"kv_transfer_params":null,'
                '"ec_transfer_params":null,"metrics":null}'
            )
        else:
            body = (
                f'{{"id":"{self.ident}","object":"text_completion","created":{self.created},'
                f'"model":{quoted(self.model)},"choices":[{{"index":0,"text":{quoted(text)},"logprobs":null,'
                f'"finish_reason":"{finish}","stop_reason":null,"token_ids":null,'
                '"prompt_logprobs":null,"prompt_token_ids":null,"routed_experts":null}],'
                f'"service_tier":null,"system_fingerprint":"{self.fingerprint}",{usage},'
                '"kv_transfer_params":null,"ec_transfer_params":null,"metrics":null}'
            )
        self.state["finished"] = True
        await json_response(self.send, 200, body.encode())


def tool_finish(plan: ToolCallPlan) -> str:
    """vLLM's finish reason for a call: ``tool_calls`` when the model chose to call (auto
    or required), the plain ``stop`` when the request named the function."""
    if plan.finish_reason == "stop" and not plan.forced:
        return "tool_calls"
    return plan.finish_reason


async def json_response(send, status: int, body: bytes, extra=None) -> None:
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
