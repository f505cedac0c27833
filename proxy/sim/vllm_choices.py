"""The simulated vLLM's requests of several sequences: ``n`` choices and tool calls, each
choice a sequence of its own (vLLM fans such a request out into child requests)."""

from __future__ import annotations

import hashlib
import time
import uuid

from .choices import Choice, SendLock, run_choices, run_request
from .tools import ARGS, NAME, ToolCallPlan
from .vllm_wire import quoted, tool_finish


async def generate_choices(sim, receive, writer, me, truth, plans, stream: bool) -> None:
    """``n`` > 1 or a tool call: each choice a sequence of its own, the role events
    for every index at the first output, then each choice's tokens as they come,
    each choice's finish on its last token; usage counts every choice's tokens."""
    writer.send = SendLock(writer.send)
    choices = [Choice(j, sim.engine.next_key(), p) for j, p in enumerate(plans)]
    tool_ids = {
        c.index: "chatcmpl-tool-"
        + (
            hashlib.sha256(f"{writer.ident}|{c.index}".encode()).hexdigest()[:32]
            if sim.engine.deterministic
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
            finish = tool_finish(plan) if last else None
            if stream and (visible or last):
                if not started["roles"]:
                    started["roles"] = True
                    await writer.roles(len(choices))
                if kind == NAME:
                    delta = (
                        '{"tool_calls":[{"id":"' + tool_ids[c.index] + '","type":"function",'
                        f'"index":0,"function":{{"name":{quoted(piece)}}}}}]}}'
                    )
                elif kind == ARGS:
                    delta = (
                        '{"tool_calls":[{"index":0,"function":{"arguments":'
                        + quoted(piece)
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

    await run_request(receive, writer.state, me, sim.engine, truth, work)
