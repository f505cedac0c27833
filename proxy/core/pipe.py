"""A relayed body's one path: upstream read → (decode) → tap → client write, in the
upstream connection's own callback, for every body the relay forwards (a measured
stream, a coded one, a whole body kept for its usage, a passthrough body).

Why one path: a read then costs no task hop (the connection would wake the relay task,
which would await ``send``), and there is no second path to hand reads over to and
keep in order. The relay task only awaits :meth:`Pipe.run`, the body's end, and does the
ending itself.

Backpressure: while the client reads slower than its answer comes (the
:class:`~.client_out.ClientOut`'s ``flow``), the upstream connection's reading is paused
(its read deadline with it), and resumed when the client catches up; so is it while a
coded read is still being decoded (:meth:`Pipe.step`). What a read lets through is
written at once: the server buffers at most what arrived before the pause took hold.

A reader that raises ends the body with its exception (the connection is closed), which
:meth:`Pipe.run` raises where the relay awaits it, as httpx's own errors are.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import httpx

from ..engines import Tap
from ..engines.sse import SSETap
from ..extensions import RELAY
from ..transport.connection import Hold, Read
from .client_out import ClientOut
from .coding import Decoded

#: `flow(paused)` goes to this while the body runs (:class:`~.answer.Reply` routes it).
Flow = Callable[[bool], None]


class Pipe:
    """One response body relayed (see the module). Make one, give :meth:`run` the
    reader of its kind (:meth:`stream`, :meth:`kept`, :meth:`decoded`)."""

    __slots__ = (
        "_busy",
        "_client",
        "_done",
        "_ended",
        "_held",
        "_hold",
        "_kept",
        "_loop",
        "_size",
        "out",
        "resp",
    )

    def __init__(self, resp: httpx.Response, out: ClientOut) -> None:
        self.resp, self.out = resp, out
        self._loop = asyncio.get_running_loop()
        self._done: asyncio.Future[None] = self._loop.create_future()
        self._hold: Hold | None = None
        self._held = False  # reading paused (by us)
        self._client = out.paused  # the client reads slowly
        self._busy = False  # a coded read is still being decoded
        self._ended: tuple[Exception | None] | None = None  # the end, while busy
        self._kept: list[bytes] = []
        self._size = 0

    async def run(self, read: Read) -> None:
        """Relay the body through `read` until it ends; raise why it broke."""
        relay = self.resp.extensions.get(RELAY)
        if relay is None:
            raise RuntimeError(
                "the relay reads a body through its transport's phasewatch.relay "
                "extension (the lean transport's)"
            )
        self.resp.is_stream_consumed = True  # (its stream is closed by the relay)
        self._hold = relay(read, self._end)
        self._apply()
        await self._done

    def flow(self, paused: bool) -> None:
        """The client's flow (ClientOut.watch's `flow`): reading follows it."""
        self._client = paused
        self._apply()

    def _apply(self) -> None:
        held = self._client or self._busy or self._done.done()
        if held != self._held and self._hold is not None:
            self._held = held
            self._hold(held)

    def _end(self, error: Exception | None) -> None:
        if self._busy:
            self._ended = (error,)  # said once the read being decoded is done
            return
        self._finish(error)

    def _finish(self, error: Exception | None) -> None:
        done = self._done
        if done.done():
            return
        if error is None:
            done.set_result(None)
        else:
            done.set_exception(error)
        self._apply()  # nothing more is read

    # --- the readers ----------------------------------------------------------------------

    def stream(self, tap: Tap) -> Read:
        """A measured stream: each read through the tap, what it lets through written.
        A read that is one plain token event, and came as exactly one chunk, is counted
        by the tap's shortcut (``SSETap.token_read``) and written with the chunk's own
        framing: the paced stream's common case, one Python call into the tap."""
        feed, write, monotonic = tap.feed, self.out.write, time.monotonic
        token = tap.token_read if isinstance(tap, SSETap) else None

        if token is None:

            def read(chunk: bytes, framed: bytes | None) -> None:
                out = feed(chunk, monotonic())
                if out:
                    write(out, framed if out is chunk else None)

            return read

        def read_paced(chunk: bytes, framed: bytes | None) -> None:
            now = monotonic()
            if framed is not None and token(chunk, now):
                write(chunk, framed)
                return
            out = feed(chunk, now)
            if out:
                write(out, framed if out is chunk else None)

        return read_paced

    def kept(self, keep: int) -> Read:
        """A body forwarded as it came, its first `keep` bytes (and the read that
        crosses that) kept for :meth:`body`."""
        write, kept = self.out.write, self._kept

        def read(chunk: bytes, framed: bytes | None) -> None:
            if self._size < keep:
                kept.append(chunk)
                self._size += len(chunk)
            write(chunk, framed)

        return read

    def body(self) -> bytes:
        """What :meth:`kept` kept."""
        return b"".join(self._kept)

    def decoded(self, decoded: Decoded) -> Read:
        """A coded stream, measured on its decoded copy: the engine's bytes forwarded as
        they came once their read is decoded (`decoded.exact`), or the decoded stream's
        pieces as the tap lets them through, until the decoded cap (then the body ends
        here, whole as far as the relay is concerned, and `decoded.over` says why).
        A read is decoded a bounded slice per callback: while more of it is pending,
        reading is paused and the next slice runs from the loop (``call_soon``), so a
        bomb neither stalls the loop nor sits in memory decoded."""
        write = self.out.write

        def read(chunk: bytes, framed: bytes | None) -> None:
            if self._done.done():
                return  # ended at the decoded cap: the rest is not relayed
            decoded.take(chunk)
            self._busy = True
            self._step(decoded, chunk, framed, write)

        return read

    def _step(
        self,
        decoded: Decoded,
        chunk: bytes,
        framed: bytes | None,
        write: Callable[[bytes, bytes | None], None],
    ) -> None:
        """Decode the next slice of the pending read; again from the loop while more
        of it is pending."""
        if self._done.done():
            return
        try:
            outs, more = decoded.step(time.monotonic())
            if not decoded.exact:
                for out in outs:
                    write(out, None)
            if more:
                self._apply()
                self._loop.call_soon(self._step, decoded, chunk, framed, write)
                return
            if decoded.exact:
                write(chunk, framed)
        except Exception as exc:  # noqa: BLE001 - raised where the relay awaits
            self._busy = False
            self._finish(exc)
            return
        self._busy = False
        if not decoded.exact and decoded.over:
            self._finish(None)  # the client's stream ends here (the relay says why)
            return
        ended, self._ended = self._ended, None
        if ended is not None:
            self._finish(ended[0])
        else:
            self._apply()
