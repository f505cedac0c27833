"""Small ASGI helpers every simulated engine shares: the body, JSON, hang-ups, lifespan."""

from __future__ import annotations

import asyncio
import json


async def read_body(receive) -> bytes:
    chunks = []
    while True:
        msg = await receive()
        if msg["type"] == "http.disconnect":
            return b""
        chunks.append(msg.get("body", b""))
        if not msg.get("more_body"):
            return b"".join(chunks)


def loads(raw: bytes):
    try:
        return json.loads(raw)
    except (ValueError, UnicodeDecodeError, RecursionError):
        return None


async def watch(receive, task: asyncio.Task, gone: asyncio.Event, state: dict) -> None:
    """Cancel the generating task when the client hangs up before the end."""
    while True:
        msg = await receive()
        if msg["type"] == "http.disconnect":
            if state.get("finished"):
                return
            gone.set()
            task.cancel()
            return


async def lifespan(receive, send, engine) -> None:
    """Answer the server's lifespan messages; close the engine (its truth log) at the end."""
    while True:
        try:
            msg = await receive()
        except asyncio.CancelledError:  # a forced quit: close quietly
            engine.close()
            return
        if msg["type"] == "lifespan.startup":
            await send({"type": "lifespan.startup.complete"})
        elif msg["type"] == "lifespan.shutdown":
            engine.close()
            await send({"type": "lifespan.shutdown.complete"})
            return
