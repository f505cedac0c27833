"""The answer to one client: what goes back to it (:class:`Reply`, the client watched
while it waits), and how an engine's response becomes it (:class:`Responder`).

A client that hangs up cancels its exchange at once (which closes the upstream connection,
so the engine stops generating), unless its answer is already complete: the last message
of an answer goes out through :meth:`Reply.end` or :meth:`Reply.error`, which mark it
finished first, so a client that leaves after that has had its whole answer. The hang-up
is seen one way: the answer's :class:`~.client_out.ClientOut` (the server's
:data:`~proxy.extensions.CLIENT_OUT` extension) calls back when the connection is lost.

The response head goes out as the engine sent it (less what the proxy may change: a
length the proxy's stripping would falsify, a coding it decoded), through ASGI ``send``.
Its body takes one path whatever it is (:mod:`.pipe`): each upstream read goes through
the engine's tap (a stream; a coded one on its decoded copy) or as it is (a whole body,
kept bounded to read its usage at the end), straight to the client, in the upstream
connection's callback. The relay task awaits the body's end and ends the answer: a
stream the engine cut off, or ended without its terminator, is closed with an error
event in its own framing, so no client takes a cut answer as whole. What the finished
answer said (usage, the engine's timings, errors) is read at the end.
"""

from __future__ import annotations

import asyncio
import logging
import time
from types import TracebackType

import httpx

from ..engines import Tap
from ..transport.connection import Read
from .asgi import Send
from .client_out import ClientOut
from .coding import Decoded, codings, decodable, decode_whole, stacked
from .errors import ErrorShape, describe, send_error
from .exchange import Exchange
from .headers import Headers, response_headers, without
from .limited import LimitedLog
from .pipe import Flow, Pipe
from .relay_options import RelayOptions


class Reply:
    """What goes back to one client: its ASGI `send` and, where the server offers it, its
    :class:`~.client_out.ClientOut` `out` (the body's writes, the client's flow and
    hang-up); the headers every error of the proxy's own carries (`echo`: x-request-id
    with --echo-request-id), whether the last message went, and whether the client left
    before it."""

    __slots__ = ("_hooked", "_task", "disconnected", "echo", "finished", "flow", "out", "send")

    def __init__(
        self,
        send: Send,
        echo: Headers | None = None,
        out: ClientOut | None = None,
    ) -> None:
        self.send = send
        self.out = out
        self.echo: Headers = echo or []
        self.finished = False
        self.disconnected = False
        #: Told the client's flow while a body is relayed (:class:`~.pipe.Pipe`).
        self.flow: Flow | None = None
        self._hooked = False
        self._task: asyncio.Task[None] | None = None

    async def end(self, body: bytes = b"") -> None:
        """The answer's last body message (the final send)."""
        self.finished = True
        await self.send({"type": "http.response.body", "body": body, "more_body": False})

    async def error(
        self,
        status: int,
        message: str,
        kind: str,
        headers: Headers | None = None,
        shape: ErrorShape | None = None,
    ) -> None:
        """The whole answer is an error of the proxy's own (OpenAI's shape unless `shape`
        gives the engine's for the path); `headers`, then the echo, go with it."""
        self.finished = True
        await send_error(self.send, status, message, kind, [*(headers or ()), *self.echo], shape)

    def watching(self) -> _Watching:
        """Watch the client for the block's duration: when it hangs up before the answer
        is finished, the current task is cancelled; that cancellation ends the block
        quietly and leaves `disconnected` set."""
        return _Watching(self)

    def unwatch(self) -> None:
        """Stop watching (from here on, a client that leaves cancels nothing)."""
        if self._hooked:
            self._hooked = False
            assert self.out is not None
            self.out.watch(None, None)

    def _hung_up(self) -> None:
        """The server says the client's connection is lost (ClientOut's `lost`)."""
        self._hooked = False
        if not self.finished and self._task is not None:
            self.disconnected = True
            self._task.cancel()

    def _flowed(self, paused: bool) -> None:
        """The client's flow changed (ClientOut's `flow`): the body relayed follows it."""
        flow = self.flow
        if flow is not None:
            flow(paused)


class _Watching:
    __slots__ = ("reply",)

    def __init__(self, reply: Reply) -> None:
        self.reply = reply

    async def __aenter__(self) -> Reply:
        reply = self.reply
        if reply.out is None:
            raise RuntimeError(
                "the relay runs under a server that offers its answers' ClientOut "
                "(the phasewatch.client_out scope extension): phasewatch's own"
            )
        reply._task = asyncio.current_task()
        assert reply._task is not None
        reply._hooked = True
        reply.out.watch(reply._hung_up, reply._flowed)
        return reply

    async def __aexit__(
        self,
        kind: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> bool:
        reply = self.reply
        reply.unwatch()
        if kind is not None and issubclass(kind, asyncio.CancelledError) and reply.disconnected:
            assert reply._task is not None
            reply._task.uncancel()
            return True  # the client left: not an error of ours
        return False


#: Largest non-streamed measured response kept for reading its usage.
MAX_KEPT_BODY = 16 * 1024 * 1024


class Responder:
    """Relays measured responses (see the module's docstring)."""

    def __init__(self, log: logging.Logger, limited_log: LimitedLog, options: RelayOptions) -> None:
        self.log = log
        self.limited_log = limited_log
        self.max_event_bytes = options.max_event_bytes
        self.max_decoded_bytes = options.max_decoded_bytes
        self.echo_request_id = options.echo_request_id

    async def respond(self, reply: Reply, resp: httpx.Response, ex: Exchange) -> None:
        """Forward the response head, then its body (tapped when it is a stream)."""
        ex.status = resp.status_code
        ex.marks.t_headers = time.monotonic()
        applied = codings(resp.headers.raw)
        tap, decoded = self._tap(ex, resp, applied)
        headers = self._head(reply, resp, tap, decoded)
        await reply.send({"type": "http.response.start", "status": ex.status, "headers": headers})
        source: Tap | Decoded | None = decoded or tap
        # the engine's coded bytes pass as they are: nothing of the proxy's may follow them
        sealed = decoded is not None and decoded.exact
        assert reply.out is not None  # (watched: Reply.watching)
        pipe = Pipe(resp, reply.out)
        try:
            if tap is None or source is None:
                # a body phasewatch cannot decode is not kept: nothing in it is readable
                keep = MAX_KEPT_BODY if not applied or decodable(applied) else 0
                await relay(reply, pipe, pipe.kept(keep), ex)
                kept: bytes | None = pipe.body()
                tail = b""
            else:
                await relay(
                    reply, pipe, pipe.stream(tap) if decoded is None else pipe.decoded(decoded), ex
                )
                tail = source.end(time.monotonic())
                if not sealed:
                    tail += self._unterminated(ex, tap)
                kept = None
        except httpx.HTTPError as exc:
            # a stream's tap ends it on an event boundary; a stream that had reached its
            # end before the connection broke is a whole answer
            tail = source.end(time.monotonic()) if source is not None else b""
            if tap is None or not (tap.done or tap.error_payload is not None):
                await self._cut(reply, ex, exc, tap, sealed, tail)
                return
            kept = None
        finally:
            if tap is not None and tap.oversized:
                self._oversized(ex, tap.oversized)
        await reply.end(tail)
        if decoded is not None and decoded.broken is not None:
            if decoded.over:
                self._decode_limit(ex, "a stream")
            ex.fail(
                "decode_limit" if decoded.over else "protocol",
                f"upstream {ex.upstream.name}: {decoded.broken}",
            )
            return
        if kept is not None and applied:
            got, over = (
                await decode_whole(applied, kept, MAX_KEPT_BODY)
                if decodable(applied)
                else (None, False)
            )
            if over:
                ex.side_errors.append("decode_limit")
                self._decode_limit(ex, "a whole body")
            if got is None:
                self._undecodable(ex, applied)
                if ex.status < 400:
                    return  # nothing readable: the request is counted, unmeasured
            kept = got
        self.settle(ex, kept)

    def _tap(
        self, ex: Exchange, resp: httpx.Response, applied: list[bytes]
    ) -> tuple[Tap | None, Decoded | None]:
        """The tap of a stream the engine answered (and its decoder, in a coding)."""
        tap = decoded = None
        if ex.status < 400:
            tap = ex.upstream.dialect.tap(
                resp.headers.get("content-type", ""), ex.marks, ex.prepared, self.max_event_bytes
            )
            if tap is not None and applied:
                decoded = self._decoded(ex, tap, applied)
                if decoded is None:
                    tap = None
        ex.tap = tap
        return tap, decoded

    def _head(
        self, reply: Reply, resp: httpx.Response, tap: Tap | None, decoded: Decoded | None
    ) -> Headers:
        """The response head's headers as the client gets them."""
        headers = response_headers(resp.headers.raw)
        if self.echo_request_id:
            headers = [h for h in headers if h[0] != b"x-request-id"] + reply.echo
        if decoded is not None and not decoded.exact:
            # the decoded stream goes out (stripped) instead of the engine's coding
            headers = without(headers, b"content-encoding", b"content-length")
        elif tap is not None and decoded is None:
            # the proxy may change a stream's bytes: it goes out chunked
            headers = without(headers, b"content-length")
        return headers

    async def _cut(
        self,
        reply: Reply,
        ex: Exchange,
        exc: httpx.HTTPError,
        tap: Tap | None,
        sealed: bool,
        tail: bytes,
    ) -> None:
        """The upstream broke off mid-response: a stream (one the proxy may add to) ends
        with an error event after what it had; a plain body is left cut short, so the
        client sees the connection end."""
        timeout = isinstance(exc, httpx.TimeoutException)
        if not timeout:  # the engine went away
            ex.upstream.eject("midstream", "a response was cut")
        else:  # it sent a head and then nothing in time: a failure in a row
            ex.upstream.failed("timeout", "an answer that stopped")
        ex.fail(
            "timeout" if timeout else "midstream",
            f"upstream {ex.upstream.name} failed mid-response: {describe(exc)}",
            502,
        )
        self.log.warning("%s (request %s)", ex.error_message, ex.request_id)
        if tap is None or sealed:
            return
        assert ex.error_message is not None
        await reply.end(tail + ex.upstream.dialect.stream_error(ex.error_message, ex.endpoint))

    def _decoded(self, ex: Exchange, tap: Tap, applied: list[bytes]) -> Decoded | None:
        """A stream in a content coding: measured on a decoded copy where the coding is
        one phasewatch decodes (the tap then strips the decoded stream, when usage was
        injected); else None, and it passes through unmeasured."""
        if decodable(applied):
            return Decoded(tap, applied, not tap.rewrites, self.max_decoded_bytes)
        if tap.rewrites:  # (counted with the body, as undecodable)
            self.limited_log.warning(
                "undecodable_injected",
                "upstream %s answered in a coding phasewatch cannot decode although asked "
                "for identity: the usage it was asked for reaches the client (request %s)",
                ex.upstream.name,
                ex.request_id,
            )
        return None

    def _undecodable(self, ex: Exchange, applied: list[bytes]) -> None:
        """A body in a coding phasewatch cannot decode passed through: counted, said once
        (codings stacked beyond what an engine applies: refused, counted apart)."""
        if stacked(applied):
            ex.side_errors.append("decode_limit")
            self.limited_log.warning(
                "decode_stacked",
                "upstream %s answered in %d stacked content codings: not decoded (a "
                "decompression bomb's shape), passed through unmeasured (request %s)",
                ex.upstream.name,
                len(applied),
                ex.request_id,
            )
            return
        ex.side_errors.append("undecodable")
        self.limited_log.warning(
            "undecodable",
            "upstream %s answered in content coding %r, which phasewatch does not decode: "
            "passed through unmeasured (request %s)",
            ex.upstream.name,
            b",".join(applied)[:64],
            ex.request_id,
        )

    def _decode_limit(self, ex: Exchange, what: str) -> None:
        """An answer decoded to its cap (a decompression bomb, or a huge answer): said."""
        self.limited_log.warning(
            "decode_limit",
            "upstream %s answered %s that decodes past its cap (--max-decoded-bytes %d for "
            "a stream, %d for a whole body): decoded no further, measured no further "
            "(request %s)",
            ex.upstream.name,
            what,
            self.max_decoded_bytes,
            MAX_KEPT_BODY,
            ex.request_id,
        )

    def _oversized(self, ex: Exchange, events: int) -> None:
        """Events too large to measure passed through: counted, and said."""
        ex.side_errors.append("oversized")
        self.log.warning(
            "%d stream event(s) over --max-event-bytes (%d) passed through unmeasured "
            "(request %s, upstream %s)",
            events,
            self.max_event_bytes,
            ex.request_id,
            ex.upstream.name,
        )

    def _unterminated(self, ex: Exchange, tap: Tap) -> bytes:
        """The engine closed the stream cleanly but never finished it: say so in the
        stream's own framing so clients do not take a cut answer as whole."""
        if tap.done or tap.error_payload is not None:
            return b""
        ex.upstream.eject("midstream", "a stream ended without its terminator")
        return ex.upstream.dialect.stream_error(
            f"upstream {ex.upstream.name} ended the stream without its terminator",
            ex.prepared.endpoint,
        )

    @staticmethod
    def settle(ex: Exchange, body: bytes | None) -> None:
        """Read what the finished answer said (usage, engine timings, errors)."""
        ex.result = result = ex.upstream.dialect.outcome(ex.tap, body, ex.status)
        if result.error_kind is not None:
            ex.fail(result.error_kind, result.error_message or result.error_kind)


async def relay(reply: Reply, pipe: Pipe, read: Read, ex: Exchange | None = None) -> None:
    """Relay `pipe`'s body through `read`, the client's flow routed to it meanwhile (and
    told to the exchange `ex`, whose stall watch must not take a stream its client holds
    back for an engine's silence)."""
    if ex is None:
        reply.flow = pipe.flow
    else:
        pipe_flow, monotonic = pipe.flow, time.monotonic

        def flow(paused: bool) -> None:
            ex.client_flow(paused, monotonic())
            pipe_flow(paused)

        reply.flow = flow
        if pipe.out.paused:
            ex.client_flow(True, monotonic())
    try:
        await pipe.run(read)
    finally:
        reply.flow = None
