"""The relay loop: a measured request's response, from its head to its last byte.

The head goes out as the engine sent it (less what the proxy may change: a length the
proxy's stripping would falsify, a coding it decoded). A stream goes through the
engine's tap, one chunk at a time (:meth:`Responder._stream`, the hottest code in the
product); a whole body is forwarded as it comes and kept, bounded, to read its usage at
the end. A stream the engine cut off, or ended without its terminator, is closed with an
error event in its own framing, so no client takes a cut answer as whole. What the
finished answer said (usage, the engine's timings, errors) is read at the end.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator

import httpx

from ..engines import Tap
from ..engines.sse import SSETap
from .asgi import Send
from .coding import Decoded, codings, decodable, decode_whole
from .errors import describe
from .exchange import Exchange
from .headers import Headers, response_headers, without
from .limited import LimitedLog
from .push import Push, Token
from .relay_options import RelayOptions
from .reply import Reply

#: Largest non-streamed measured response kept for reading its usage.
MAX_KEPT_BODY = 16 * 1024 * 1024

#: The upstream response extension saying whether its body is over, every byte of it
#: read (proxy.transport.lean): a stream's last read then goes out with the answer's end,
#: in one write (the client woken once for both). Where a transport has none, `_never`.
ENDED = "phasewatch.ended"


def _never() -> bool:
    return False


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

    def __init__(self, log: logging.Logger, said: LimitedLog, options: RelayOptions) -> None:
        self.log = log
        self.said = said
        self.max_event_bytes = options.max_event_bytes
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
                if decoded is not None and not decoded.exact:
                    tail = await self._stream_decoded(send, resp, decoded)
                else:
                    push = (
                        Push.of(resp, tap.feed, reply.writer, self.said, _token(tap))
                        if source is tap
                        else None
                    )
                    tail = await self._stream(send, resp, source, push)
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
            ex.fail("protocol", f"upstream {ex.upstream.name}: {decoded.broken}")
            return
        if kept is not None and applied:
            got = decode_whole(applied, kept, MAX_KEPT_BODY) if decodable(applied) else None
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
            return Decoded(tap, applied, exact=not tap.rewrites)
        if tap.rewrites:  # (counted with the body, as undecodable)
            self.said.warning(
                "undecodable_injected",
                "upstream %s answered in a coding phasewatch cannot decode although asked "
                "for identity: the usage it was asked for reaches the client (request %s)",
                ex.upstream.name,
                ex.request_id,
            )
        return None

    def _undecodable(self, ex: Exchange, applied: list[bytes]) -> None:
        """A body in a coding phasewatch cannot decode passed through: counted, said once."""
        ex.side_errors.append("undecodable")
        self.said.warning(
            "undecodable",
            "upstream %s answered in content coding %r, which phasewatch does not decode: "
            "passed through unmeasured (request %s)",
            ex.upstream.name,
            b",".join(applied)[:64],
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
        self, send: Send, resp: httpx.Response, source: Tap | Decoded, push: Push | None
    ) -> bytes:
        """The per-event loop, the hottest code in the product: feed each chunk to the tap
        (or its decoder), forward what it lets through (with `push`, what the connection's
        callback did not take: proxy.core.push); return the rest, the last read with it."""
        feed, monotonic = source.feed, time.monotonic
        ended, last = resp.extensions.get(ENDED, _never), b""
        async for chunk in raw_body(resp):
            held = push.take() if push is not None else b""  # the callback's output first
            out = feed(chunk, monotonic())
            if held:
                out = held + out
            if ended():  # nothing follows: it goes out with the end, in one write
                last = out
            elif out:
                await send({"type": "http.response.body", "body": out, "more_body": True})
            if push is not None:
                push.busy = False
        return last + (push.take() if push is not None else b"") + source.end(monotonic())

    async def _stream_decoded(self, send: Send, resp: httpx.Response, decoded: Decoded) -> bytes:
        """A coded stream decoded for the client (usage was injected, the engine coded its
        answer anyway): forwarded a bounded piece at a time."""
        async for chunk in raw_body(resp):
            for out in decoded.pieces(chunk, time.monotonic()):
                await send({"type": "http.response.body", "body": out, "more_body": True})
        return decoded.end(time.monotonic())

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
