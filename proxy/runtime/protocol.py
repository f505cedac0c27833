"""The HTTP/1.1 server protocol phasewatch runs: uvicorn's httptools protocol, guarded.

uvicorn's httptools protocol buffers a request head without bound (one connection's
100 MiB of headers is 100 MiB, and a single huge value stalls the loop) and gives a
client all the time it likes to send one (a thousand slow clients hold a thousand
connections). Its h11 protocol has a head limit, but is several times slower per
request. So phasewatch keeps httptools and adds, before any application code runs:

- a **head limit** (``--max-head-bytes``): the bytes of each request head are counted as
  they arrive, before the parser sees them; past the limit the client gets a 431 and the
  connection is closed, having cost at most the limit (plus one socket read);
- a **header deadline** (``--header-timeout``): from a connection's start, and from the
  first byte of each later request, until its head is complete; past it the client gets
  a 408 (a connection that sent nothing is just closed).

Upgrade requests stay HTTP requests (a websocket one gets a 501 from the application);
the parser reads nothing after one, so such a connection closes after its answer.

And two fixes to how a connection ends:

- **half-close**: a client that half-closes (sends FIN) after a complete request still
  gets its answer. Whether it is still there or gone cannot be told from a FIN alone, so
  the server sends an interim ``100 Continue`` (every HTTP/1.1 client must skip 1xx
  answers it did not expect): a client that closed its socket answers it with a reset,
  and its request is cancelled as a hang-up, as before;
- **lingering close**: when the server answers before it has read the whole request
  body (413, 401, 431 ...) and the connection is to close, closing at once would reset
  the connection under the client's feet and lose the answer. The server half-closes
  instead and reads and drops what the client still sends, for up to
  ``--header-timeout``, then closes.

Each refusal counts in ``phasewatch_rejected_total{reason}`` and is said in the log (at
most one line per reason per 10 s, with how many it folded in).
"""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import Callable
from typing import Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from ..core.errors import json_error
from ..core.limited import LimitedLog

log = logging.getLogger(__name__)

#: After a client's FIN, when to look for its reset (seconds after the probe), then
#: every second until its answer starts.
_PEER_CHECKS = (0.002, 0.01, 0.05, 0.2, 1.0)


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
    still sending a body nobody will read."""

    def __init__(self, real: asyncio.Transport, protocol: GuardedProtocol) -> None:
        self._real = real
        self._protocol = protocol
        self.write = real.write
        self.writelines = real.writelines
        self.get_extra_info = real.get_extra_info
        self.pause_reading = real.pause_reading
        self.resume_reading = real.resume_reading
        self.set_protocol = real.set_protocol
        self.abort = real.abort

    def close(self) -> None:
        self._protocol.close_connection()

    def is_closing(self) -> bool:
        return self._protocol.lingering or self._real.is_closing()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)


class GuardedProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with a head limit, a header deadline, half-close and
    lingering close. :func:`guarded_protocol` makes one per server, with its limits."""

    max_head = 64 * 1024
    header_timeout = 10.0
    #: Called with the reason of each refusal (the metrics counter).
    on_reject: Callable[[str], None] = staticmethod(lambda reason: None)
    refusals = LimitedLog(log)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.real: asyncio.Transport | None = None
        self.in_head = True  # the next bytes belong to a request head
        self.head_bytes = 0
        self.head_timer: asyncio.TimerHandle | None = None
        self.lingering = False  # answered and closing: what arrives is dropped
        self.linger_timer: asyncio.TimerHandle | None = None
        self.peer_timer: asyncio.TimerHandle | None = None
        self.peer_checks = 0
        self.eof_seen = False

    # --- the connection -----------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.real = transport  # type: ignore[assignment]
        super().connection_made(_Transport(transport, self))  # type: ignore[arg-type]
        self._arm_head_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        for timer in (self.head_timer, self.linger_timer, self.peer_timer):
            if timer is not None:
                timer.cancel()
        self.head_timer = self.linger_timer = self.peer_timer = None
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self.lingering:
            return  # the answer is out; what the client still sends is dropped
        if self.in_head:
            if self.head_timer is None:
                self._arm_head_timer()
            room = self.max_head - self.head_bytes
            if len(data) > room:
                if room > 0:
                    self.head_bytes += room
                    super().data_received(data[:room])
                    if self.lingering or self.transport.is_closing():
                        return
                if self.in_head:  # the head did not end within the limit
                    self._refuse_head()
                    return
                data = data[room:]
            else:
                self.head_bytes += len(data)
        super().data_received(data)

    def eof_received(self) -> bool | None:  # type: ignore[override]
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
            # a hang-up (it cancels the request, as before). Once the answer has started
            # nothing harmless can be sent to tell a half-close from a hang-up; a client
            # that half-closes does so right after its request, before any answer.
            return None
        # the whole request is in and its answer has not started: keep the connection for
        # writing, and find out whether the client is still there to read it
        cycle.keep_alive = False
        if self.scope.get("http_version") == "1.1":
            self.transport.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        self.peer_checks = 0
        self._schedule_peer_check()
        return True

    # --- parser callbacks ---------------------------------------------------------------

    def on_headers_complete(self) -> None:
        self.in_head = False
        self.head_bytes = 0
        if self.head_timer is not None:
            self.head_timer.cancel()
            self.head_timer = None
        super().on_headers_complete()
        if self.parser.should_upgrade() and self.cycle:
            # the parser reads nothing after an upgrade request it does not switch to:
            # this connection can carry no further request
            self.cycle.keep_alive = False

    def on_message_complete(self) -> None:
        super().on_message_complete()
        self.in_head = True

    def _should_upgrade(self) -> bool:
        """No protocol switch: an upgrade request is an HTTP request like any other (the
        application refuses a websocket one with a 501; others are relayed without their
        Upgrade header), and the connection closes after its answer."""
        return False

    def _unsupported_upgrade_warning(self) -> None:
        """Bytes after an upgrade request are dropped, without a log line for each."""

    # --- the guards ---------------------------------------------------------------------

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

    def _refuse_head(self) -> None:
        self.on_reject("head_too_large")
        self.refusals.warning(
            "head_too_large",
            "refused a request head over %d bytes from %s",
            self.max_head,
            _peer(self.client),
        )
        if self.cycle is not None and not self.cycle.response_complete:
            # a pipelined head during an answer: no 431 can be written now; the
            # connection ends with that answer
            self.cycle.keep_alive = False
            self.lingering = True
            assert self.real is not None
            self.real.pause_reading()
            return
        self.transport.write(
            _answer(
                431,
                b"Request Header Fields Too Large",
                f"request head over {self.max_head} bytes",
                "request_header_too_large",
            )
        )
        self._linger()

    def close_connection(self) -> None:
        """uvicorn closes the connection: linger while the client is still sending."""
        assert self.real is not None
        cycle = self.cycle
        if cycle is not None and cycle.more_body and not self.lingering:
            self._linger()
        else:
            self.real.close()

    def _linger(self) -> None:
        """Half-close: the client reads the answer and its end; what it still sends is
        dropped until it closes too, or for up to header_timeout."""
        real = self.real
        assert real is not None
        self.lingering = True
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
        if real is None or real.is_closing() or self.cycle is None:
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


def _peer(client: tuple[str, int] | None) -> str:
    return f"{client[0]}:{client[1]}" if client else "unknown"


def guarded_protocol(
    max_head: int, header_timeout: float, on_reject: Callable[[str], None]
) -> type[GuardedProtocol]:
    """The protocol class for one server, with its limits and its refusal counter."""
    return type(
        "GuardedProtocol",
        (GuardedProtocol,),
        {
            "max_head": max_head,
            "header_timeout": header_timeout,
            "on_reject": staticmethod(on_reject),
            "refusals": LimitedLog(log),
        },
    )
