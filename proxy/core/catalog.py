"""Model listings through a proxy with several upstreams: the union of their models.

With one upstream every path is passed through untouched. With several, a client asking
``GET /v1/models`` (or Ollama's ``GET /api/tags`` / ``/api/ps``) must see every model it
can reach through the proxy, so the proxy asks each upstream and merges the lists:
OpenAI-style ``data`` entries as each engine wrote them, and Ollama-style ``models``
entries from the Ollama upstreams only: an Ollama client speaks Ollama's own API, which
the other engines do not serve (:meth:`~proxy.core.upstreams.Upstreams.route_native`
answers such a request with Ollama's own "not found").
"""

from __future__ import annotations

import asyncio
import json
from typing import TYPE_CHECKING

import httpx

from ..engines.probe import get_json
from .asgi import Send

if TYPE_CHECKING:
    from .upstreams import Upstream, Upstreams

UNION_PATHS = frozenset({"/v1/models", "/models", "/api/tags", "/api/ps"})


def model_in_path(path: str) -> str | None:
    """The model named by a ``/v1/models/{model}`` path (routed to the upstream serving it)."""
    for prefix in ("/v1/models/", "/models/"):
        if path.startswith(prefix) and len(path) > len(prefix):
            return path[len(prefix) :]
    return None


async def _get(u: Upstream, path: str) -> object:
    """The upstream's JSON answer (read at most MAX_PROBE_BYTES), or None."""
    try:
        status, obj = await get_json(u.client, "GET", path)
    except httpx.HTTPError:
        return None
    return obj if status == 200 else None


async def union(upstreams: Upstreams, path: str) -> bytes | None:
    """The merged listing for `path`, or None when no upstream answered."""
    ups = upstreams.all
    if path in ("/v1/models", "/models"):
        answers = await asyncio.gather(*(_get(u, "/v1/models") for u in ups))
        if all(a is None for a in answers):
            return None
        data: list = []
        seen: set = set()
        for a in answers:
            items = a.get("data") if isinstance(a, dict) else None
            for item in items or []:
                key = item.get("id") if isinstance(item, dict) else None
                if key not in seen:
                    seen.add(key)
                    data.append(item)
        return json.dumps(
            {"object": "list", "data": data}, ensure_ascii=False, separators=(",", ":")
        ).encode()
    # Ollama's /api/tags and /api/ps
    ollama = [u for u in ups if u.engine == "ollama"]
    answers = await asyncio.gather(*(_get(u, path) for u in ollama))
    if ollama and all(a is None for a in answers) and not any(u.up for u in ups):
        return None
    models: list = []
    seen = set()
    for a in answers:
        for item in (a.get("models") if isinstance(a, dict) else None) or []:
            key = item.get("name") if isinstance(item, dict) else None
            if key not in seen:
                seen.add(key)
                models.append(item)
    return json.dumps({"models": models}, ensure_ascii=False, separators=(",", ":")).encode()


async def send_union(send: Send, upstreams: Upstreams, path: str) -> None:
    body = await union(upstreams, path)
    status, ctype = 200, b"application/json; charset=utf-8"
    if body is None:
        status = 502
        body = json.dumps(
            {
                "error": {
                    "message": "no upstream answered its model list",
                    "type": "connect",
                    "param": None,
                    "code": 502,
                }
            }
        ).encode()
        ctype = b"application/json"
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [(b"content-type", ctype), (b"content-length", str(len(body)).encode())],
        }
    )
    await send({"type": "http.response.body", "body": body})
