"""One upstream HTTP/1.1 connection of the lean transport (:mod:`.lean`): an asyncio
protocol that sends a request and parses its answer with httptools' C parser, one callback
per read. The answer's head waits here for the sender; its body either waits here for a
reader task (``aiter_raw``: probes and anything else reading through httpx) or goes, read
by read, to the relay's callbacks in the connection's own callback (:meth:`Connection.relay`,
the ``phasewatch.relay`` response extension). Every failure becomes httpx's matching
exception. The pool of such connections, and the transport's promises, are :mod:`.lean`'s.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, cast

import httptools
import httpx

from .wire import chunked_only, whole_chunk

if TYPE_CHECKING:
    from .lean import LeanTransport

log = logging.getLogger(__name__)

_HIGH_WATER = 256 * 1024


#: A relayed body's reader: `read(body, framed)` takes the body bytes of one read, and,
#: when the read was exactly one chunk, that chunk as it came (its size line, the piece,
#: its CRLF), else None.
Read = Callable[[bytes, "bytes | None"], None]
#: `end(error)`: the body is over, whole (None) or with httpx's exception for why not.
End = Callable[["Exception | None"], None]
#: `hold(paused)`: pause (True) or resume (False) reading the body.
Hold = Callable[[bool], None]


def named(method: str, url: httpx.URL, request: httpx.Request | None) -> httpx.Request:
    """The request an error names: the one given, else one made for the error alone."""
    return request if request is not None else httpx.Request(method, url)


class Stale(Exception):
    """A connection closed before any response byte came."""


class Connection(asyncio.Protocol):
    """One upstream connection, one response at a time."""

    transport: asyncio.Transport  # set by connection_made, before anything uses it

    def __init__(self, pool: LeanTransport, key: tuple) -> None:
        self.pool = pool
        self.key = key
        self.parser = httptools.HttpResponseParser(self)
        self.loop = asyncio.get_running_loop()
        self.closed = False
        self.idle_since = 0.0
        self.write_paused = False
        #: The read deadline's timer and when it fires. It outlives a request: the next
        #: one on this connection takes it over where it fires no later than that
        #: request's own deadline (see :meth:`_on_timer`), so a kept-alive connection
        #: makes a timer a read-timeout period, not one a request.
        self.timer: asyncio.TimerHandle | None = None
        self.timer_at = 0.0
        self._reset()

    def _reset(self) -> None:
        self.status = 0
        self.reason = b""
        self.headers: list[tuple[bytes, bytes]] = []
        self.headers_done = False
        self.head_bytes = 0
        self.chunks: list[bytes] = []
        self.size = 0
        self.complete = False
        self.keep_alive = False
        self.unexpected = False
        self.error: Exception | None = None
        self.waiter: asyncio.Future | None = None
        self.got_bytes = False
        self.head = False
        self.paused = False
        self.last = 0.0
        self.timeout: float | None = None
        #: A request was sent and its answer is awaited or being read.
        self.asked = False
        self.method = ""
        self.url: httpx.URL | None = None
        self._request: httpx.Request | None = None
        #: The relay's callbacks (:meth:`relay`): the body goes to `reader` as it is
        #: parsed, its end to `ender`, once (`ended`).
        self.reader: Read | None = None
        self.ender: End | None = None
        self.ended = False
        #: The parser stands between two chunks of a chunked body (nothing of one held).
        self.edge = False

    # --- asyncio.Protocol ---------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's is not a subclass

    def data_received(self, data: bytes) -> None:
        if not self.asked or self.complete:
            # nothing was asked: an unsolicited response or trailing bytes
            self.unexpected = True
            self.transport.close()
            return
        self.got_bytes = True
        self.last = self.loop.time()
        read = self.reader
        if read is not None and self.edge and not self.chunks and self.error is None:
            # a paced stream's read is one whole chunk: it needs no parser (which stays
            # between chunks), and its framing may go on to the client as it came
            body = whole_chunk(data)
            if body is not None:
                try:
                    read(body, data)
                except Exception as exc:  # noqa: BLE001 - the relay's, raised where it awaits
                    self._broken(exc)
                return
        self.edge = False
        counting = not self.headers_done
        if counting:
            self.head_bytes += len(data)
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            self._upgraded()
        except httptools.HttpParserError as exc:
            if self.complete:
                # the parser stops after a 101 it did not take as an upgrade (no
                # Connection: upgrade): what follows is another protocol, as with one
                self._upgraded()
                self._wake()
                self._settle()
            else:
                self._deliver()  # what was parsed before the fault goes first
                self._fail(
                    httpx.RemoteProtocolError(
                        f"malformed response from upstream: {exc}", request=self.request
                    )
                )
            self.unexpected = True
            self.transport.close()
            return
        if (
            counting
            and self.head_bytes > self.pool.upstream_max_head_bytes
            and not self.headers_done
        ):
            self._head_too_large()
            return
        if self.edge and data[-2:] != b"\r\n":
            self.edge = False  # a chunk's size line begun: the parser holds it
        if read is not None:
            self._settle()
            return
        if self.size > _HIGH_WATER and not self.paused:
            self.paused = True
            self.transport.pause_reading()
        waiter = self.waiter
        if waiter is not None and (self.chunks or self.complete or self.headers_done):
            self.waiter = None
            if not waiter.done():
                waiter.set_result(None)

    def eof_received(self):
        return False  # close our side too

    def connection_lost(self, exc) -> None:
        self.closed = True
        self._stop_timer()
        self.pool.on_closed()
        if not self.asked or self.complete:
            return
        if exc is None and self.headers_done and self._close_delimited():
            self.complete = True  # the body ends with the connection (a clean close only)
            self._wake()
            self._settle()
        elif not self.got_bytes:
            self._fail(Stale())
        else:
            why = f": {exc}" if exc else ""
            self._fail(
                httpx.RemoteProtocolError(
                    f"upstream closed the connection before the response ended{why}",
                    request=self.request,
                )
            )

    def pause_writing(self) -> None:
        self.write_paused = True

    def resume_writing(self) -> None:
        self.write_paused = False
        self._wake()

    # --- httptools callbacks ------------------------------------------------------------

    def on_message_begin(self) -> None:
        if self.complete:
            self.unexpected = True  # a second response to one request

    def on_status(self, status: bytes) -> None:
        if not self.complete:
            self.reason += status

    def on_header(self, name: bytes, value: bytes) -> None:
        if not self.headers_done:  # trailers and a second response's head are dropped
            self.headers.append((name, value))

    def on_headers_complete(self) -> None:
        if self.complete:
            return
        status = self.parser.get_status_code()
        if status < 200 and status != 101:  # 1xx: another head follows
            self.headers, self.reason = [], b""
            return
        self.status = status
        self.headers_done = True
        if sum(len(k) + len(v) + 4 for k, v in self.headers) > self.pool.upstream_max_head_bytes:
            self._head_too_large()
            return
        if self.head or status in (204, 304):
            self.complete = True  # no body (HEAD is closed after: its Content-Length lies)
            self.keep_alive = False
        else:
            self.edge = chunked_only(self.headers)

    def on_chunk_header(self) -> None:
        self.edge = False

    def on_chunk_complete(self) -> None:
        self.edge = True

    def on_body(self, body: bytes) -> None:
        if not self.complete:
            self.chunks.append(body)
            self.size += len(body)

    def on_message_complete(self) -> None:
        if self.status == 0 or (self.complete and not self.head):  # 1xx, or a second one
            return
        self.complete = True
        self.keep_alive = self.parser.should_keep_alive() and not self.head

    # --- helpers --------------------------------------------------------------------------

    def _upgraded(self) -> None:
        """A 101 (or a CONNECT answer): the bytes after it are another protocol."""
        self.status = self.status or self.parser.get_status_code()
        self.headers_done = self.complete = True
        self.keep_alive = False
        self.unexpected = True

    def _head_too_large(self) -> None:
        if self.error is not None:
            return
        limit = self.pool.upstream_max_head_bytes
        log.warning(
            "upstream response head over the limit; connection closed",
            extra={"fields": {"limit_bytes": limit, "upstream": self.pool.name}},
        )
        self.headers_done = False
        self._fail(
            httpx.RemoteProtocolError(
                f"upstream response head over {limit} bytes (--upstream-max-head-bytes)",
                request=self.request,
            )
        )
        self.unexpected = True
        self.transport.close()

    def _close_delimited(self) -> bool:
        for k, v in self.headers:
            k = k.lower()
            if k == b"content-length" or (k == b"transfer-encoding" and b"chunked" in v.lower()):
                return False
        return True

    def _fail(self, exc: Exception) -> None:
        if self.error is None:
            self.error = exc
        self._wake()
        self._settle()

    def _broken(self, exc: Exception) -> None:
        """The relay's reader raised: the body ends with its exception, the connection
        is closed (what it was answering is half-read)."""
        self.unexpected = True
        self._fail(exc)
        self.transport.close()

    def _deliver(self) -> None:
        """The body parsed and not yet read, to the relay's reader (one call)."""
        chunks = self.chunks
        read = self.reader
        if not chunks or read is None or self.ended:
            return
        data = chunks[0] if len(chunks) == 1 else b"".join(chunks)
        chunks.clear()
        self.size = 0
        try:
            read(data, None)
        except Exception as exc:  # noqa: BLE001 - the relay's, raised where it awaits
            self._broken(exc)

    def _settle(self) -> None:
        """With a relay reading: what was parsed to its reader, then, once the body is
        over (whole, or failed), its end."""
        if self.reader is None or self.ended:
            return
        self._deliver()
        end = self.ender
        if self.ended or end is None or not (self.complete or self.error is not None):
            return
        self.ended = True
        end(self.error)

    def _wake(self) -> None:
        waiter = self.waiter
        if waiter is not None:
            self.waiter = None
            if not waiter.done():
                waiter.set_result(None)

    def _on_timer(self) -> None:
        self.timer = None
        if not self.asked or self.complete or self.error is not None or self.timeout is None:
            return  # no answer awaited (the request that armed it is over): dropped
        due = self.last + self.timeout
        now = self.loop.time()
        # the reader waits on the engine (not on its client, nor on its own decoding)
        waiting = self.waiter is not None or (self.reader is not None and not self.paused)
        if waiting and now >= due:
            self._fail(
                httpx.ReadTimeout(
                    f"upstream sent nothing for {self.timeout:g}s", request=self.request
                )
            )
        else:  # data came since, or the client is slow to take it: look again later
            self._arm(due if due > now else now + self.timeout)

    def _arm(self, when: float) -> None:
        self.timer_at = when
        self.timer = self.loop.call_at(when, self._on_timer)

    def _stop_timer(self) -> None:
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None

    @property
    def request(self) -> httpx.Request:
        """The request being answered, as the errors that name it take it (made for them
        when it was sent without one: :meth:`LeanTransport.send`)."""
        if self._request is None:
            assert self.url is not None  # asked only after start()
            self._request = httpx.Request(self.method, self.url)
        return self._request

    def start(
        self,
        method: str,
        url: httpx.URL,
        request: httpx.Request | None,
        read_timeout: float | None,
    ) -> None:
        self._reset()
        self.asked = True
        self.method, self.url, self._request = method, url, request
        self.head = method == "HEAD"
        self.timeout = read_timeout
        self.last = now = self.loop.time()
        if read_timeout is None:
            self._stop_timer()
        elif self.timer is None or self.timer_at > now + read_timeout:
            self._stop_timer()
            self._arm(now + read_timeout)

    async def wait(self) -> None:
        """Until something new arrived (data, the end, an error, room to write)."""
        self.waiter = self.loop.create_future()
        await self.waiter

    async def drain(self, timeout: float | None) -> None:
        """Until the request is written (or the engine answered or failed first)."""
        if not self.write_paused:
            return
        deadline = None if timeout is None else self.loop.time() + timeout
        while self.write_paused and not self.headers_done and self.error is None:
            left = None if deadline is None else deadline - self.loop.time()
            if left is not None and left <= 0:
                raise httpx.WriteTimeout(
                    f"upstream took no request bytes for {timeout:g}s", request=self.request
                )
            try:
                await asyncio.wait_for(self.wait(), left)
            except TimeoutError:
                continue

    def take(self) -> bytes:
        chunks = self.chunks
        data = chunks[0] if len(chunks) == 1 else b"".join(chunks)
        chunks.clear()
        self.size = 0
        if self.paused:
            self.paused = False
            self.last = self.loop.time()
            self.transport.resume_reading()
        return data

    def relay(self, read: Read, end: End) -> Hold:
        """The body from now on goes to `read`, each read's bytes in one call from the
        connection's own callback (what was parsed before, at once), and its end to
        `end`, once: None when it is whole, httpx's exception when it broke (or the
        exception `read` raised, after which the connection is closed). Returns
        :meth:`hold`, the reader's backpressure. Why: a relayed body then costs no task
        wake-up per read, and its reader decides when reading waits."""
        self.reader, self.ender = read, end
        if self.paused:  # paused for the reader that was not there yet
            self.hold(False)
        self._settle()
        return self.hold

    def hold(self, paused: bool) -> None:
        """Pause or resume reading the relayed body. While paused the read deadline does
        not run (its reader waits on its client, or on its own work); it counts again
        from the resume."""
        if paused == self.paused or self.transport.is_closing():
            return
        self.paused = paused
        if paused:
            self.transport.pause_reading()
        else:
            self.last = self.loop.time()
            self.transport.resume_reading()

    def finish(self) -> None:
        self.reader = self.ender = None  # (the read timer stays for the next request)
        self.asked = False
        self._request = None
        if self.paused:  # a reader that held it to the end: the next request reads
            self.paused = False
            if not self.transport.is_closing():
                self.transport.resume_reading()

    def reusable(self) -> bool:
        return (
            self.complete
            and self.keep_alive
            and not self.closed
            and not self.unexpected
            and not self.chunks
        )
