"""One streamed chat completion, timed client-side: TTFT at the first event carrying
content, decode tok/s = (completion_tokens - 1) / (last - first content event)."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass

import httpx

from .traffic import Own


class BenchError(Exception):
    pass


@dataclass
class Shot:
    """Client-side figures of one streamed request."""

    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    content_events: int = 0
    ttft_s: float | None = None
    total_s: float = 0.0
    decode_s: float | None = None
    decode_tok_s: float | None = None
    t_start: float = 0.0
    t_end: float = 0.0


def _has_output(obj: dict) -> bool:
    for choice in obj.get("choices") or ():
        if not isinstance(choice, dict):
            continue
        if choice.get("text"):
            return True
        delta = choice.get("delta") or {}
        if isinstance(delta, dict) and (
            delta.get("content")
            or delta.get("reasoning_content")
            or delta.get("reasoning")
            or delta.get("tool_calls")
        ):
            return True
    return False


class Client:
    """Streams chat completions and times them."""

    def __init__(self, url: str, api_key: str | None, timeout: float, ignore_eos: bool) -> None:
        base = url.rstrip("/")
        self.base = base[:-3] if base.endswith("/v1") else base
        headers = {"authorization": f"Bearer {api_key}"} if api_key else {}
        self.http = httpx.AsyncClient(
            base_url=self.base,
            headers=headers,
            timeout=httpx.Timeout(timeout, connect=10.0),
            limits=httpx.Limits(max_connections=256),
        )
        self.ignore_eos = ignore_eos
        self.own = Own()  # what the bench itself sent (to tell other traffic apart)

    async def aclose(self) -> None:
        await self.http.aclose()

    def body(self, model: str, prompt: str, max_tokens: int, stream: bool = True) -> dict:
        body = {
            "model": model,
            "messages": [{"role": "user", "content": prompt}],
            "max_tokens": max_tokens,
            "temperature": 0.0,
            "stream": stream,
        }
        if stream:
            body["stream_options"] = {"include_usage": True}
        if self.ignore_eos and max_tokens > 1:
            body["ignore_eos"] = True
        return body

    async def shot(self, model: str, prompt: str, max_tokens: int) -> Shot:
        self.own.start(max_tokens)
        try:
            return await self._shot(model, prompt, max_tokens)
        finally:
            self.own.end()

    async def _shot(self, model: str, prompt: str, max_tokens: int) -> Shot:
        s = Shot()
        s.t_start = t0 = time.perf_counter()
        t_last = None
        async with self.http.stream(
            "POST", "/v1/chat/completions", json=self.body(model, prompt, max_tokens)
        ) as resp:
            if resp.status_code != 200:
                text = (await resp.aread()).decode(errors="replace")[:500]
                raise BenchError(f"{model}: HTTP {resp.status_code}: {text}")
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue
                payload = line[5:].strip()
                if payload == "[DONE]":
                    continue  # read to the end: a hang-up here would count as an abort
                now = time.perf_counter()
                try:
                    obj = json.loads(payload)
                except ValueError:
                    continue
                if not isinstance(obj, dict):
                    continue
                if "error" in obj:
                    raise BenchError(f"{model}: error in stream: {obj['error']}")
                if _has_output(obj):
                    if s.ttft_s is None:
                        s.ttft_s = now - t0
                        first = now
                    t_last = now
                    s.content_events += 1
                usage = obj.get("usage")
                if isinstance(usage, dict):
                    s.prompt_tokens = usage.get("prompt_tokens", s.prompt_tokens)
                    s.completion_tokens = usage.get("completion_tokens", s.completion_tokens)
        s.t_end = time.perf_counter()
        s.total_s = s.t_end - t0
        if s.ttft_s is None:
            raise BenchError(f"{model}: the response carried no content")
        n = s.completion_tokens if s.completion_tokens is not None else s.content_events
        if n >= 2 and t_last is not None and t_last > first:
            s.decode_s = t_last - first
            s.decode_tok_s = (n - 1) / s.decode_s
        return s

    async def usage_prompt_tokens(self, model: str, prompt: str) -> int | None:
        self.own.start(1)
        try:
            resp = await self.http.post(
                "/v1/chat/completions", json=self.body(model, prompt, 1, stream=False)
            )
        finally:
            self.own.end()
        if resp.status_code != 200:
            raise BenchError(f"{model}: HTTP {resp.status_code}: {resp.text[:500]}")
        usage = resp.json().get("usage") or {}
        return usage.get("prompt_tokens")
