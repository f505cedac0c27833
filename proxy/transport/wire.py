"""What an HTTP/1.1 exchange is on the wire, for the lean transport: a request's bytes, and
what a response's framing says (a chunked body; a read that is exactly one chunk).

:func:`whole_chunk` (``_chunk.c``, built by every install) is asked of every read of a
paced stream: ``whole_chunk(data)`` is the body piece of `data` when `data` is exactly one
chunk of a chunked body, its size in lowercase hex without leading zeros and no extension
(the form a proxy writes itself), else None (the parser takes it).
"""

from __future__ import annotations

from collections.abc import Iterable

from ._chunk import whole_chunk


def chunked_only(headers: list[tuple[bytes, bytes]]) -> bool:
    """Whether the body is chunked and nothing else frames it (one Transfer-Encoding,
    exactly ``chunked``; no Content-Length)."""
    seen = False
    for k, v in headers:
        k = k.lower()
        if k == b"transfer-encoding":
            if seen or v.strip().lower() != b"chunked":
                return False
            seen = True
        elif k == b"content-length":
            return False
    return seen


def request_wire(
    method: str,
    raw_path: bytes,
    fields: Iterable[tuple[bytes, bytes]],
    body: Iterable[bytes | memoryview],
) -> bytes:
    """A request's bytes as they go on the wire: its line, `fields` as given, then the
    pieces of its body."""
    wire: list[bytes | memoryview] = [method.encode(), b" ", raw_path, b" HTTP/1.1\r\n"]
    for k, v in fields:
        wire += [k, b": ", v, b"\r\n"]
    wire.append(b"\r\n")
    wire += body
    return b"".join(wire)


__all__ = ["chunked_only", "request_wire", "whole_chunk"]
