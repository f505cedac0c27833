"""What the server offers the relay beside ASGI: the answer's
:class:`~proxy.core.client_out.ClientOut` (the ``phasewatch.client_out`` extension,
:class:`CycleOut`); and the older ``phasewatch.write`` (a response's body written in the
caller's own callback) and ``phasewatch.gone`` (a hang-up told by a callback), which
nothing takes any more. Their names: :mod:`proxy.extensions`.

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
from typing import NamedTuple, Protocol

from uvicorn.protocols.http.httptools_impl import RequestResponseCycle

from ..extensions import CLIENT_OUT, GONE, WRITE

#: The cycle's attribute holding the relay's hang-up callback (read by the protocol).
HUNG_UP = "phasewatch_gone"
#: The cycle's attribute holding its :class:`CycleOut` (told by the protocol).
OUT = "phasewatch_out"

#: The hang-up hook's value: ``watch(callback)``; ``watch(None)`` takes it back.
Watch = Callable[[Callable[[], None] | None], None]


class Writer(NamedTuple):
    """The server's synchronous writer (the ``phasewatch.write`` extension's value)."""

    ready: Callable[[], bool]
    put: Callable[..., None]
    write: Callable[[bytes], None] | None = None


class CycleOut:
    """The :class:`~proxy.core.client_out.ClientOut` of one uvicorn cycle: a body write
    goes to the connection's own transport at once, framed as uvicorn frames it (a chunk
    of a chunked answer; raw bytes counted off the cycle's content-length, so that
    uvicorn's last ``send`` finds the length met; nothing for HEAD). The protocol tells
    it the connection's flow (:func:`flowed`, from ``pause_writing``/``resume_writing``)
    and its loss (:func:`hung_up`, from ``connection_lost``)."""

    __slots__ = ("_alive", "_closing", "_flow", "_head", "_lost", "_send", "gone", "paused")

    def __init__(self, cycle: RequestResponseCycle, real: asyncio.Transport) -> None:
        # the cycle's scope holds this object: a strong reference back would make every
        # answer's cycle, scope and headers garbage only the collector could free
        self._alive = weakref.ref(cycle)
        self._send = real.write  # the connection's own, not the facade uvicorn's cycle holds
        self._closing = real.is_closing
        self._head = cycle.scope["method"] == "HEAD"
        self._lost: Callable[[], None] | None = None
        self._flow: Callable[[bool], None] | None = None
        self.gone = False
        self.paused = cycle.flow.write_paused

    def write(self, body: bytes, framed: bytes | None = None) -> None:
        c = self._alive()
        if c is None or not body or self._head or c.disconnected or c.response_complete:
            return
        if not c.response_started:
            raise RuntimeError("a body write before the answer's head")
        if c.chunked_encoding:
            data = framed if framed is not None else b"%x\r\n%b\r\n" % (len(body), body)
        else:
            if len(body) > c.expected_content_length:
                raise RuntimeError("Response content longer than Content-Length")
            c.expected_content_length -= len(body)
            data = body
        if not self._closing():
            self._send(data)

    def watch(
        self,
        lost: Callable[[], None] | None,
        flow: Callable[[bool], None] | None = None,
    ) -> None:
        self._lost, self._flow = lost, flow
        c = self._alive()
        if lost is None or c is None:
            return
        if c.disconnected or self.gone:
            self.hung_up()
            return
        c.flow.resume_reading()  # as uvicorn's receive does: a hang-up is then seen

    def hung_up(self) -> None:
        """The connection is lost: `lost`, if one waits, is called (once)."""
        self.gone = True
        lost = self._lost
        if lost is not None:
            self._lost = self._flow = None
            lost()

    def flowed(self, paused: bool) -> None:
        """The connection's writing paused or resumed: `flow`, if one waits, is told."""
        if paused == self.paused:
            return
        self.paused = paused
        flow = self._flow
        if flow is not None:
            flow(paused)


def flowed(paused: bool, *cycles: RequestResponseCycle | None) -> None:
    """The connection's writing paused (or resumed): each of `cycles`' answers is told."""
    seen = None
    for cycle in cycles:
        out = getattr(cycle, OUT, None) if cycle is not None else None
        if out is not None and out is not seen:
            seen = out
            out.flowed(paused)


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
        out = getattr(cycle, OUT, None)
        if out is not None:
            out.hung_up()
        callback = getattr(cycle, HUNG_UP, None)
        if callback is not None:
            setattr(cycle, HUNG_UP, None)
            callback()


def install(
    cycle: RequestResponseCycle,
    real: asyncio.Transport,
    guard: Closing,
) -> None:
    """Offer the cycle's application its :class:`CycleOut` (and the older writer and
    hang-up hook), as scope extensions."""
    extensions = cycle.scope.setdefault("extensions", {})
    out = CycleOut(cycle, real)
    setattr(cycle, OUT, out)
    extensions[CLIENT_OUT] = out  # type: ignore[assignment]
    extensions[WRITE] = writer(cycle, real, guard)  # type: ignore[assignment]
    extensions[GONE] = watcher(cycle)  # type: ignore[assignment]
