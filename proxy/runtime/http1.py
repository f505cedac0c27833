"""The HTTP/1.1 server protocol phasewatch runs: an ``asyncio.Protocol`` on httptools'
request parser, serving each request to the ASGI application as one
:class:`~proxy.runtime.cycle.Cycle` (keep-alive, pipelining, chunked and content-length
answers, HEAD, ``Expect: 100-continue``, flow control both ways), with the wire guarded
before any application code runs:

- a **head limit** (``--max-head-bytes``), per request head: the bytes of each head are
  counted from its own first byte, as they reach the parser (a head that begins inside a
  read field by field, the rest of it as raw bytes), however many pipelined requests one
  read holds; past the limit the client gets a 431 in that request's turn and the
  connection is closed, having cost at most the limit (plus one socket read);
- a **header-field limit** (``--max-header-fields``, 100 like Apache's): a head of many
  small fields within the byte limit still costs a parse and a header list per field in
  every layer after it; past the limit the client gets a 431 (``too_many_headers``);
- an **HTTP version** other than 1.0 and 1.1 (an HTTP/0.9 request line, ``HTTP/0.9`` or
  ``HTTP/2.0`` spelt out) gets a 505 (``bad_version``): it is never relayed as a request
  of a version it is not;
- the same limit for a chunked body's **trailer section**, whose fields are dropped (the
  engine never receives them as headers) (``trailers_too_large``: a 431, or only the
  close when the request is answered already);
- a **pipelining bound** (``--max-pipelined-requests``, ``--max-pipelined-bytes``): the
  parser is fed in slices that cannot complete more request heads than the queue has
  room for; with the queue full, reading pauses and what was read is held (at most
  --max-pipelined-bytes, else a 429 in turn and the close). Every refusal (431, 429, the
  parser's 400) is written after the answers to the requests read before it;
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
  a 408 (a connection that sent nothing is just closed);
- a **keep-alive deadline** (uvicorn's ``timeout_keep_alive``, 5 s): an idle connection
  is closed, with one timer a connection rather than one an answer.

Upgrade requests stay HTTP requests (a websocket one gets a 501 from the application): the
upgrade is declined and the request served as HTTP/1.1, its body included (``Upgrade:
h2c`` on a POST, as ``curl --http2`` sends it): the parser stops at an upgrade request's
head, so its announced body is read by a parser of its own (:class:`_DeclinedBody`).
Nothing after it is parsed, so such a connection closes after its answer.

``Expect: 100-continue`` gets its interim ``100 Continue`` only when a body is still to
come: a request that announces none is answered at once.

And how a connection ends:

- **half-close**: a client that half-closes (sends FIN) after a complete request still
  gets its answer. Whether it is still there or gone cannot be told from a FIN alone, so
  the server sends an interim ``100 Continue`` (every HTTP/1.1 client must skip 1xx
  answers it did not expect): a client that closed its socket answers it with a reset,
  and its request is cancelled as a hang-up;
- **lingering close**: when the server answers before it has read the whole request
  body (413, 401, 431 ...) and the connection is to close, closing at once would reset
  the connection under the client's feet and lose the answer. The server half-closes
  instead and reads and drops what the client still sends, for up to
  ``--header-timeout``, then closes.

The one hang-up detector is :meth:`Http1Protocol.connection_lost`: the answer being
written (and the request read last) is told, through its ``receive``
(``http.disconnect``) and its watcher (:class:`~proxy.runtime.cycle.Answer`).

Each refusal counts in ``phasewatch_rejected_total{reason}`` and is said in the log (at
most one line per reason per 10 s, with how many it folded in). What this module takes
from uvicorn (it runs the server, this protocol its connections), and why:
:mod:`proxy.runtime.borrowed`.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import urllib.parse
from collections import deque
from collections.abc import Callable
from typing import Any, ClassVar

import httptools

from ..core.access import CLIENT_SCOPE
from ..core.headers import content_length
from ..core.limited import LimitedLog
from . import guards
from .cycle import HIGH_WATER, Cycle
from .cycle import logger as server_log

log = logging.getLogger(__name__)

#: After a client's FIN, when to look for its reset (seconds after the probe), then
#: every second until its answer starts.
_PEER_CHECKS = (0.002, 0.01, 0.05, 0.2, 1.0)

_INVALID = "Invalid HTTP request received."


class _Refused(Exception):
    """Raised from a parser callback: the connection is refused, parse nothing more."""


def _address(info: Any) -> tuple[str, int] | None:
    if isinstance(info, (list, tuple)) and len(info) >= 2:
        return str(info[0]), int(info[1])
    return None


class Http1Protocol(asyncio.Protocol):
    """One HTTP/1.1 connection (see the module). uvicorn makes one per connection as
    ``cls(config=..., server_state=..., app_state=..., _loop=...)``;
    :func:`guarded_protocol` makes the class for one server, with its limits."""

    max_head_bytes = 64 * 1024
    max_header_fields = 100
    header_timeout = 10.0
    #: Requests read ahead of the one being answered, and bytes held unparsed beyond them.
    max_pipelined_requests = 16
    max_pipelined_bytes = 64 * 1024
    #: Connections whose writes wait on a client that does not read, per server (each
    #: holds about two upstream reads of its stream), and how many may.
    stalled: ClassVar[dict[Http1Protocol, str]] = {}  # -> its owner (_owner)
    max_stalled_streams = 64
    #: Called with the reason of each refusal (the metrics counter).
    on_reject: Callable[[str], None] = staticmethod(lambda reason: None)
    refusals = LimitedLog(log)

    def __init__(
        self,
        config: Any,
        server_state: Any,
        app_state: dict[str, Any],
        _loop: asyncio.AbstractEventLoop | None = None,
    ) -> None:
        if not config.loaded:
            config.load()
        self.app = config.loaded_app
        self.loop = _loop or asyncio.get_event_loop()
        self.root_path: str = config.root_path
        self.timeout_keep_alive: float = config.timeout_keep_alive
        self.app_state = app_state
        self.server_state = server_state
        self.connections: set[Any] = server_state.connections
        self.tasks: set[asyncio.Task[None]] = server_state.tasks
        self.parser = httptools.HttpRequestParser(self)
        try:
            # answer the first of pipelined requests whose first says "connection: close"
            self.parser.set_dangerous_leniencies(lenient_data_after_close=True)
        except AttributeError:  # httptools older than 0.6.3
            pass
        # the connection
        self.real: asyncio.Transport = None  # type: ignore[assignment]  # connection_made
        self.server: tuple[str, int] | None = None
        self.client: tuple[str, int] | None = None
        self.scheme = "http"
        self.read_paused = False  # by flow control (a body not taken, a queued request)
        self.write_paused = False  # by the transport: the client does not read
        self._drain: asyncio.Future[None] | None = None
        self.keep_alive_timer: asyncio.TimerHandle | None = None
        # the requests
        self.cycle: Cycle | None = None  # the request read last
        self.running: Cycle | None = None  # the request being answered
        self.pipeline: deque[Cycle] = deque()  # read ahead, not started: newest first
        self.url = b""
        self.headers: list[tuple[bytes, bytes]] = []
        self.expect_100_continue = False
        #: an upgrade request with a body, declined: its body parser (see the module)
        self.declined: _DeclinedBody | None = None
        self.declining = False  # its head is complete, its body not yet read
        # the guards
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

    @property
    def default_headers(self) -> list[tuple[bytes, bytes]]:
        """The server's headers for every answer (a date, a server name, as configured)."""
        headers: list[tuple[bytes, bytes]] = self.server_state.default_headers
        return headers

    # --- the connection -----------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.connections.add(self)
        self.real = transport  # type: ignore[assignment]
        self.server = _address(transport.get_extra_info("sockname"))
        self.client = _address(transport.get_extra_info("peername"))
        if transport.get_extra_info("sslcontext"):
            self.scheme = "https"
        self._arm_head_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        self.connections.discard(self)
        for timer in (self.head_timer, self.linger_timer, self.peer_timer, self.keep_alive_timer):
            if timer is not None:
                timer.cancel()
        self.head_timer = self.linger_timer = self.peer_timer = self.keep_alive_timer = None
        self.stalled.pop(self, None)
        self.stopped = True
        told = []
        for cycle in (self.running, self.cycle):
            if cycle is None or cycle in told:
                continue
            if not cycle.response_complete:
                cycle.hang_up()
                told.append(cycle)
            cycle.message_event.set()
        # what was read ahead is never answered now: free it with the connection
        self.pipeline.clear()
        self.held = b""
        self.pending = None
        self._release_writers()
        if exc is None:
            self.real.close()
        # the parser and the cycles refer back to this protocol: nothing is left for the
        # garbage collector once the last task is done
        self.parser = None  # type: ignore[assignment]
        self.cycle = self.running = None
        for cycle in told:
            cycle.answer.tell_lost()

    def data_received(self, data: bytes) -> None:
        if self.lingering or self.stopped:
            return  # the answer is out, or the connection refused: what arrives is dropped
        if self.declined is not None:
            self.declined.feed(data)
            return
        if self.held:
            # reading is paused while bytes are held; a loop that still delivers some
            # keeps within the same bound
            self._hold(self.held + data)
            return
        self._feed(data)
        self._watch_head()

    def shutdown(self) -> None:
        """The server is shutting down: close an idle connection now, a busy one after
        the answer to the request read last."""
        cycle = self.cycle
        if cycle is None or cycle.response_complete:
            self.close_connection()
        else:
            cycle.keep_alive = False

    def closing(self) -> bool:
        """The connection is ending: closed, closing, or lingering after its last answer."""
        return self.lingering or self.real.is_closing()

    # --- flow control -------------------------------------------------------------------

    def pause_reads(self) -> None:
        if not self.read_paused:
            self.read_paused = True
            self.real.pause_reading()

    def resume_reads(self) -> None:
        """Resume reading paused by flow control (not while bytes are held: the full
        pipeline resumes it as it drains)."""
        if self.read_paused:
            self.read_paused = False
            if not self.held:
                self.real.resume_reading()

    async def drain(self) -> None:
        """Wait until the client reads again (or is gone). The waiter is shared and
        shielded: a cancelled sender does not cancel it for another."""
        waiter = self._drain
        if waiter is None or waiter.done():
            waiter = self._drain = self.loop.create_future()
        await asyncio.shield(waiter)

    def _release_writers(self) -> None:
        self.write_paused = False
        waiter, self._drain = self._drain, None
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def _live(self) -> list[Cycle]:
        cycles = [c for c in (self.running, self.cycle) if c is not None]
        cycles.extend(self.pipeline)
        return cycles

    def pause_writing(self) -> None:
        """The client reads slower than its answer comes (its buffers are full): one
        more stalled stream. Past --max-stalled-streams, the longest-stalled stream of
        the client holding the most is closed (its request ends as a hang-up, the
        engine's work is cancelled)."""
        self.write_paused = True
        for cycle in self._live():
            cycle.answer.tell_flow(True)
        stalled = self.stalled
        stalled[self] = self._owner()
        if len(stalled) <= self.max_stalled_streams:
            return
        oldest = guards.most_held(stalled)
        del stalled[oldest]
        self.on_reject("stalled_stream")
        self.refusals.warning(
            "stalled_stream",
            "closed a stream to %s: its client stopped reading, and more than %d "
            "others had too (--max-stalled-streams)",
            guards.peer(oldest.client),
            self.max_stalled_streams,
        )
        oldest.real.abort()

    def resume_writing(self) -> None:
        self.stalled.pop(self, None)
        self._release_writers()
        for cycle in self._live():
            cycle.answer.tell_flow(False)

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
            if self.stopped or self.lingering or self.real.is_closing():
                return
            if self.declined is not None:  # the rest is the declined upgrade's body
                self.declined.feed(view[pos:])
                return
            running = self.running
            busy = bool(self.pipeline) or (
                running is not None and not running.response_complete and not running.disconnected
            )  # self._busy(), inline: once per slice
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
                size = min(size, room, guards.SHORTEST * slots)
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
        self.idle_since = None  # bytes came: not idle (the keep-alive timer finds that)
        try:
            self.parser.feed_data(piece)
        except httptools.HttpParserUpgrade as exc:
            if not self.declining:
                self.stopped = True  # nothing after an upgrade request is HTTP (see below)
                return
            # an upgrade declined: its body follows the head (see the module)
            self.declining = False
            framing = (
                b"transfer-encoding: chunked\r\n"
                if self.body_left is None
                else b"content-length: %d\r\n" % self.body_left
            )
            self.declined = _DeclinedBody(self, framing)
            at = int(exc.args[0]) if exc.args else len(piece)
            if at < len(piece):
                self.declined.feed(piece[at:])
        except httptools.HttpParserError:
            if self.stopped:
                return  # refused from a callback: answered already
            if not self.in_head and self.cycle is not None:
                self._refuse_body()
                return
            server_log.warning(_INVALID)
            self.send_400_response(_INVALID)

    def _hold(self, rest: bytes) -> None:
        """The pipeline is full: keep what was read, parse it as answers go out."""
        if len(rest) > self.max_pipelined_bytes:
            self._refuse_pipeline(f"{len(rest)} bytes read ahead of a full pipeline")
            return
        self.held = rest
        self.real.pause_reading()

    def _resume_held(self) -> None:
        held, self.held = self.held, b""
        self._feed(held)
        self._watch_head()
        if not self.held and not self.stopped and not self.read_paused:
            self.real.resume_reading()

    # --- parser callbacks ---------------------------------------------------------------

    def on_message_begin(self) -> None:
        self.head_open = True
        if not self.raw:
            self.head_bytes = 0  # a head that began inside a slice: counted field by field
        self.in_trailers = False
        self.body_left = None
        self.url = b""
        self.expect_100_continue = False
        self.headers = []

    def on_url(self, url: bytes) -> None:
        if not self.raw:
            self._count(len(url))
        self.url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        if not self.raw:
            self._count(len(name) + len(value) + 4)
        if not self.in_head:
            # a trailer field: counted like a head, never merged into the request's
            # headers (the engine would receive it as one): dropped
            return
        if len(self.headers) >= self.max_header_fields:
            self._refuse_fields()
            raise _Refused
        name = name.lower()
        value = value.rstrip(b" \t")  # the parser keeps trailing whitespace: not the value's
        if name == b"expect" and value.lower() == b"100-continue":
            self.expect_100_continue = True
        self.headers.append((name, value))

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
        parser = self.parser
        try:
            url = httptools.parse_url(self.url)
        except httptools.HttpParserError:
            server_log.warning(_INVALID)
            self.send_400_response(_INVALID)
            raise _Refused from None
        raw_path = url.path
        path = raw_path.decode("ascii")
        if "%" in path:
            path = urllib.parse.unquote(path)
        root = self.root_path
        http_version = parser.get_http_version()
        if http_version not in ("1.1", "1.0"):
            self._refuse_version(http_version)
            raise _Refused
        scope = {
            "type": "http",
            "asgi": {"version": "3.0", "spec_version": "2.3"},
            "http_version": http_version,
            "server": self.server,
            "client": self.client,
            "scheme": self.scheme,
            "root_path": root,
            "headers": self.headers,
            "state": self.app_state.copy(),
            "method": parser.get_method().decode("ascii"),
            "path": root + path,
            "raw_path": root.encode("ascii") + raw_path if root else raw_path,
            "query_string": url.query or b"",
        }
        keep_alive = http_version != "1.0" and parser.should_keep_alive()
        self.body_left = content_length(self.headers)
        if parser.should_upgrade():
            # the parser reads nothing after an upgrade request it does not switch to:
            # this connection can carry no further request; a body it announced is read
            # by a parser of its own (see the module)
            keep_alive = False
            self.declining = bool(self.body_left) or (
                self.body_left is None and _chunked(self.headers)
            )
        before = self.cycle
        cycle = self.cycle = Cycle(self, scope, keep_alive, self.expect_100_continue)
        if before is None or before.response_complete:
            self.running = cycle
            self._start(cycle)
            return
        # pipelined: queued behind the one being answered
        self.pause_reads()
        self.pipeline.appendleft(cycle)
        if len(self.pipeline) > self.max_pipelined_requests:
            self.pipeline.popleft()  # never started
            self._refuse_pipeline(f"more than {self.max_pipelined_requests} requests read ahead")
            raise _Refused

    def _start(self, cycle: Cycle) -> None:
        cycle.answer.paused = self.write_paused
        task = self.loop.create_task(cycle.run_asgi(self.app))
        task.add_done_callback(self.tasks.discard)
        self.tasks.add(task)

    def on_body(self, body: bytes) -> None:
        self.in_trailers = False  # a chunk with data: not the last one
        if self.body_left is not None:
            self.body_left -= len(body)
        cycle = self.cycle
        if cycle is None or cycle.response_complete:
            return
        cycle.body += body
        if len(cycle.body) > HIGH_WATER:
            self.pause_reads()
        cycle.message_event.set()

    def on_chunk_header(self) -> None:
        """After a chunk's size line: if it was the last (size 0), a trailer section of
        any length may follow; it is counted against the head limit from here."""
        self.in_trailers = True
        self.raw = False
        self.head_bytes = 0

    def on_message_complete(self) -> None:
        if self.declining:
            return  # (the parser skips an upgrade request's body: it is yet to be read)
        self.in_trailers = False
        self.raw = False
        self.head_bytes = 0
        cycle = self.cycle
        if cycle is not None and not cycle.response_complete:
            cycle.more_body = False
            cycle.message_event.set()
        self.in_head = True

    def on_response_complete(self) -> None:
        """An answer is complete (its cycle calls this): the next queued request starts,
        or the keep-alive deadline does; a refusal waiting for its turn goes out."""
        following = self.pipeline[-1] if self.pipeline else None
        self.server_state.total_requests += 1
        if not self.closing():
            self.idle_since = None
            self.resume_reads()
            if self.pipeline:
                self._start(self.pipeline.pop())
            else:
                self._keep_alive()
        if following is not None and not (self.pipeline and self.pipeline[-1] is following):
            self.running = following  # the next queued request started
        if self.closing():
            return
        if self.pending is not None:
            if not self._busy():  # every request read before the refused one is answered
                answer, self.pending = self.pending, None
                self.real.write(answer)
                self._linger()
            return
        if self.held and len(self.pipeline) < self.max_pipelined_requests:
            self._resume_held()

    def send_400_response(self, msg: str) -> None:
        """The 400 for a request the parser rejects, after the answers to the requests
        read before it (written at once, it would cut into one of them)."""
        self.stopped = True
        answer = guards.parser_error(msg, self.default_headers)
        if not self._busy():
            self.real.write(answer)
            self.close_connection()
            return
        self._answer_in_turn(answer)

    # --- the keep-alive and header deadlines ---------------------------------------------

    def _keep_alive(self) -> None:
        """The connection is idle from now: closed once it has been for
        ``timeout_keep_alive``. One timer serves many answers: where one is pending (it
        fires no later than this deadline), :meth:`_keep_alive_due` looks again then."""
        self.idle_since = now = self.loop.time()
        if self.keep_alive_timer is None:
            self.keep_alive_timer = self.loop.call_at(
                now + self.timeout_keep_alive, self._keep_alive_due
            )

    def _keep_alive_due(self) -> None:
        self.keep_alive_timer = None
        since = self.idle_since
        if since is None:
            return  # busy since: the answer's end starts the deadline again
        due = since + self.timeout_keep_alive
        if self.loop.time() < due:
            self.keep_alive_timer = self.loop.call_at(due, self._keep_alive_due)
            return
        if not self.closing():
            self.close_connection()

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
        if not self.in_head or self.closing():
            return
        if self.cycle is not None and not self.cycle.response_complete:
            self._arm_head_timer()  # a request is being answered: its turn comes after
            return
        self.on_reject("header_timeout")
        self.refusals.warning(
            "header_timeout",
            "closed a connection from %s: no complete request head within %gs",
            guards.peer(self.client),
            self.header_timeout,
        )
        if not self.head_bytes:
            self.real.close()  # it never sent a byte: nothing to answer
            return
        self.real.write(guards.head_timeout(self.header_timeout))
        self._linger()

    # --- refusals -----------------------------------------------------------------------

    def _refuse_head(self, trailers: bool = False) -> None:
        reason = "trailers_too_large" if trailers else "head_too_large"
        self.on_reject(reason)
        self.refusals.warning(
            reason,
            "refused a request %s over %d bytes from %s",
            "trailer section" if trailers else "head",
            self.max_head_bytes,
            guards.peer(self.client),
        )
        self._refuse(
            guards.head_too_large(self.max_head_bytes, trailers),
            self.cycle if trailers else None,
        )

    def _refuse_fields(self) -> None:
        self.on_reject("too_many_headers")
        self.refusals.warning(
            "too_many_headers",
            "refused a request head of more than %d header fields from %s (--max-header-fields)",
            self.max_header_fields,
            guards.peer(self.client),
        )
        self._refuse(guards.too_many_fields(self.max_header_fields), None)

    def _refuse_version(self, version: str) -> None:
        self.on_reject("bad_version")
        self.refusals.warning(
            "bad_version",
            "refused a request of HTTP version %r from %s (only HTTP/1.0 and 1.1 are served)",
            version[:8],
            guards.peer(self.client),
        )
        self._refuse(guards.bad_version(), None)

    def _refuse_body(self) -> None:
        """The parser rejected the body (or trailer section) of the request read last: a
        malformed chunked body. Its request, waiting for the rest of the body, is told
        the client left, and the 400 goes out in its turn (at once when it is the one
        being answered), the connection closed after it."""
        self.on_reject("bad_chunked")
        self.refusals.warning(
            "bad_chunked",
            "refused a malformed chunked request body from %s",
            guards.peer(self.client),
        )
        self._refuse(guards.bad_body(), self.cycle)

    def _refuse_pipeline(self, why: str) -> None:
        self.on_reject("pipeline_full")
        self.refusals.warning(
            "pipeline_full",
            "refused a connection from %s: %s (--max-pipelined-requests %d, "
            "--max-pipelined-bytes %d)",
            guards.peer(self.client),
            why,
            self.max_pipelined_requests,
            self.max_pipelined_bytes,
        )
        self._refuse(guards.pipeline_full(self.max_pipelined_requests), None)

    def _refuse(self, answer: bytes, message: Cycle | None) -> None:
        """Refuse the connection: nothing more is parsed or held; the answer goes out in
        the refused request's turn, and the connection closes after it. `message` is
        the cycle of the request whose body or trailer section is refused (already
        created)."""
        self.stopped = True
        self.held = b""
        if message is not None:
            queued = message in self.pipeline
            if queued:
                self.pipeline.remove(message)  # never started: it is the refused request
            if not queued and message.response_complete:
                self._linger()  # answered already (a 401 before its body): only closed
                return
            if not queued and message is self.running:
                if message.response_started:
                    self.real.close()  # its answer is under way: it cannot be followed
                    return
                # its application waits for the rest of the body: it is told the client
                # left, and its answer is this one
                message.hang_up()
                message.answer.tell_lost()
        self._answer_in_turn(answer)

    def _answer_in_turn(self, answer: bytes) -> None:
        if self._busy():
            self.pending = answer
            self.real.resume_reading()  # what arrives is dropped; a hang-up is seen
            return
        self.real.write(answer)
        self._linger()

    # --- how the connection ends --------------------------------------------------------

    def eof_received(self) -> bool | None:
        """The client sent FIN: a hang-up, or a half-close after its request."""
        if self.eof_seen:
            return True  # told again (some loops do, when reading resumes): known
        self.eof_seen = True
        cycle = self.cycle
        if (
            self.lingering
            or cycle is None
            or cycle.more_body
            or cycle.response_started
            or self.pipeline
        ):
            # a hang-up (it cancels the request). Once the answer has started nothing
            # harmless can be sent to tell a half-close from a hang-up; a client that
            # half-closes does so right after its request, before any answer.
            return None
        # the whole request is in and its answer has not started: keep the connection for
        # writing, and find out whether the client is still there to read it
        cycle.keep_alive = False
        if cycle.scope["http_version"] == "1.1":
            self.real.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        self.peer_checks = 0
        self._schedule_peer_check()
        return True

    def close_connection(self) -> None:
        """Close after an answer: linger while the client is still sending its body."""
        cycle = self.cycle
        if cycle is not None and cycle.more_body and not self.lingering:
            self._linger()
        else:
            self.real.close()

    def _linger(self) -> None:
        """Half-close: the client reads the answer and its end; what it still sends is
        dropped until it closes too, or for up to header_timeout."""
        real = self.real
        self.lingering = True
        for cycle in self._live():
            cycle.answer.open = False  # nothing is written after the end of writing
        if self.head_timer is not None:
            self.head_timer.cancel()
            self.head_timer = None
        if real.is_closing():
            return
        if real.can_write_eof():
            real.write_eof()
        real.resume_reading()
        self.linger_timer = self.loop.call_later(self.header_timeout, real.close)

    def _schedule_peer_check(self) -> None:
        delay = _PEER_CHECKS[min(self.peer_checks, len(_PEER_CHECKS) - 1)]
        self.peer_timer = self.loop.call_later(delay, self._check_peer)

    def _check_peer(self) -> None:
        """After the client's FIN: a reset means it is gone (a hang-up)."""
        self.peer_timer = None
        real = self.real
        if real.is_closing() or self.cycle is None:
            return
        if self.cycle.response_started:
            return  # the answer's own writes fail if the client is gone
        sock = real.get_extra_info("socket")
        try:
            err = sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR) if sock else 0
        except OSError:
            err = 1
        if err:
            real.abort()  # the request is cancelled as a hang-up
            return
        self.peer_checks += 1
        self._schedule_peer_check()


def guarded_protocol(
    max_head_bytes: int,
    header_timeout: float,
    on_reject: Callable[[str], None],
    max_pipelined_requests: int = 16,
    max_pipelined_bytes: int = 64 * 1024,
    max_stalled_streams: int = 64,
    max_header_fields: int = 100,
) -> type[Http1Protocol]:
    """The protocol class for one server, with its limits and its refusal counter (and a
    stalled-stream table of its own)."""
    return type(
        "Http1Protocol",
        (Http1Protocol,),
        {
            "max_head_bytes": max_head_bytes,
            "max_header_fields": max_header_fields,
            "header_timeout": header_timeout,
            "max_pipelined_requests": max_pipelined_requests,
            "max_pipelined_bytes": max_pipelined_bytes,
            "stalled": {},
            "max_stalled_streams": max_stalled_streams,
            "on_reject": staticmethod(on_reject),
            "refusals": LimitedLog(log),
        },
    )


def _chunked(headers: list[tuple[bytes, bytes]]) -> bool:
    return any(k == b"transfer-encoding" and b"chunked" in v.lower() for k, v in headers)


class _DeclinedBody:
    """The body of an upgrade request whose upgrade is declined: httptools skips the body
    of a request it takes for an upgrade, so the bytes after its head are parsed here, by
    a parser of their own given the request's framing; what it reads goes to the
    connection's own body callbacks (its flow control, limits and trailer guard with it).
    The connection carries nothing after this request."""

    __slots__ = ("conn", "parser")

    def __init__(self, conn: Http1Protocol, framing: bytes) -> None:
        self.conn = conn
        self.parser = httptools.HttpRequestParser(self)
        self.parser.feed_data(b"POST / HTTP/1.1\r\n" + framing + b"\r\n")

    def feed(self, data: bytes | memoryview) -> None:
        conn = self.conn
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError:
            if not conn.stopped:
                conn._refuse_body()

    def on_header(self, name: bytes, value: bytes) -> None:
        self.conn.on_header(name, value)  # (a trailer field: counted, dropped)

    def on_body(self, body: bytes) -> None:
        self.conn.on_body(body)

    def on_chunk_header(self) -> None:
        self.conn.on_chunk_header()

    def on_message_complete(self) -> None:
        conn = self.conn
        conn.declined = None
        conn.stopped = True  # nothing after it is parsed: the connection closes
        conn.on_message_complete()
