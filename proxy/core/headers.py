"""Which headers cross the proxy, and the request id."""

from __future__ import annotations

from collections.abc import Iterable
from random import getrandbits

Headers = list[tuple[bytes, bytes]]

#: RFC 9110 §7.6.1 connection-specific fields: they describe one hop, never forwarded.
HOP_BY_HOP = frozenset(
    {
        b"connection",
        b"keep-alive",
        b"proxy-connection",
        b"te",
        b"trailer",
        b"transfer-encoding",
        b"upgrade",
        b"proxy-authorization",
        b"proxy-authenticate",
    }
)
#: Sent upstream in place of the client's Accept-Encoding when phasewatch asked the engine
#: for usage the client did not: an encoded answer could not be stripped on its bytes.
IDENTITY = (b"accept-encoding", b"identity")
#: The proxy sets the framing and the host itself on the upstream side.
_REQUEST_DROP = HOP_BY_HOP | {b"host", b"content-length"}


def via(instance: str) -> tuple[bytes, bytes]:
    """The ``Via`` field this proxy adds to each request it sends upstream (RFC 9110
    §7.6.3: an intermediary names itself there, a pseudonym allowed): ``1.1
    phasewatch-<instance>``. The one header the proxy adds of its own, and why: a request
    that comes back with it (an upstream that leads back to this proxy, through others or
    not) is a loop, cut on arrival (:func:`looped`) instead of fanning out until every
    connection is spent."""
    return b"via", b"1.1 phasewatch-" + instance.encode("ascii")


def looped(scope_headers: Iterable[tuple[bytes, bytes]], mine: bytes) -> bool:
    """Whether a request's ``Via`` fields name this proxy (`mine`: its :func:`via` value):
    it was sent by this proxy and came back."""
    for k, v in scope_headers:
        if k == b"via" and mine in v:
            for hop in v.split(b","):
                if hop.strip() == mine:
                    return True
    return False


def _connection_tokens(headers: Iterable[tuple[bytes, bytes]]) -> set[bytes]:
    tokens: set[bytes] = set()
    for k, v in headers:
        if k.lower() == b"connection":
            tokens.update(t.strip().lower() for t in v.split(b","))
    return tokens


def request_headers(scope_headers: Iterable[tuple[bytes, bytes]]) -> Headers:
    """The client's end-to-end headers. A client's x-request-id passes through; the proxy
    adds none of its own, because engines adopt it (vLLM builds its response ids from it)
    and the client must see what a direct request would have given."""
    scope_headers = list(scope_headers)
    drop = _REQUEST_DROP | _connection_tokens(scope_headers)
    return [(k, v) for k, v in scope_headers if k not in drop]


def response_headers(raw: Iterable[tuple[bytes, bytes]]) -> Headers:
    """The engine's end-to-end response headers (names lower-cased for ASGI)."""
    raw = list(raw)
    drop = HOP_BY_HOP | _connection_tokens(raw)
    return [(k.lower(), v) for k, v in raw if k.lower() not in drop]


def request_id(scope_headers: Iterable[tuple[bytes, bytes]]) -> str:
    """The client's x-request-id (logged), or a fresh one for the log line alone."""
    for k, v in scope_headers:
        if k == b"x-request-id":
            text = v.decode("latin-1")
            if 0 < len(text) <= 128 and text.isprintable():
                return text
    # 128 random bits in uuid4().hex's form, without its system call and object: the id
    # only joins a log line to its metrics' exemplars (the generator is reseeded per
    # process, workers included)
    return f"{getrandbits(128):032x}"


def encoded(raw_headers: Iterable[tuple[bytes, bytes]]) -> bool:
    """Whether a body has a content coding (it cannot be tapped on bytes then)."""
    for k, v in raw_headers:
        if k.lower() == b"content-encoding" and v.strip().lower() not in (b"", b"identity"):
            return True
    return False


def without(headers: Headers, *names: bytes) -> Headers:
    """`headers` less the fields named (lower-case names)."""
    return [h for h in headers if h[0] not in names]


def content_length(headers: list[tuple[bytes, bytes]]) -> int | None:
    """A request body's length, when its head gives one (a parser has checked it)."""
    length = None
    for name, value in headers:
        if name == b"transfer-encoding":
            return None
        if name == b"content-length":
            try:
                length = int(value)
            except ValueError:
                return None
    return length
