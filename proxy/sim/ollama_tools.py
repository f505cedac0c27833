"""Tool calls on the simulated Ollama.

Ollama's tool parser holds the model's tokens back while they spell a call and sends the
call whole once it is complete: on the native API one chunk whose ``message`` has
``"content":""`` and ``tool_calls`` of ``{"id":"call_xxxxxxxx","function":{"index":0,
"name":…,"arguments":{…}}}`` (arguments an object), ``done_reason`` staying ``stop``;
through ``/v1`` one chunk whose delta carries ``tool_calls`` of ``{"id","index","type":
"function","function":{"name","arguments":"<JSON text>"}}`` and a finish reason of
``tool_calls``. A non-streamed answer gathers the calls into its message. Ollama has no
``n``: one choice, whatever the request asks.
"""

from __future__ import annotations

import hashlib
import random
import string
import time

from .tools import ToolCallPlan, compact_dumps, offered, plan_call

_ID_CHARS = string.ascii_lowercase + string.digits


def plan_for(obj: dict, kind: str, text: str, max_tokens) -> ToolCallPlan | None:
    if kind not in ("chat", "v1chat"):
        return None
    tools = offered(obj)
    if tools is None:
        return None
    return plan_call(tools[0], tools[1], text, 0, max_tokens, compact_dumps)


def call_id(deterministic: bool, seed: str) -> str:
    """``call_`` and eight lower-case letters or digits, as Ollama names a call."""
    basis = seed if deterministic else f"{seed}|{time.time_ns()}"
    rng = random.Random(hashlib.sha256(basis.encode()).digest())
    return "call_" + "".join(rng.choice(_ID_CHARS) for _ in range(8))


def native_calls(plan: ToolCallPlan, ident: str) -> list[dict]:
    return [{"id": ident, "function": {"index": 0, "name": plan.name, "arguments": plan.arguments}}]


def v1_calls(plan: ToolCallPlan, ident: str) -> list[dict]:
    return [
        {
            "id": ident,
            "index": 0,
            "type": "function",
            "function": {"name": plan.name, "arguments": compact_dumps(plan.arguments)},
        }
    ]
