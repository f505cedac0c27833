"""``n`` choices and tool calls on the simulated llama-server.

llama-server runs ``n`` (its ``n_cmpl``) as a parent task and ``n - 1`` children, each on
a slot of its own (more than the slots is refused with a 400, "Field 'n': Value must be
between 1 <= value <= SLOTS"); the children share the parent's processed prompt, so their
``timings`` repeat its prompt figures. Each choice's results stream under its
``index``: the role event with its first token, then one event per token, and its own
finish event (its usage event with ``include_usage``, ``timings`` on the last), then one
``[DONE]`` after every choice. Not streamed, the choices are merged into the first
result: its ``usage`` and ``timings`` are choice 0's alone, as the real server answers.

Tool calls (chat with ``tools``, ``--jinja`` being the default) stream as
``delta.tool_calls``: the first carries the call's ``id`` (32 letters and digits),
``type`` and ``name`` with ``"arguments":""``, the next ones argument fragments of the
compact JSON; the finish reason is ``tool_calls``; a whole message has ``content`` null
and ``tool_calls`` of ``type``, ``function`` and ``id``.
"""

from __future__ import annotations

import hashlib
import json
import string
import time

from .choices import Choice, SendLock, plans, run_choices, run_request
from .engine import tokenize
from .llamacpp_wire import BUILD, _send, nl_json, timings
from .tools import ARGS, NAME, ToolCallPlan, compact_dumps

_ALNUM = string.ascii_letters + string.digits


def _s(text: str) -> str:
    return json.dumps(text, ensure_ascii=False)


def too_many(n: int, slots: int) -> dict | None:
    """The real server's answer to more choices than slots (worded as the real build of
    the test tier answers it), or None."""
    if n > slots:
        return {
            "error": {
                "code": 400,
                "message": f"Field 'n': Value must be between 1 <= value <= {slots}, but got {n}",
                "type": "invalid_request_error",
            }
        }
    return None


def plans_for(obj: dict, kind: str, text: str, limit, first) -> list:
    """The choices' plans; llama-server takes ``n_cmpl`` or ``n``."""
    n = obj.get("n_cmpl", obj.get("n", 1))
    n = n if isinstance(n, int) and not isinstance(n, bool) and n >= 1 else 1
    return plans(obj, n, kind == "chat", text, limit, first, compact_dumps)


def _call_id(deterministic: bool, seed: str) -> str:
    if deterministic:
        h = hashlib.sha256(seed.encode()).digest()
        return "".join(_ALNUM[b % 62] for b in h[:32])
    h = hashlib.sha256(f"{seed}|{time.time_ns()}".encode()).digest()
    return "".join(_ALNUM[b % 62] for b in h[:32])


async def generate_choices(sim, w, truth, plans, tokens, text, stream: bool, receive) -> None:
    """Run the choices of one request on `sim` (a LlamaServerSim), writing through `w`."""
    me = sim.me
    prompt_total = len(tokens)
    w.send = SendLock(w.send)
    choices = [Choice(j, sim.engine.next_key(), p) for j, p in enumerate(plans)]
    call_ids = {
        c.index: _call_id(sim.engine.deterministic, f"{w.ident}|{c.index}") for c in choices
    }
    slots: dict[int, dict] = {}
    started: dict = {"headers": False, "prompt_ms": 0.0, "cached": 0, "admit_ns": 0}
    finals: dict[int, tuple] = {}

    async def on_admit(c: Choice) -> None:
        slot = next(s for s in sim.slots if not s["is_processing"])
        slot.update(
            is_processing=True,
            id_task=c.key,
            n_prompt_tokens=prompt_total,
            next_token=[{"has_next_token": True, "n_remain": -1, "n_decoded": 0}],
        )
        slots[c.index] = slot
        if c.index == 0:
            started["admit_ns"] = time.monotonic_ns()
            truth.engine_wait_seconds = started["admit_ns"] / 1e9 - truth.t_recv
            started["cached"] = sim.cache.hit(sim.alias, tokens)
            truth.cached_tokens = started["cached"]
        if stream and not started["headers"]:  # the first slot started: headers go out
            started["headers"] = True
            await w.start()

    async def on_token(c: Choice, i: int) -> None:
        if c.index == 0 and i == 0:
            started["prompt_ms"] = truth.prefill_seconds * 1e3
        slots[c.index]["next_token"][0]["n_decoded"] = i + 1
        now = time.monotonic()  # the truth's marks: before the token is written
        plan = c.plan
        out = b""
        first = i == 0
        visible = False
        if isinstance(plan, ToolCallPlan):
            kind, piece = plan.steps[i]
            if kind == NAME:
                delta = (
                    f'{{"tool_calls":[{{"index":0,"id":"{call_ids[c.index]}","type":"function",'
                    f'"function":{{"name":{_s(piece)},"arguments":""}}}}]}}'
                )
            elif kind == ARGS:
                delta = f'{{"tool_calls":[{{"index":0,"function":{{"arguments":{_s(piece)}}}}}]}}'
            else:
                delta = None
            visible = delta is not None
            if stream:
                if first:
                    out += w._chat(
                        f'{{"finish_reason":null,"index":{c.index},"delta":'
                        '{"role":"assistant","content":null}}'
                    )
                if delta is not None:
                    out += w._chat(f'{{"finish_reason":null,"index":{c.index},"delta":{delta}}}')
        else:
            piece = plan.pieces[i]
            eos = plan.finish_reason == "stop" and i == c.length - 1
            visible = not eos
            if stream and not eos:
                out = token_bytes(w, c.index, piece, first, i + 1, prompt_total)
        if out:
            await w._write(out)
        if visible and truth.t_first is None:
            truth.t_first = now
        truth.t_last = now

    async def on_end(c: Choice) -> None:
        plan = c.plan
        predicted_ms = ((c.end_ns or 0) - (c.first_ns or c.end_ns or 0)) / 1e6
        cached = started["cached"]
        t = timings(cached, prompt_total - cached, started["prompt_ms"], c.count, predicted_ms)
        usage = {
            "completion_tokens": c.count,
            "prompt_tokens": prompt_total,
            "total_tokens": prompt_total + c.count,
            "prompt_tokens_details": {"cached_tokens": cached},
        }
        if isinstance(plan, ToolCallPlan):
            reason = "tool_calls" if plan.finish_reason == "stop" else "length"
        else:
            reason = plan.finish_reason
        finals[c.index] = (reason, usage, t)
        c_ = sim.counters
        c_["tokens_predicted_total"] += c.count
        c_["tokens_predicted_seconds_total"] += t["predicted_ms"] / 1e3
        if c.index == 0:
            c_["prompt_tokens_total"] += prompt_total - cached
            c_["prompt_tokens_cached_total"] += cached
            c_["prompt_seconds_total"] += t["prompt_ms"] / 1e3
            truth.reported = t
        if stream:
            await w._write(final_bytes(w, c.index, reason, usage, t))
        slot = slots.pop(c.index, None)
        if slot is not None:
            slot["is_processing"] = False
            slot.pop("next_token", None)

    async def work() -> None:
        await run_choices(
            me, choices, prompt_total, 0, truth, on_token, on_admit=on_admit, on_end=on_end
        )
        if stream:
            w.state["finished"] = True
            await w._write(b"" if w.kind == "native" else b"data: [DONE]\n\n", more=False)
        else:
            body = whole_body(w, choices, finals, call_ids, text)
            w.state["finished"] = True
            await _send(w.send, 200, nl_json(body))

    try:
        await run_request(receive, w.state, me, sim.engine, truth, work)
    finally:
        for slot in slots.values():  # the slots of choices cut short
            slot["is_processing"] = False
            slot.pop("next_token", None)


def token_bytes(w, index: int, piece: str, first: bool, predicted: int, evaluated: int) -> bytes:
    """One text token of choice `index`, as the one-choice writer sends it for choice 0."""
    content = _s(piece)
    if w.kind == "chat":
        out = b""
        if first:
            out = w._chat(
                f'{{"finish_reason":null,"index":{index},"delta":{{"role":"assistant","content":null}}}}'
            )
        return out + w._chat(
            f'{{"finish_reason":null,"index":{index},"delta":{{"content":{content}}}}}'
        )
    if w.kind == "cmpl":
        return w._cmpl(piece, None).replace(b'"index":0,', f'"index":{index},'.encode(), 1)
    token_id = tokenize(piece or "x")[0]
    return (
        f'data: {{"index":{index},"content":{content},"tokens":[{token_id}],"stop":false,'
        f'"id_slot":-1,"tokens_predicted":{predicted},"tokens_evaluated":{evaluated}}}\n\n'
    ).encode()


def final_bytes(w, index: int, reason: str, usage: dict, t: dict) -> bytes:
    """Choice `index`'s finish: its finish event, its usage event, ``timings`` on the last."""
    u, tm = nl_json(usage).decode(), nl_json(t).decode()
    if w.kind == "chat":
        fin = f'{{"finish_reason":"{reason}","index":{index},"delta":{{}}}}'
        if w.include_usage:
            return w._chat(fin) + (
                b'data: {"choices":[]'
                + w._tail("chat.completion.chunk").encode()
                + f',"usage":{u},"timings":{tm}}}\n\n'.encode()
            )
        return w._chat(fin, f',"timings":{tm}')
    if w.kind == "cmpl":
        return w._cmpl("", reason, f',"usage":{u}', f',"timings":{tm}').replace(
            b'"index":0,', f'"index":{index},'.encode(), 1
        )
    info = {
        "slot": index,
        "prompt": "",
        "stop_type": "eos" if reason == "stop" else "limit",
        "tokens_evaluated": usage["prompt_tokens"],
        "n": usage["completion_tokens"],
    }
    last = w._native_last("", info, t)
    last["index"] = index
    return b"data: " + nl_json(last) + b"\n\n"


def whole_body(w, choices: list[Choice], finals: dict, call_ids: dict, text: str):
    """The non-streamed answer: OAI results merged into choice 0's; native ones a list."""
    results = []
    for c in choices:
        reason, usage, t = finals[c.index]
        plan = c.plan
        if w.kind == "chat":
            if isinstance(plan, ToolCallPlan):
                call = {
                    "type": "function",
                    "function": {"name": plan.name, "arguments": "".join(plan.fragments)},
                    "id": call_ids[c.index],
                }
                message = {"role": "assistant", "content": None, "tool_calls": [call]}
            else:
                message = {"role": "assistant", "content": "".join(plan.pieces)}
            choice = {"finish_reason": reason, "index": c.index, "message": message}
            obj = "chat.completion"
        elif w.kind == "cmpl":
            choice = {
                "text": "".join(plan.pieces),
                "index": c.index,
                "logprobs": None,
                "finish_reason": reason,
            }
            obj = "text_completion"
        else:
            stop_type = "eos" if plan.finish_reason == "stop" else "limit"
            results.append(
                {
                    "index": c.index,
                    "content": "".join(plan.pieces),
                    "tokens": [],
                    "id_slot": c.index,
                    "stop": True,
                    "model": w.alias,
                    "tokens_predicted": c.count,
                    "tokens_evaluated": usage["prompt_tokens"],
                    "generation_settings": {"n_predict": -1, "stream": False},
                    "prompt": "<bos>" + text,
                    "has_new_line": "\n" in "".join(plan.pieces),
                    "truncated": False,
                    "stop_type": stop_type,
                    "stopping_word": "",
                    "tokens_cached": usage["prompt_tokens"] + c.count,
                    "timings": t,
                }
            )
            continue
        results.append(
            {
                "choices": [choice],
                "created": w.created,
                "model": w.alias,
                "system_fingerprint": BUILD,
                "object": obj,
                "usage": usage,
                "id": w.ident,
                "timings": t,
            }
        )
    if w.kind == "native":
        return results if len(results) > 1 else results[0]
    merged = results[0]
    for r in results[1:]:
        merged["choices"].append(r["choices"][0])
    return merged
