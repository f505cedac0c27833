"""The ``/metrics`` page, rendered off the event loop.

Rendering walks every series of the registry: a big one (many models, every histogram a
series per model) takes long enough that, on the event loop, streams and health checks
would stall for each scrape. The page is rendered on a worker thread instead, and
scrapes that arrive while one is rendered the same way share its result, so a burst of
scrapes costs one rendering, not one thread each.
"""

from __future__ import annotations

import asyncio
import gzip
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any
from urllib.parse import parse_qs

from prometheus_client import CollectorRegistry
from prometheus_client.exposition import choose_encoder, gzip_accepted

Message = MutableMapping[str, Any]
ASGI = Callable[
    [Message, Callable[[], Awaitable[Message]], Callable[[Message], Awaitable[None]]],
    Awaitable[None],
]

#: (content type, sample names asked for, gzip): one rendering of the page.
_Key = tuple[str, tuple[str, ...], bool]


def _header(headers: list[tuple[bytes, bytes]], name: bytes) -> str:
    # latin-1: any bytes decode (a client's header need not be UTF-8)
    return ",".join(v.decode("latin-1") for k, v in headers if k.lower() == name)


def exposition_app(registry: CollectorRegistry) -> ASGI:
    """An ASGI app serving `registry` as prometheus-client's own app does (the format the
    Accept header asks for, ``?name[]=`` to pick samples, gzip when accepted)."""
    rendering: dict[_Key, asyncio.Future[bytes]] = {}

    def render(encoder: Callable[[Any], bytes], names: tuple[str, ...], zipped: bool) -> bytes:
        reg = registry.restricted_registry(list(names)) if names else registry
        output = encoder(reg)
        return gzip.compress(output) if zipped else output

    async def app(
        scope: Message,
        receive: Callable[[], Awaitable[Message]],
        send: Callable[[Message], Awaitable[None]],
    ) -> None:
        headers = scope.get("headers") or []
        params = parse_qs(scope.get("query_string", b"").decode("latin-1"))
        encoder, content_type = choose_encoder(_header(headers, b"accept"))
        zipped = gzip_accepted(_header(headers, b"accept-encoding"))
        key: _Key = (content_type, tuple(params.get("name[]", ())), zipped)
        pending = rendering.get(key)
        if pending is None:
            pending = asyncio.ensure_future(asyncio.to_thread(render, encoder, key[1], zipped))
            rendering[key] = pending
            pending.add_done_callback(lambda _: rendering.pop(key, None))
        # shielded: a scraper that hangs up does not cancel the others' rendering
        output = await asyncio.shield(pending)
        out_headers = [(b"content-type", content_type.encode())]
        if zipped:
            out_headers.append((b"content-encoding", b"gzip"))
        payload = await receive()
        if payload.get("type") == "http.request":
            await send({"type": "http.response.start", "status": 200, "headers": out_headers})
            await send({"type": "http.response.body", "body": output})

    return app
