"""Model listings through a proxy with several upstreams: the union of their models.

With one upstream every path is passed through untouched. With several, a client asking
a model list (OpenAI's ``GET /v1/models``, or an engine's own such as Ollama's
``GET /api/tags``) must see every model it can reach through the proxy, so the proxy asks
each upstream whose engine serves that list and merges the answers as the engine's
:class:`~proxy.engines.base.Listing` says: entries as each engine wrote them, a model
named twice kept once. A list on an engine's own API is asked of that engine's upstreams
only: its clients speak that API, which the other engines do not serve
(:meth:`~proxy.fleet.upstreams.Upstreams.route_native` answers such a request with the
engine's own "not found").
"""

from __future__ import annotations

import asyncio
import json
from typing import TYPE_CHECKING

import httpx

from ..engines import LISTINGS
from ..engines.probe import get_json
from .asgi import Send

if TYPE_CHECKING:
    from ..fleet.upstream import Upstream
    from ..fleet.upstreams import Upstreams

UNION_PATHS = frozenset(LISTINGS)


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
    listing = LISTINGS[path]
    ups = upstreams.all
    asked = [u for u in ups if path in u.dialect.model_lists]
    answers = await asyncio.gather(*(_get(u, listing.ask) for u in asked))
    if listing.native:  # none of its engine's upstreams: an empty list
        if asked and all(a is None for a in answers) and not any(u.up for u in ups):
            return None
    elif all(a is None for a in answers):
        return None
    merged: list = []
    seen: set = set()
    for a in answers:
        for item in (a.get(listing.items) if isinstance(a, dict) else None) or []:
            key = item.get(listing.key) if isinstance(item, dict) else None
            if key not in seen:
                seen.add(key)
                merged.append(item)
    return json.dumps(
        {**dict(listing.head), listing.items: merged}, ensure_ascii=False, separators=(",", ":")
    ).encode()


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
