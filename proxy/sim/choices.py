"""Several sequences for one request: ``n`` choices (and, for one choice, a tool call)
on a simulated engine.

Each choice is a sequence of its own, as the engines run them (vLLM fans a request with
``n`` out into child requests; llama-server gives each child a slot): it is admitted on
its own (queueing when the engine is full), decodes in the shared batch one token per
step, and leaves the batch when it is done. The prompt is prefilled once, by the first
choice; the others start decoding when it is ready (llama-server's children wait for the
parent's prompt in the same way). The engine module turns each step into its own bytes
through the callbacks.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from .asgi import watch
from .engine import ModelEngine, Plan, SimEngine, Truth, plan_output
from .tools import offered, plan_call


@dataclass
class Choice:
    index: int
    key: int
    plan: Any  # a text Plan (pieces) or a ToolCallPlan (steps)
    count: int = 0  # tokens produced so far
    admitted: bool = False
    energy: float = 0.0
    first_ns: int | None = None
    end_ns: int | None = None

    @property
    def length(self) -> int:
        steps = getattr(self.plan, "steps", None)
        return len(steps) if steps is not None else len(self.plan.pieces)


def plans(obj: dict, n: int, chat: bool, text: str, max_tokens, first: Plan, dumps) -> list:
    """What each of a request's `n` choices will produce: text, or (chat with ``tools``)
    a tool call with arguments as `dumps` writes them. Choice 0 of a plain request keeps
    the one-choice plan `first`; the others answer differently."""
    tools = offered(obj) if chat else None
    out: list = []
    for j in range(n):
        if tools is not None:
            out.append(plan_call(tools[0], tools[1], text, j, max_tokens, dumps))
        elif j == 0:
            out.append(first)
        else:
            ignore_eos = bool(obj.get("ignore_eos"))
            out.append(plan_output(f"{text}|choice {j}", max_tokens, ignore_eos, obj.get("seed")))
    return out


async def run_choices(
    me: ModelEngine,
    choices: list[Choice],
    prompt_tokens: int,
    cached: int,
    truth: Truth,
    on_token: Callable[[Choice, int], Awaitable[None]],
    on_admit: Callable[[Choice], Awaitable[None]] | None = None,
    on_end: Callable[[Choice], Awaitable[None]] | None = None,
) -> None:
    """Run every choice to its end (or until cancelled, which cancels them all)."""
    prompt_ready = asyncio.Event()

    async def one(c: Choice) -> None:
        try:
            await me.admit(c.key, prompt_tokens)
            c.admitted = True
            if truth.t_admit is None:
                truth.t_admit = time.monotonic()
            if on_admit is not None:
                await on_admit(c)
            if not prompt_ready.is_set() and c is choices[0]:
                start = time.monotonic()
                me.prompt_tokens_total += prompt_tokens - cached
                await me.prefill(start, prompt_tokens - cached, cached)
                truth.prefill_seconds = time.monotonic() - start
                prompt_ready.set()
            await prompt_ready.wait()
            async for i in me.steps(c.key, prompt_tokens, c.length):
                now_ns = time.monotonic_ns()
                c.first_ns = c.first_ns or now_ns
                c.count = i + 1
                truth.completion_tokens += 1
                await on_token(c, i)
            c.end_ns = time.monotonic_ns()
            if on_end is not None:
                await on_end(c)
        finally:
            if c.admitted:
                c.energy = me.release(c.key)
                truth.energy_joules = (truth.energy_joules or 0.0) + c.energy

    tasks = [asyncio.create_task(one(c)) for c in choices]
    try:
        await asyncio.gather(*tasks)
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def run_request(
    receive, state: dict, me: ModelEngine, engine: SimEngine, truth: Truth, work
) -> None:
    """Run one request's `work` (a coroutine function), ended as an abort when the
    client hangs up (the watch cancels it) or the server stops; its truth is written
    either way. Every simulated engine's requests go through here. A `work` that ends
    the answer with an error event marks ``truth.aborted`` itself: it is not a finish."""
    task = asyncio.current_task()
    assert task is not None
    gone = asyncio.Event()
    watcher = asyncio.create_task(watch(receive, task, gone, state))
    try:
        await work()
        if not truth.aborted:
            me.finished_total += 1
    except asyncio.CancelledError:
        task.uncancel()
        truth.aborted = True
        me.aborted_total += 1
    finally:
        watcher.cancel()
        truth.t_end = time.monotonic()
        engine.write_truth(truth)


class SendLock:
    """Serialises the writes of several choices onto one response."""

    def __init__(self, send) -> None:
        self._send, self._lock = send, asyncio.Lock()

    async def __call__(self, message: dict) -> None:
        async with self._lock:
            await self._send(message)
