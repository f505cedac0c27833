"""A response's body written in the caller's own callback: the ``phasewatch.write``
ASGI extension.

Why: a paced stream's event would otherwise cost a task hop to reach the client (the
upstream connection wakes the relay task, which awaits ``send``). The relay can instead
write each event from the upstream connection's callback, through this writer, whenever
nothing waits: it writes only what uvicorn's ``send`` would write at once (a chunk of a
started, chunked, non-HEAD answer to a client that is there and not slow), and returns
False, having written nothing, for anything else, which then goes through ``send``.
"""

from __future__ import annotations

from collections.abc import Callable

from uvicorn.protocols.http.httptools_impl import RequestResponseCycle

from ..core.push import WRITE


def writer(cycle: RequestResponseCycle) -> Callable[..., bool]:
    """`write(body, framed=None)`: the body as one chunk of the cycle's answer, when it
    can go now without waiting (True; an empty body writes nothing and says whether one
    could). `framed`, when given, is that chunk already framed as this writer frames it
    (``%x\\r\\n``, the body, ``\\r\\n``), and is written as it is."""
    flow, transport = cycle.flow, cycle.transport
    head = cycle.scope["method"] == "HEAD"

    def write(body: bytes, framed: bytes | None = None) -> bool:
        if (
            head
            or flow.write_paused
            or cycle.disconnected
            or cycle.response_complete
            or not cycle.response_started
            or not cycle.chunked_encoding
            or transport.is_closing()
        ):
            return False
        if framed is not None:
            transport.write(framed)
        elif body:
            transport.write(b"%x\r\n%b\r\n" % (len(body), body))
        return True

    return write


def install(cycle: RequestResponseCycle) -> None:
    """Offer the cycle's application the writer, as a scope extension."""
    cycle.scope.setdefault("extensions", {})[WRITE] = writer(cycle)  # type: ignore[assignment]
