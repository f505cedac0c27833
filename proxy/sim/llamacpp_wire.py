"""What the simulated llama-server's answers are made of: its build name, nlohmann's JSON
dump, the ``timings`` object and a plain response; shared by :mod:`.llamacpp` and
:mod:`.llamacpp_choices`."""

from __future__ import annotations

import json

BUILD = "b6250-e92734d5"


def nl_json(obj) -> bytes:
    """nlohmann::json dump(-1): compact, raw UTF-8, insertion order."""
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode()


def timings(
    cache_n: int, prompt_n: int, prompt_ms: float, predicted_n: int, predicted_ms: float
) -> dict:
    prompt_ms, predicted_ms = round(prompt_ms, 3), round(predicted_ms, 3)
    p_tok = prompt_ms / prompt_n if prompt_n else 0.0
    g_tok = predicted_ms / max(1, predicted_n - 1)
    return {
        "cache_n": cache_n,
        "prompt_n": prompt_n,
        "prompt_ms": prompt_ms,
        "prompt_per_token_ms": p_tok,
        "prompt_per_second": 1e3 / p_tok if p_tok else 0.0,
        "predicted_n": predicted_n,
        "predicted_ms": predicted_ms,
        "predicted_per_token_ms": g_tok,
        "predicted_per_second": 1e3 / g_tok if g_tok and predicted_n >= 2 else 0.0,
    }


async def _send(
    send,
    status: int,
    body: bytes,
    ctype: bytes = b"application/json; charset=utf-8",
    close: bool = False,
) -> None:
    headers = [
        (b"access-control-allow-origin", b""),
        (b"content-type", ctype),
        (b"content-length", str(len(body)).encode()),
    ]
    if close:
        headers.append((b"connection", b"close"))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
