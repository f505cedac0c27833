"""The wire guards' own pieces, apart from the connection that applies them
(:mod:`proxy.runtime.http1`): the answers a refused connection gets, and which stalled
stream goes when there are too many.

A refusal's answer is whole bytes, written by the connection itself in the refused
request's turn: it never reaches the application, and it always closes the connection
(nothing after a refused request can be trusted to be framed as the client meant).
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping
from typing import TypeVar

from ..core.errors import json_error

#: Fewer bytes than the shortest request (``GET / HTTP/1.1`` and an empty line is 18):
#: a slice of 16 * n bytes completes at most n request heads.
SHORTEST = 16

Conn = TypeVar("Conn", bound=Hashable)


def refusal(status: int, reason: bytes, message: str, kind: str) -> bytes:
    """A whole answer of the proxy's own (OpenAI's error shape) that closes the
    connection."""
    body = json_error(status, message, kind)
    return b"".join(
        [
            b"HTTP/1.1 %d %s\r\n" % (status, reason),
            b"content-type: application/json\r\n",
            b"content-length: %d\r\n" % len(body),
            b"connection: close\r\n\r\n",
            body,
        ]
    )


def head_too_large(max_head_bytes: int, trailers: bool) -> bytes:
    what = "request trailers" if trailers else "request head"
    return refusal(
        431,
        b"Request Header Fields Too Large",
        f"{what} over {max_head_bytes} bytes",
        "request_header_too_large",
    )


def too_many_fields(max_header_fields: int) -> bytes:
    return refusal(
        431,
        b"Request Header Fields Too Large",
        f"request head with more than {max_header_fields} header fields (--max-header-fields)",
        "request_header_too_large",
    )


def bad_version() -> bytes:
    return refusal(
        505,
        b"HTTP Version Not Supported",
        "only HTTP/1.1 and HTTP/1.0 requests are served",
        "http_version_not_supported",
    )


def head_timeout(header_timeout: float) -> bytes:
    return refusal(
        408,
        b"Request Timeout",
        f"request head not complete within {header_timeout:g}s",
        "request_timeout",
    )


def bad_body() -> bytes:
    return refusal(400, b"Bad Request", "malformed request body", "invalid_request_error")


def pipeline_full(max_pipelined_requests: int) -> bytes:
    return refusal(
        429,
        b"Too Many Requests",
        f"more than {max_pipelined_requests} pipelined requests on one connection",
        "too_many_pipelined_requests",
    )


def parser_error(msg: str, default_headers: list[tuple[bytes, bytes]]) -> bytes:
    """The 400 for a request the parser rejects (uvicorn's words, which clients and
    tests know): plain text, the server's default headers, the connection closed."""
    body = msg.encode("ascii")
    return b"".join(
        [
            b"HTTP/1.1 400 Bad Request\r\n",
            *(n + b": " + v + b"\r\n" for n, v in default_headers),
            b"content-type: text/plain; charset=utf-8\r\n",
            b"content-length: %d\r\n" % len(body),
            b"connection: close\r\n\r\n",
            body,
        ]
    )


def most_held(stalled: Mapping[Conn, str]) -> Conn:
    """Of the stalled connections (each mapped to its owner, in the order they
    stalled): the longest-stalled one of the owner holding the most (of owners holding
    as many, the one stalled longest). Why per owner: one client's stalled streams must
    not get another's closed."""
    counts: dict[str, int] = {}
    for owner in stalled.values():
        counts[owner] = counts.get(owner, 0) + 1
    most = max(counts.values())
    return next(c for c, owner in stalled.items() if counts[owner] == most)


def peer(client: tuple[str, int] | None) -> str:
    """A client's address for a log line (its own values: never wire bytes)."""
    return f"{client[0]}:{client[1]}" if client else "unknown"
