"""The proxy's own calls to an engine (detection, model lists, state scrapes), bounded.

Off the request path. A broken or hostile engine must not make the proxy hold an
unbounded answer in memory, so every read stops at :data:`MAX_PROBE_BYTES`.
"""

from __future__ import annotations

import json
from typing import Any

import httpx

PROBE_TIMEOUT = 5.0
#: Most bytes read from one answer to the proxy's own probes and scrapes.
MAX_PROBE_BYTES = 8 * 1024 * 1024


class TooLarge(ValueError):
    """An engine's answer to a probe was longer than MAX_PROBE_BYTES."""


async def read_bounded(
    client: httpx.AsyncClient,
    method: str,
    path: str,
    body: Any = None,
    limit: int = MAX_PROBE_BYTES,
) -> tuple[int, bytes]:
    """(status, body) of a probe, reading at most `limit` bytes (TooLarge beyond).

    `path` is relative to the upstream's base URL (``/v1/models`` on an upstream
    ``http://host/tenant-a`` asks for ``/tenant-a/v1/models``)."""
    async with client.stream(method, path, json=body, timeout=PROBE_TIMEOUT) as resp:
        chunks, size = [], 0
        async for chunk in resp.aiter_bytes():
            size += len(chunk)
            if size > limit:
                raise TooLarge(f"{path} answered more than {limit} bytes")
            chunks.append(chunk)
        return resp.status_code, b"".join(chunks)


async def get_json(
    client: httpx.AsyncClient, method: str, path: str, body: Any = None
) -> tuple[int, Any]:
    """(status, parsed JSON or None); raises httpx.HTTPError when nothing answers."""
    try:
        status, raw = await read_bounded(client, method, path, body)
    except TooLarge:
        return 200, None
    try:
        return status, json.loads(raw)
    except (ValueError, RecursionError):
        return status, None


class Prober:
    """Answers to detection probes, each path asked once per detection round (several
    engines' checks look at the same ``/v1/models``)."""

    def __init__(self, client: httpx.AsyncClient) -> None:
        self.client = client
        self._answers: dict[str, tuple[int, Any]] = {}

    async def get(self, path: str) -> tuple[int, Any]:
        """(status, JSON or None) of ``GET path``; raises httpx.HTTPError when the
        upstream does not answer at all."""
        if path not in self._answers:
            self._answers[path] = await get_json(self.client, "GET", path)
        return self._answers[path]

    async def get_dict(self, path: str) -> dict | None:
        """The JSON object a ``GET path`` answered with 200, else None."""
        status, obj = await self.get(path)
        return obj if status == 200 and isinstance(obj, dict) else None
