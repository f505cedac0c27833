"""The answer to one client: what goes back to it (:class:`Reply`, the client watched
while it waits), and how an engine's response becomes it (:class:`Responder`).

A client that hangs up cancels its exchange at once (which closes the upstream connection,
so the engine stops generating), unless its answer is already complete: the last message
of an answer goes out through :meth:`Reply.end` or :meth:`Reply.error`, which mark it
finished first, so a client that leaves after that has had its whole answer. How the
hang-up is seen: where the server offers it, through its hang-up hook (the
:data:`~proxy.extensions.GONE` ASGI extension), a callback the server's protocol calls
when the connection is lost; elsewhere, a watcher task waiting on ASGI ``receive`` for
``http.disconnect``.

The response head goes out as the engine sent it (less what the proxy may change: a
length the proxy's stripping would falsify, a coding it decoded). A stream goes through
the engine's tap, one chunk at a time (:meth:`Responder._stream`, the hottest code in
the product); a whole body is forwarded as it comes and kept, bounded, to read its usage
at the end. A stream the engine cut off, or ended without its terminator, is closed with
an error event in its own framing, so no client takes a cut answer as whole. What the
finished answer said (usage, the engine's timings, errors) is read at the end.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable
from types import TracebackType

import httpx

from ..engines import Tap
from ..engines.sse import SSETap
from .asgi import Receive, Send
from .coding import Decoded, codings, decodable, decode_whole, stacked
from .errors import ErrorShape, describe, send_error
from .exchange import Exchange
from .headers import Headers, response_headers, without
from .limited import LimitedLog
from .push import Push, Token, Writer
from .relay_options import RelayOptions

#: The hook's value: ``watch(callback)`` has the server call `callback` once, from its
#: protocol, when the client's connection is lost before its answer is complete (at once
#: when it is lost already); ``watch(None)`` takes it back.
Watch = Callable[[Callable[[], None] | None], None]


class Reply:
    """What goes back to one client: its ASGI `send` (and the server's `writer` and hang-up
    hook `gone`, where it offers them), the headers every error of the proxy's own carries
    (`echo`: x-request-id with --echo-request-id), whether the last message went, and
    whether the client left before it."""

    __slots__ = (
        "_hooked",
        "_task",
        "_watcher",
        "disconnected",
        "echo",
        "finished",
        "gone",
        "send",
        "writer",
    )

    def __init__(
        self,
        send: Send,
        echo: Headers | None = None,
        writer: Writer | None = None,
        gone: Watch | None = None,
    ) -> None:
        self.send = send
        #: The server's synchronous writer (the ``phasewatch.write`` extension), if any.
        self.writer = writer
        #: The server's hang-up hook (the ``phasewatch.gone`` extension), if any.
        self.gone = gone
        self.echo: Headers = echo or []
        self.finished = False
        self.disconnected = False
        self._watcher: asyncio.Task[None] | None = None
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

    def watching(self, receive: Receive) -> _Watching:
        """Watch the client for the block's duration: when it hangs up before the answer
        is finished, the current task is cancelled; that cancellation ends the block
        quietly and leaves `disconnected` set."""
        return _Watching(self, receive)

    def unwatch(self) -> None:
        """Stop watching (from here on, a client that leaves cancels nothing)."""
        if self._watcher is not None:
            self._watcher.cancel()
            self._watcher = None
        if self._hooked:
            self._hooked = False
            assert self.gone is not None
            self.gone(None)

    def _hung_up(self) -> None:
        """The server says the client's connection is lost (the hook's callback)."""
        self._hooked = False
        if not self.finished and self._task is not None:
            self.disconnected = True
            self._task.cancel()

    async def _watch(self, receive: Receive) -> None:
        while True:
            msg = await receive()
            if msg["type"] == "http.disconnect":
                if not self.finished:
                    self.disconnected = True
                    assert self._task is not None
                    self._task.cancel()
                return


class _Watching:
    __slots__ = ("receive", "reply")

    def __init__(self, reply: Reply, receive: Receive) -> None:
        self.reply, self.receive = reply, receive

    async def __aenter__(self) -> Reply:
        reply = self.reply
        reply._task = asyncio.current_task()
        assert reply._task is not None
        if reply.gone is not None:
            reply._hooked = True
            reply.gone(reply._hung_up)
        else:
            reply._watcher = asyncio.create_task(reply._watch(self.receive))
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


def raw_body(resp: httpx.Response) -> AsyncIterator[bytes]:
    """`resp`'s body as its transport hands it over. Why not ``aiter_raw``: it wraps
    every piece in a context manager and a chunker the relay never asks for, and the
    relay closes each response itself; a stream already read or not asynchronous goes
    through ``aiter_raw`` (and its errors)."""
    stream = resp.stream
    if resp.is_stream_consumed or not isinstance(stream, httpx.AsyncByteStream):
        return resp.aiter_raw()
    resp.is_stream_consumed = True
    return stream.__aiter__()


def _token(tap: Tap) -> Token | None:
    """The tap's paced-read shortcut for the push path, where it has one."""
    return tap.token_read if isinstance(tap, SSETap) else None


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
        send = reply.send
        push: Push | None = None
        try:
            if tap is None or source is None:
                # a body phasewatch cannot decode is not kept: nothing in it is readable
                keep = MAX_KEPT_BODY if not applied or decodable(applied) else 0
                kept = await self._forward_kept(reply, resp, keep)
                tail = b""
            else:
                if decoded is not None:
                    tail = await self._stream_decoded(send, resp, decoded)
                else:
                    push = Push.of(resp, tap.feed, reply.writer, self.limited_log, _token(tap))
                    tail = await self._stream(send, resp, tap, push)
                if not sealed:
                    tail += self._unterminated(ex, tap)
                kept = None
        except httpx.HTTPError as exc:
            # a stream's tap ends it on an event boundary; a stream that had reached its
            # end before the connection broke is a whole answer
            tail = source.end(time.monotonic()) if source is not None else b""
            if push is not None:  # what the sink could not write goes first
                tail = push.take() + tail
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

    async def _stream(
        self, send: Send, resp: httpx.Response, source: Tap, push: Push | None
    ) -> bytes:
        """The per-event loop, the hottest code in the product: feed each chunk to the tap,
        forward what it lets through (with `push`, what the connection's callback did not
        take: proxy.core.push); return the rest."""
        feed, monotonic = source.feed, time.monotonic
        async for chunk in raw_body(resp):
            held = push.take() if push is not None else b""  # the callback's output first
            out = feed(chunk, monotonic())
            if held:
                out = held + out
            if out:
                await send({"type": "http.response.body", "body": out, "more_body": True})
            if push is not None:
                push.busy = False
        return (push.take() if push is not None else b"") + source.end(monotonic())

    async def _stream_decoded(self, send: Send, resp: httpx.Response, decoded: Decoded) -> bytes:
        """A coded stream: measured on its decoded copy, the engine's bytes forwarded as
        they came (exact); or decoded for the client (usage was injected, the engine coded
        its answer anyway), forwarded a bounded piece at a time and ended at the decoded
        cap (the client's stream then ends with the proxy's error event)."""
        monotonic = time.monotonic
        if decoded.exact:
            async for chunk in raw_body(resp):
                await decoded.measure(chunk, monotonic())
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            return decoded.end(monotonic())
        async for chunk in raw_body(resp):
            async for out in decoded.pieces(chunk, monotonic()):
                await send({"type": "http.response.body", "body": out, "more_body": True})
            if decoded.over:
                break
        return decoded.end(monotonic())

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

    async def _forward_kept(self, reply: Reply, resp: httpx.Response, keep: int) -> bytes:
        """Forward a whole (unstreamed) body, keeping up to `keep` bytes of it to read
        its usage at the end."""
        send = reply.send
        kept: list[bytes] = []
        size = 0
        async for chunk in raw_body(resp):
            if size < keep:
                kept.append(chunk)
                size += len(chunk)
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
        return b"".join(kept)

    @staticmethod
    def settle(ex: Exchange, body: bytes | None) -> None:
        """Read what the finished answer said (usage, engine timings, errors)."""
        ex.result = result = ex.upstream.dialect.outcome(ex.tap, body, ex.status)
        if result.error_kind is not None:
            ex.fail(result.error_kind, result.error_message or result.error_kind)
