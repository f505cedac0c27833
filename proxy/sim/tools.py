"""Tool calls for the simulated engines: when a chat request offers ``tools`` (and
``tool_choice`` is not ``"none"``, and the last message is not already a tool's result),
the simulated model calls one, the way a tool-calling model does through each engine.

The model "writes" its call token by token: an opening tag, the function name, the
arguments in JSON fragments, a closing tag and EOS. What a client sees of those tokens is
each engine's business (:mod:`.vllm`, :mod:`.llamacpp`, :mod:`.ollama`): vLLM and
llama-server stream ``delta.tool_calls`` (a header with id and name, then argument
fragments), Ollama sends the whole call once it is complete. Every token counts in the
usage, the silent ones too. The arguments are made from the tool's JSON schema (its
required properties, else all of them), deterministic for a given prompt.
"""

from __future__ import annotations

import hashlib
import json
import random
import re
from dataclasses import dataclass, field

#: Values the simulated model fills string arguments with.
_WORDS = ("Paris", "Tokyo", "Lisbon", "Oslo", "Nairobi", "Lima", "Hanoi", "Quebec")
#: One JSON token (with the whitespace before it): what a model emits per step.
_JSON_TOKEN = re.compile(r'\s*(?:"(?:[^"\\]|\\.)*"|[{}\[\],:]|[^\s{}\[\],:"]+)')

OPEN, NAME, ARGS, CLOSE, EOS = "open", "name", "args", "close", "eos"


@dataclass
class ToolCallPlan:
    """One call: which function, its arguments, and the tokens that write it."""

    name: str
    arguments: dict
    arguments_json: str  # as the engine serialises them
    steps: list[tuple[str, str]] = field(default_factory=list)  # (kind, text) per token
    finish_reason: str = "stop"  # "length" when max_tokens cut the call short
    forced: bool = False  # the request named the function (tool_choice)

    @property
    def fragments(self) -> list[str]:
        return [text for kind, text in self.steps if kind == ARGS]


def offered(obj: dict) -> tuple[list[dict], str | None] | None:
    """The function tools a chat request offers and the one it forces, or None when the
    model should answer in text."""
    tools = obj.get("tools")
    if not isinstance(tools, list):
        return None
    funcs = [
        t["function"]
        for t in tools
        if isinstance(t, dict)
        and isinstance(t.get("function"), dict)
        and isinstance(t["function"].get("name"), str)
    ]
    choice = obj.get("tool_choice")
    if not funcs or choice == "none":
        return None
    messages = obj.get("messages")
    if isinstance(messages, list) and messages:
        last = messages[-1]
        if isinstance(last, dict) and last.get("role") == "tool":
            return None  # the tool answered: the model replies in text
    forced = None
    if isinstance(choice, dict) and isinstance(choice.get("function"), dict):
        forced = choice["function"].get("name")
    return funcs, forced if isinstance(forced, str) else None


def _value(schema, rng: random.Random):
    kind = schema.get("type") if isinstance(schema, dict) else None
    if isinstance(kind, list):
        kind = next((k for k in kind if k != "null"), None)
    if isinstance(schema, dict) and isinstance(schema.get("enum"), list) and schema["enum"]:
        return schema["enum"][0]
    if kind == "integer":
        return rng.randint(1, 9)
    if kind == "number":
        return rng.randint(10, 99) / 10
    if kind == "boolean":
        return True
    if kind == "array":
        return []
    if kind == "object":
        return {}
    return rng.choice(_WORDS)


def plan_call(
    funcs: list[dict],
    forced: str | None,
    seed_text: str,
    index: int,
    max_tokens: int | None,
    dumps,
) -> ToolCallPlan:
    """The call choice `index` makes; `dumps` serialises the arguments as the engine does."""
    rng = random.Random(hashlib.sha256(f"tool|{index}|{seed_text}".encode()).digest())
    func = next((f for f in funcs if f["name"] == forced), None) or funcs[rng.randrange(len(funcs))]
    given = func.get("parameters")
    params: dict = given if isinstance(given, dict) else {}
    listed = params.get("properties")
    props: dict = listed if isinstance(listed, dict) else {}
    required = params.get("required")
    names = [n for n in required if n in props] if isinstance(required, list) else list(props)
    arguments = {n: _value(props[n], rng) for n in names}
    text = dumps(arguments)
    frags = _JSON_TOKEN.findall(text)
    if "".join(frags) != text:  # never expected: keep the call whole rather than wrong
        frags = [text]
    steps = [(OPEN, "<tool_call>"), (NAME, func["name"])]
    steps += [(ARGS, f) for f in frags]
    steps += [(CLOSE, "</tool_call>"), (EOS, "")]
    plan = ToolCallPlan(func["name"], arguments, text, steps, forced=forced is not None)
    if max_tokens is not None and max_tokens < len(steps):
        plan.steps, plan.finish_reason = steps[:max_tokens], "length"
    return plan


def vllm_dumps(arguments: dict) -> str:
    """vLLM's tool parsers write arguments with Python's json.dumps defaults."""
    return json.dumps(arguments, ensure_ascii=False)


def compact_dumps(arguments: dict) -> str:
    """llama-server (nlohmann) and Ollama (Go) write them compact."""
    return json.dumps(arguments, ensure_ascii=False, separators=(",", ":"))
