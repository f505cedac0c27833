"""The HTTP/1.1 server protocol phasewatch runs: uvicorn's httptools protocol, guarded.

uvicorn's httptools protocol buffers a request head without bound (one connection's
100 MiB of headers is 100 MiB, and a single huge value stalls the loop) and gives a
client all the time it likes to send one (a thousand slow clients hold a thousand
connections). Its h11 protocol has a head limit, but is several times slower per
request. So phasewatch keeps httptools and adds, before any application code runs:

- a **head limit** (``--max-head-bytes``), per request head: the bytes of each head are
  counted from its own first byte, as they reach the parser (a head that begins inside a
  read field by field, the rest of it as raw bytes), however many pipelined requests one
  read holds; past the limit the client gets a 431 in that request's turn and the
  connection is closed, having cost at most the limit (plus one socket read);
- the same limit for a chunked body's **trailer section**, whose fields are dropped:
  uvicorn would append them to the request's header list, so that the engine received
  them as headers (``trailers_too_large``: a 431, or only the close when the request is
  answered already);
- a **pipelining bound** (``--max-pipelined-requests``, ``--max-pipelined-bytes``): the
  parser is fed in slices that cannot complete more request heads than the queue has
  room for; with the queue full, reading pauses and what was read is held (at most
  --max-pipelined-bytes, else a 429 in turn and the close). Every refusal (431, 429, and
  uvicorn's own 400) is written after the answers to the requests read before it;
- a **stalled-stream cap** (``--max-stalled-streams``): a connection whose writes wait on
  a client that stopped reading holds about two upstream reads of its stream (some
  2 MiB); past the cap, a stream of the client holding the most stalled streams is
  closed, its longest-stalled (``stalled_stream``): a client is its API key's name where
  the relay names one, else its address, so one client's stalled streams cannot get
  another's closed;
- a **malformed chunked body** (a bad size line, a chunk longer than its size, a
  forbidden byte, a ``content-length`` trailer) gets a 400 in its request's turn and the
  close, its request told the client left (``bad_chunked``): it no longer waits for
  ``--body-timeout``;
- a **header deadline** (``--header-timeout``): from a connection's start, and from the
  first byte of each later request, until its head is complete; past it the client gets
  a 408 (a connection that sent nothing is just closed).

Upgrade requests stay HTTP requests (a websocket one gets a 501 from the application);
the parser reads nothing after one, so such a connection closes after its answer.

And two fixes to how a connection ends (half-close, lingering close):
:mod:`proxy.runtime.ending`.

Each refusal counts in ``phasewatch_rejected_total{reason}`` and is said in the log (at
most one line per reason per 10 s, with how many it folded in). What this module takes
from uvicorn's private protocol, and why: :mod:`proxy.runtime.borrowed`.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any, ClassVar

import httptools
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol, RequestResponseCycle

from ..core.access import CLIENT_SCOPE
from ..core.errors import json_error
from ..core.headers import content_length
from ..core.limited import LimitedLog
from .borrowed import BORROWED  # noqa: F401 - re-exported: what the guards take
from .direct import flowed, hung_up, install
from .ending import ConnectionEnd

log = logging.getLogger(__name__)

#: Fewer bytes than the shortest request (``GET / HTTP/1.1`` and an empty line is 18):
#: a slice of 16 * n bytes completes at most n request heads.
_SHORTEST = 16


class _Refused(Exception):
    """Raised from a parser callback: the connection is refused, parse nothing more."""


def _answer(status: int, reason: bytes, message: str, kind: str) -> bytes:
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


class _Transport:
    """The connection's transport as uvicorn sees it: every call goes straight to the
    real one, except ``close``, which becomes a lingering close while the client is
    still sending a body nobody will read, and ``resume_reading``, which waits while
    bytes read ahead of a full pipeline are held."""

    def __init__(self, real: asyncio.Transport, protocol: GuardedProtocol) -> None:
        self._real = real
        self._protocol = protocol
        self.write = real.write
        self.writelines = real.writelines
        self.get_extra_info = real.get_extra_info
        self.pause_reading = real.pause_reading
        self.set_protocol = real.set_protocol
        self.abort = real.abort

    def close(self) -> None:
        self._protocol.close_connection()

    def resume_reading(self) -> None:
        if not self._protocol.held:
            self._real.resume_reading()

    def is_closing(self) -> bool:
        return self._protocol.lingering or self._real.is_closing()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)


# eof_received returns True to keep a half-closed connection (asyncio's contract for a
# protocol; uvicorn's own says None): hence the ignore
class GuardedProtocol(ConnectionEnd, HttpToolsProtocol):  # type: ignore[misc]
    """uvicorn's httptools protocol with a head limit, a header deadline, half-close and
    lingering close. :func:`guarded_protocol` makes one per server, with its limits."""

    max_head_bytes = 64 * 1024
    header_timeout = 10.0
    #: Requests read ahead of the one being answered, and bytes held unparsed beyond them.
    max_pipelined_requests = 16
    max_pipelined_bytes = 64 * 1024
    #: Connections whose writes wait on a client that does not read, per server (each
    #: holds about two upstream reads of its stream), and how many may.
    stalled: ClassVar[dict[GuardedProtocol, str]] = {}  # -> its owner (_owner)
    max_stalled_streams = 64
    #: Called with the reason of each refusal (the metrics counter).
    on_reject: Callable[[str], None] = staticmethod(lambda reason: None)
    refusals = LimitedLog(log)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.real: asyncio.Transport | None = None
        self.in_head = True  # the next bytes belong to a request head
        self.head_open = False  # a head's first bytes are parsed, not yet its end
        self.idle_since: float | None = None  # kept alive with no request since then
        self.head_bytes = 0
        self.head_timer: asyncio.TimerHandle | None = None
        self.lingering = False  # answered and closing: what arrives is dropped
        self.linger_timer: asyncio.TimerHandle | None = None
        self.peer_timer: asyncio.TimerHandle | None = None
        self.peer_checks = 0
        self.eof_seen = False
        self.in_trailers = False  # after a chunk header: maybe the trailer section
        self.raw = False  # this slice's bytes are already counted for the open head
        self.body_left: int | None = None  # of the parser's message, when it has a length
        self.held = b""  # read, not yet parsed: the pipeline is full
        self.stopped = False  # refused or upgraded: nothing more is parsed
        self.pending: bytes | None = None  # a refusal, written once the queued answers are out
        self.running: RequestResponseCycle | None = None  # the cycle being answered

    # --- the connection -----------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.real = transport  # type: ignore[assignment]
        super().connection_made(_Transport(transport, self))  # type: ignore[arg-type]
        self._arm_head_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        for timer in (
            self.head_timer,
            self.linger_timer,
            self.peer_timer,
            self.timeout_keep_alive_task,
        ):
            if timer is not None:
                timer.cancel()
        self.head_timer = self.linger_timer = self.peer_timer = None
        self.timeout_keep_alive_task = None
        running = self.running
        if running is not None and running is not self.cycle and not running.response_complete:
            # uvicorn tells only the last parsed cycle; the one being answered is told too
            running.disconnected = True
            running.message_event.set()
        self.stalled.pop(self, None)
        # what was read ahead is never answered now: free it with the connection
        self.pipeline.clear()
        self.held = b""
        self.pending = None
        super().connection_lost(exc)
        hung_up(running, self.cycle)  # the relay's hang-up hooks (runtime.direct)

    def data_received(self, data: bytes) -> None:
        if self.lingering or self.stopped:
            return  # the answer is out, or the connection refused: what arrives is dropped
        if self.held:
            # reading is paused while bytes are held; a loop that still delivers some
            # keeps within the same bound
            self._hold(self.held + data)
            return
        self._feed(data)
        self._watch_head()

    def pause_writing(self) -> None:
        """The client reads slower than its answer comes (its buffers are full): one
        more stalled stream. Past --max-stalled-streams, the longest-stalled stream of
        the client holding the most is closed (its request ends as a hang-up, the
        engine's work is cancelled)."""
        super().pause_writing()
        flowed(True, self.running, self.cycle)  # the relay's flow (runtime.direct)
        stalled = self.stalled
        stalled[self] = self._owner()
        if len(stalled) <= self.max_stalled_streams:
            return
        oldest = _most_held(stalled)
        del stalled[oldest]
        self.on_reject("stalled_stream")
        self.refusals.warning(
            "stalled_stream",
            "closed a stream to %s: its client stopped reading, and more than %d "
            "others had too (--max-stalled-streams)",
            _peer(oldest.client),
            self.max_stalled_streams,
        )
        if oldest.real is not None:
            oldest.real.abort()

    def resume_writing(self) -> None:
        self.stalled.pop(self, None)
        super().resume_writing()
        flowed(False, self.running, self.cycle)

    def _owner(self) -> str:
        """Who holds this connection, for the stalled-stream cap: the API key's name the
        relay put in the request's scope, else the client's address."""
        cycle = self.running or self.cycle
        named = cycle.scope.get(CLIENT_SCOPE) if cycle is not None else None
        if named:
            return "key:" + str(named)
        client = self.client
        return "address:" + (client[0] if client else "unknown")

    # --- feeding the parser -------------------------------------------------------------

    def _busy(self) -> bool:
        """An answer is being written or requests are queued behind one."""
        running = self.running
        return bool(self.pipeline) or (
            running is not None and not running.response_complete and not running.disconnected
        )

    def _feed(self, data: bytes) -> None:
        """Give `data` to the parser in slices that keep the limits exact: a request head
        (or a trailer section) is counted from its own first byte, whatever else the same
        read holds, and no slice can complete more request heads than the pipeline has
        room for. What the full pipeline has no room for is held, reading paused."""
        view: bytes | memoryview = data
        pos, end = 0, len(data)
        while pos < end:
            if self.stopped or self.lingering or self.transport.is_closing():
                return
            running = self.running
            busy = bool(self.pipeline) or (
                running is not None and not running.response_complete and not running.disconnected
            )
            slots = self.max_pipelined_requests - len(self.pipeline) + (0 if busy else 1)
            if slots <= 0:
                self._hold(bytes(view[pos:]))
                return
            size = end - pos
            if self.in_head or self.in_trailers:
                room = self.max_head_bytes - self.head_bytes
                if room <= 0:
                    self._refuse_head(trailers=not self.in_head)
                    return
                size = min(size, room, _SHORTEST * slots)
                self.raw = True  # the open head's share of this slice is counted here
                self.head_bytes += size
            elif self.body_left is not None:
                size = min(size, self.body_left) or size
            # else: a chunked body; on_headers_complete refuses a pipeline past its bound
            if size == end:
                self._parse(data)  # the whole read at once (the common case)
                return
            if view is data:
                view = memoryview(data)
            self._parse(view[pos : pos + size])
            pos += size

    def _parse(self, piece: bytes | memoryview) -> None:
        """uvicorn's data_received, for one slice."""
        self._unset_keepalive_if_required()
        try:
            self.parser.feed_data(piece)
        except httptools.HttpParserUpgrade:
            self.stopped = True  # nothing after an upgrade request is HTTP (see below)
        except httptools.HttpParserError:
            if self.stopped:
                return  # refused from a callback: answered already
            if not self.in_head and self.cycle is not None:
                self._refuse_body()
                return
            msg = "Invalid HTTP request received."
            self.logger.warning(msg)
            self.send_400_response(msg)

    def _hold(self, rest: bytes) -> None:
        """The pipeline is full: keep what was read, parse it as answers go out."""
        if len(rest) > self.max_pipelined_bytes:
            self._refuse_pipeline(f"{len(rest)} bytes read ahead of a full pipeline")
            return
        self.held = rest
        assert self.real is not None
        self.real.pause_reading()

    def _resume_held(self) -> None:
        held, self.held = self.held, b""
        self._feed(held)
        self._watch_head()
        if not self.held and not self.stopped and not self.flow.read_paused:
            assert self.real is not None
            self.real.resume_reading()

    # --- parser callbacks ---------------------------------------------------------------

    def on_message_begin(self) -> None:
        self.head_open = True
        if not self.raw:
            self.head_bytes = 0  # a head that began inside a slice: counted field by field
        self.in_trailers = False
        self.body_left = None
        super().on_message_begin()

    def on_url(self, url: bytes) -> None:
        if not self.raw:
            self._count(len(url))
        super().on_url(url)

    def on_header(self, name: bytes, value: bytes) -> None:
        if not self.raw:
            self._count(len(name) + len(value) + 4)
        if not self.in_head:
            # a trailer field: counted like a head, never merged into the request's
            # headers (uvicorn appends it to the list the application reads): dropped
            return
        super().on_header(name, value)

    def _count(self, size: int) -> None:
        """Bytes of the open head (or trailer section) that began inside a slice (one
        that began with a slice is counted whole, as raw bytes)."""
        self.head_bytes += size
        if self.head_bytes > self.max_head_bytes:
            self._refuse_head(trailers=not self.in_head)
            raise _Refused

    def on_headers_complete(self) -> None:
        self.in_head = self.head_open = False
        self.raw = False
        self.head_bytes = 0
        if self.head_timer is not None:
            self.head_timer.cancel()
            self.head_timer = None
        before = self.cycle
        super().on_headers_complete()
        cycle = self.cycle
        if cycle is before:
            return
        self.body_left = content_length(self.headers)
        assert self.real is not None  # set by connection_made, before any byte is parsed
        install(cycle, self.real, self)  # extensions (runtime.direct)
        if self.parser.should_upgrade():
            # the parser reads nothing after an upgrade request it does not switch to:
            # this connection can carry no further request
            cycle.keep_alive = False
        if not (self.pipeline and self.pipeline[0][0] is cycle):
            self.running = cycle  # started at once
        elif len(self.pipeline) > self.max_pipelined_requests:
            self.pipeline.popleft()  # never started
            self._refuse_pipeline(f"more than {self.max_pipelined_requests} requests read ahead")
            raise _Refused

    def on_body(self, body: bytes) -> None:
        self.in_trailers = False  # a chunk with data: not the last one
        if self.body_left is not None:
            self.body_left -= len(body)
        super().on_body(body)

    def on_chunk_header(self) -> None:
        """After a chunk's size line: if it was the last (size 0), a trailer section of
        any length may follow; it is counted against the head limit from here."""
        self.in_trailers = True
        self.raw = False
        self.head_bytes = 0

    def on_message_complete(self) -> None:
        self.in_trailers = False
        self.raw = False
        self.head_bytes = 0
        super().on_message_complete()
        self.in_head = True

    def on_response_complete(self) -> None:
        following = self.pipeline[-1][0] if self.pipeline else None
        # uvicorn's, with the keep-alive deadline of _keep_alive instead of a timer made
        # at every answer's end and cancelled by the next request's first read
        self.server_state.total_requests += 1
        if not self.transport.is_closing():
            self.idle_since = None
            self.flow.resume_reading()
            if self.pipeline:
                cycle, app = self.pipeline.pop()
                self._start_asgi_task(cycle, app)
            else:
                self._keep_alive()
        if following is not None and not (self.pipeline and self.pipeline[-1][0] is following):
            self.running = following  # uvicorn started the next queued request
        if self.transport.is_closing() or self.lingering:
            return
        if self.pending is not None:
            if not self._busy():  # every request read before the refused one is answered
                answer, self.pending = self.pending, None
                self.transport.write(answer)
                self._linger()
            return
        if self.held and len(self.pipeline) < self.max_pipelined_requests:
            self._resume_held()

    def send_400_response(self, msg: str) -> None:
        """uvicorn's 400 for a request the parser rejects, after the answers to the
        requests read before it (written at once, it would cut into one of them)."""
        self.stopped = True
        if not self._busy():
            super().send_400_response(msg)
            return
        body = msg.encode("ascii")
        self._answer_in_turn(
            b"".join(
                [
                    b"HTTP/1.1 400 Bad Request\r\n",
                    *(n + b": " + v + b"\r\n" for n, v in self.server_state.default_headers),
                    b"content-type: text/plain; charset=utf-8\r\n",
                    b"content-length: %d\r\n" % len(body),
                    b"connection: close\r\n\r\n",
                    body,
                ]
            )
        )

    def _should_upgrade(self) -> bool:
        """No protocol switch: an upgrade request is an HTTP request like any other (the
        application refuses a websocket one with a 501; others are relayed without their
        Upgrade header), and the connection closes after its answer."""
        return False

    def _unsupported_upgrade_warning(self) -> None:
        """Bytes after an upgrade request are dropped, without a log line for each."""

    # --- the guards ---------------------------------------------------------------------

    def _keep_alive(self) -> None:
        """The connection is idle from now: closed once it has been for
        ``timeout_keep_alive``. One timer serves many answers: where one is pending (it
        fires no later than this deadline), :meth:`_keep_alive_due` looks again then."""
        self.idle_since = now = self.loop.time()
        if self.timeout_keep_alive_task is None:
            self.timeout_keep_alive_task = self.loop.call_at(
                now + self.timeout_keep_alive, self._keep_alive_due
            )

    def _keep_alive_due(self) -> None:
        self.timeout_keep_alive_task = None
        since = self.idle_since
        if since is None:
            return  # busy since: the answer's end starts the deadline again
        due = since + self.timeout_keep_alive
        if self.loop.time() < due:
            self.timeout_keep_alive_task = self.loop.call_at(due, self._keep_alive_due)
            return
        self.timeout_keep_alive_handler()

    def _unset_keepalive_if_required(self) -> None:
        """Bytes came (uvicorn calls this on every read): the connection is not idle; the
        pending keep-alive timer, if any, finds that when it fires."""
        self.idle_since = None

    def _watch_head(self) -> None:
        """After a read is parsed: the header deadline starts when bytes of a head wait
        (a head begun and not complete, or bytes held unparsed). Why not on every read: a
        head nearly always comes whole in one read, and a deadline armed before it is
        parsed would only be cancelled by it (a timer made and dropped per request)."""
        if (
            self.head_timer is None
            and self.in_head
            and (self.head_open or self.held)
            and not (self.lingering or self.stopped)
        ):
            self._arm_head_timer()

    def _arm_head_timer(self) -> None:
        self.head_timer = self.loop.call_later(self.header_timeout, self._head_timeout)

    def _head_timeout(self) -> None:
        self.head_timer = None
        if not self.in_head or self.lingering or self.transport.is_closing():
            return
        if self.cycle is not None and not self.cycle.response_complete:
            self._arm_head_timer()  # a request is being answered: its turn comes after
            return
        self.on_reject("header_timeout")
        self.refusals.warning(
            "header_timeout",
            "closed a connection from %s: no complete request head within %gs",
            _peer(self.client),
            self.header_timeout,
        )
        assert self.real is not None
        if not self.head_bytes:
            self.real.close()  # it never sent a byte: nothing to answer
            return
        self.transport.write(
            _answer(
                408,
                b"Request Timeout",
                f"request head not complete within {self.header_timeout:g}s",
                "request_timeout",
            )
        )
        self._linger()

    def _refuse_head(self, trailers: bool = False) -> None:
        reason = "trailers_too_large" if trailers else "head_too_large"
        self.on_reject(reason)
        self.refusals.warning(
            reason,
            "refused a request %s over %d bytes from %s",
            "trailer section" if trailers else "head",
            self.max_head_bytes,
            _peer(self.client),
        )
        what = "request trailers" if trailers else "request head"
        self._refuse(
            _answer(
                431,
                b"Request Header Fields Too Large",
                f"{what} over {self.max_head_bytes} bytes",
                "request_header_too_large",
            ),
            self.cycle if trailers else None,
        )

    def _refuse_body(self) -> None:
        """The parser rejected the body (or trailer section) of the request read last: a
        malformed chunked body. Its request, waiting for the rest of the body, is told
        the client left, and the 400 goes out in its turn (at once when it is the one
        being answered), the connection closed after it."""
        self.on_reject("bad_chunked")
        self.refusals.warning(
            "bad_chunked",
            "refused a malformed chunked request body from %s",
            _peer(self.client),
        )
        self._refuse(
            _answer(400, b"Bad Request", "malformed request body", "invalid_request_error"),
            self.cycle,
        )

    def _refuse_pipeline(self, why: str) -> None:
        self.on_reject("pipeline_full")
        self.refusals.warning(
            "pipeline_full",
            "refused a connection from %s: %s (--max-pipelined-requests %d, "
            "--max-pipelined-bytes %d)",
            _peer(self.client),
            why,
            self.max_pipelined_requests,
            self.max_pipelined_bytes,
        )
        self._refuse(
            _answer(
                429,
                b"Too Many Requests",
                f"more than {self.max_pipelined_requests} pipelined requests on one connection",
                "too_many_pipelined_requests",
            ),
            None,
        )

    def _refuse(self, answer: bytes, message: RequestResponseCycle | None) -> None:
        """Refuse the connection: nothing more is parsed or held; the answer goes out in
        the refused request's turn, and the connection closes after it. `message` is
        the cycle of the request whose trailer section is refused (already created)."""
        self.stopped = True
        self.held = b""
        if message is not None:
            queued = [entry for entry in self.pipeline if entry[0] is message]
            for entry in queued:
                self.pipeline.remove(entry)  # never started: it is the refused request
            if not queued and message.response_complete:
                self._linger()  # answered already (a 401 before its body): only closed
                return
            if not queued and message is self.running:
                if message.response_started:
                    assert self.real is not None
                    self.real.close()  # its answer is under way: it cannot be followed
                    return
                # its application waits for the rest of the body: it is told the client
                # left, and its answer is this one
                message.disconnected = True
                message.message_event.set()
                hung_up(message)
        self._answer_in_turn(answer)

    def _answer_in_turn(self, answer: bytes) -> None:
        if self._busy():
            self.pending = answer
            assert self.real is not None
            self.real.resume_reading()  # what arrives is dropped; a hang-up is seen
            return
        self.transport.write(answer)
        self._linger()


def _most_held(stalled: dict[GuardedProtocol, str]) -> GuardedProtocol:
    """The longest-stalled connection of the owner holding the most stalled ones (of
    owners holding as many, the one stalled longest)."""
    counts: dict[str, int] = {}
    for owner in stalled.values():
        counts[owner] = counts.get(owner, 0) + 1
    most = max(counts.values())
    return next(c for c, owner in stalled.items() if counts[owner] == most)


def _peer(client: tuple[str, int] | None) -> str:
    return f"{client[0]}:{client[1]}" if client else "unknown"


def guarded_protocol(
    max_head_bytes: int,
    header_timeout: float,
    on_reject: Callable[[str], None],
    max_pipelined_requests: int = 16,
    max_pipelined_bytes: int = 64 * 1024,
    max_stalled_streams: int = 64,
) -> type[GuardedProtocol]:
    """The protocol class for one server, with its limits and its refusal counter."""
    return type(
        "GuardedProtocol",
        (GuardedProtocol,),
        {
            "max_head_bytes": max_head_bytes,
            "header_timeout": header_timeout,
            "max_pipelined_requests": max_pipelined_requests,
            "max_pipelined_bytes": max_pipelined_bytes,
            "stalled": {},
            "max_stalled_streams": max_stalled_streams,
            "on_reject": staticmethod(on_reject),
            "refusals": LimitedLog(log),
        },
    )
