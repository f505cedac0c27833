"""Errors the proxy answers itself, in the shape clients parse."""

from __future__ import annotations

import json
from collections.abc import Callable

from .asgi import Send

#: (status, message, kind) -> (content type, body): an engine's own error shape for a
#: path (Ollama's native API: ``{"error":"..."}``).
ErrorShape = Callable[[int, str, str], tuple[bytes, bytes]]


class UpstreamFailure(Exception):
    """The upstream could not be reached or did not answer: the client gets `status`."""

    def __init__(self, status: int, kind: str, message: str, unsent: bool = False) -> None:
        super().__init__(message)
        self.status, self.kind, self.message = status, kind, message
        #: No byte of the request reached the engine: it may go to another replica.
        self.unsent = unsent


def json_error(status: int, message: str, kind: str) -> bytes:
    """An OpenAI-style error body, as every OpenAI SDK parses it."""
    return json.dumps(
        {"error": {"message": message, "type": kind, "param": None, "code": status}}
    ).encode()


async def send_error(
    send: Send,
    status: int,
    message: str,
    kind: str,
    extra_headers: list[tuple[bytes, bytes]] | None = None,
    shape: ErrorShape | None = None,
) -> None:
    """Answer with an error: OpenAI's shape unless `shape` gives the engine's own."""
    ctype, body = (
        shape(status, message, kind)
        if shape
        else (b"application/json", json_error(status, message, kind))
    )
    headers = [(b"content-type", ctype), (b"content-length", str(len(body)).encode())] + (
        extra_headers or []
    )
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body, "more_body": False})


def describe(exc: BaseException, limit: int = 200) -> str:
    """A short text for an exception (its message, else its type)."""
    text = str(exc) or type(exc).__name__
    return text[:limit]
