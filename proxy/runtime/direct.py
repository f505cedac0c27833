"""What the server offers the relay beside ASGI: the ``phasewatch.write`` extension (a
response's body written in the caller's own callback), ``phasewatch.gone`` (a hang-up
told by a callback, without a watcher task: :mod:`proxy.core.answer`). Their names:
:mod:`proxy.extensions`.

Why: a paced stream's event would otherwise cost a task hop to reach the client (the
upstream connection wakes the relay task, which awaits ``send``). The relay can instead
write each event from the upstream connection's callback, through this writer, whenever
nothing waits: it writes only what uvicorn's ``send`` would write at once (a chunk of a
started, chunked, non-HEAD answer to a client that is there and not slow); anything else
goes through ``send``. The answer's state is checked once per read (``ready``), not
again for the write that follows it.
"""

from __future__ import annotations

import asyncio
import weakref
from collections.abc import Callable
from typing import Protocol

from uvicorn.protocols.http.httptools_impl import RequestResponseCycle

from ..core.answer import Watch
from ..core.push import Writer
from ..extensions import GONE, WRITE

#: The cycle's attribute holding the relay's hang-up callback (read by the protocol).
HUNG_UP = "phasewatch_gone"


class Closing(Protocol):
    """What says whether the connection is closing, cheaper than asking through the
    transport uvicorn holds (the guarded protocol's wrapper, a Python call an event)."""

    lingering: bool


def writer(cycle: RequestResponseCycle, real: asyncio.Transport, guard: Closing) -> Writer:
    """The cycle's answer written without waiting: `ready()` says whether a chunk can go
    now (a started, chunked, non-HEAD answer to a client that is there and not slow),
    and `put(body, framed=None)` writes `body` as one chunk, right after a `ready()` that
    said yes (nothing between them can change the answer's state). `framed`, when given,
    is that chunk already framed as this writer frames it (``%x\\r\\n``, the body,
    ``\\r\\n``), and is written as it is. Whether the connection is closing is asked
    of `real` (its own transport) and `guard` (its ``lingering``) directly, rather than
    through the transport the cycle holds."""
    flow = cycle.flow
    send = real.write  # the connection's own, not the facade uvicorn's cycle holds
    is_closing = real.is_closing
    # the cycle's scope holds this writer: a strong reference back would make every
    # answer's cycle, scope and headers garbage only the collector could free
    alive = weakref.ref(cycle)

    def ready() -> bool:
        c = alive()
        return c is not None and not (
            flow.write_paused
            or c.disconnected
            or c.response_complete
            or not c.response_started
            or not c.chunked_encoding
            or guard.lingering
            or is_closing()
        )

    def never() -> bool:
        return False  # a HEAD answer has no body to write

    def put(body: bytes, framed: bytes | None = None) -> None:
        send(framed if framed is not None else b"%x\r\n%b\r\n" % (len(body), body))

    return Writer(never if cycle.scope["method"] == "HEAD" else ready, put, send)


def watcher(cycle: RequestResponseCycle) -> Watch:
    """The cycle's hang-up hook: ``watch(callback)`` keeps `callback` on the cycle, where
    the protocol's ``connection_lost`` finds it (:func:`hung_up`); when the client is gone
    already, it is called at once. Registering resumes a paused read, as uvicorn's
    ``receive`` does for an application waiting on it, so that a hang-up is seen."""
    alive = weakref.ref(cycle)

    def watch(callback: Callable[[], None] | None) -> None:
        c = alive()
        if c is None:
            return
        setattr(c, HUNG_UP, callback)
        if callback is None:
            return
        if c.disconnected:
            hung_up(c)
            return
        c.flow.resume_reading()

    return watch


def hung_up(*cycles: RequestResponseCycle | None) -> None:
    """Each of `cycles` whose client is gone has its hang-up callback, if one waits,
    called (once)."""
    for cycle in cycles:
        if cycle is None or not cycle.disconnected:
            continue
        callback = getattr(cycle, HUNG_UP, None)
        if callback is not None:
            setattr(cycle, HUNG_UP, None)
            callback()


def install(
    cycle: RequestResponseCycle,
    real: asyncio.Transport,
    guard: Closing,
) -> None:
    """Offer the cycle's application the writer and the hang-up hook, as scope
    extensions."""
    extensions = cycle.scope.setdefault("extensions", {})
    extensions[WRITE] = writer(cycle, real, guard)  # type: ignore[assignment]
    extensions[GONE] = watcher(cycle)  # type: ignore[assignment]
